"""Lossless packed BF16 KV (`--kv-dtype bf16p`, pallas_kernels/kv_bf16p.py): every value comes back
bit for bit however the rows were written, attention and a whole engine give the same bits as BF16
KV, and a request whose K/V cannot be packed fails alone."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_bf16p as kb

nKV, P, bs, hd, E = 2, 6, 16, 8, kb.ESCAPES
TABLE = [3, 1, 4]


def slot(p: int) -> int:
    return TABLE[p // bs] * bs + p % bs


def rows(rng, n, tiny=0.02):
    """n tokens [n, nKV, hd] bf16 with wide exponent spans: some values 2^-20 of the others, some
    zeros and subnormals."""
    x = rng.normal(size=(n, nKV, hd)) * np.exp2(rng.integers(-3, 4, (n, nKV, 1)))
    x = np.where(rng.random(x.shape) < tiny, x * 2.0 ** -20, x)
    x = np.where(rng.random(x.shape) < 0.01, 0.0, x)
    x = np.where(rng.random(x.shape) < 0.01, 1e-39, x)                 # subnormal in bf16
    return jnp.asarray(x, jnp.bfloat16)


def empty():
    return (jnp.zeros((nKV, P, bs, kb.code_dims(hd)), jnp.uint8), jnp.zeros((nKV, P, bs), jnp.float32),
            jnp.zeros((nKV, P, E), jnp.int32))


def read(pool, base, esc):
    """The sequence's first 40 tokens back: [40, nKV, hd] bf16."""
    got = kb.decode_rows(pool[:, TABLE], base[:, TABLE], esc[:, TABLE])        # [nKV, 3, bs, hd]
    return np.asarray(got).reshape(nKV, 3 * bs, hd)[:, :40].swapaxes(0, 1)


def bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("pieces", [[(0, 40)], [(0, 1), (1, 17), (17, 18), (18, 40)], [(i, i + 1) for i in range(40)]])
def test_every_value_comes_back_bit_for_bit(pieces):
    rng = np.random.default_rng(1)
    x = rows(rng, 40)
    state = empty()
    slots = jnp.asarray([slot(p) for p in range(40)])
    for lo, hi in pieces:
        *state, lost = kb.write(*state, x[lo:hi], slots[lo:hi])
        assert not np.asarray(lost).any()
    assert (np.asarray(state[2]) != 0).any()                                   # escapes were needed
    np.testing.assert_array_equal(bits(read(*state)), bits(x))


def test_a_block_out_of_escapes_reports_its_tokens_and_the_next_owner_starts_afresh():
    rng = np.random.default_rng(2)
    x = rows(rng, 16, tiny=0.2)                    # ~ 0.2 x 16 x 8 = 25 escapes a head: more than E
    state = empty()
    slots = jnp.asarray([slot(p) for p in range(16)])
    *state, lost = kb.write(*state, x, slots)
    lost = np.asarray(lost)
    assert lost.any() and not lost[0]               # the first escapes fit, the later tokens do not
    y = rows(rng, 16)                               # a new owner of the block, from its first slot
    *state, lost = kb.write(*state, y, slots)
    assert not np.asarray(lost).any()
    got = kb.decode_rows(state[0][:, TABLE[0]], state[1][:, TABLE[0]], state[2][:, TABLE[0]])
    np.testing.assert_array_equal(bits(np.asarray(got).swapaxes(0, 1)), bits(y))


def test_rewriting_a_copied_block_past_the_copy_point_drops_the_old_escapes():
    rng = np.random.default_rng(3)
    old, new = rows(rng, 16, tiny=0.04), rows(rng, 11, tiny=0.04)
    slots = jnp.asarray([slot(p) for p in range(16)])
    state = empty()
    *state, lost = kb.write(*state, old, slots)                 # the block as cached
    *state, lost2 = kb.write(*state, new, slots[5:])            # a request sharing rows 0-4 writes on
    assert not np.asarray(lost).any() and not np.asarray(lost2).any()
    got = np.asarray(kb.decode_rows(state[0][:, TABLE[0]], state[1][:, TABLE[0]], state[2][:, TABLE[0]])).swapaxes(0, 1)
    np.testing.assert_array_equal(bits(got[:5]), bits(old[:5]))
    np.testing.assert_array_equal(bits(got[5:]), bits(new))


def packed_pools(rng, nKV_, P_, bs_, hd_):
    """Random bf16 pools [nKV, P, bs, hd] (wide exponent spans) and the same packed as bf16p."""
    k = jnp.asarray(rng.normal(size=(nKV_, P_, bs_, hd_)) * np.where(rng.random((nKV_, P_, bs_, hd_)) < 0.002, 2.0 ** -20, 1.0),
                    jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(nKV_, P_, bs_, hd_)), jnp.bfloat16)
    slots = jnp.arange(P_ * bs_)
    out = {}
    for name, x in (("k", k), ("v", v)):
        pool = jnp.zeros((nKV_, P_, bs_, kb.code_dims(hd_)), jnp.uint8)
        base = jnp.zeros((nKV_, P_, bs_), jnp.float32)
        esc = jnp.zeros((nKV_, P_, E), jnp.int32)
        pool, base, esc, lost = kb.write(pool, base, esc, x.reshape(nKV_, -1, hd_).swapaxes(0, 1), slots)
        assert not np.asarray(lost).any()
        out[name] = (pool, base, esc)
    quant = dict(k_scale=out["k"][1], v_scale=out["v"][1], k_esc=out["k"][2], v_esc=out["v"][2], fmts=("bf16p", "bf16p"))
    assert (np.asarray(out["k"][2]) != 0).any()                       # escapes in play
    return (k, v), (out["k"][0], out["v"][0]), quant


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpret"),
                                       pytest.param(False, id="compiled", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_attention_on_bf16p_pools_is_bit_identical_to_bf16(kind, interpret):
    """The kernels rebuild each tile exactly and keep a BF16 pool's tiling: the same bits out."""
    from pallas_kernels import paged_decode_attention as pda
    from pallas_kernels import ragged_paged_attention as rpa
    rng = np.random.default_rng(5)
    nH, nKV_, hd_, bs_, B, M = 8, 2, 64, 16, 2, 6
    P_ = B * M + 1
    (k, v), (kp, vp), quant = packed_pools(rng, nKV_, P_, bs_, hd_)
    bt = jnp.asarray(rng.permutation(P_)[:B * M].reshape(B, M), jnp.int32)
    if kind == "decode":
        q = jnp.asarray(rng.normal(size=(B, nH, hd_)), jnp.bfloat16)
        lens = jnp.asarray([70, 96], jnp.int32)
        bsz = pda.BlockSizes(pages_per_compute_block=2, pages_per_split=4)
        run = lambda kk, vv, **kw: pda.paged_decode_attention(q, kk, vv, bt, lens, block_sizes=bsz,  # noqa: E731
                                                              interpret=interpret, **kw)
        ref = lambda kk, vv, **kw: pda.paged_decode_attention_reference(q, kk, vv, bt, lens, **kw)  # noqa: E731
    else:
        q = jnp.asarray(rng.normal(size=(24, nH, hd_)), jnp.bfloat16)
        cu, lens = jnp.asarray([0, 5, 21], jnp.int32), jnp.asarray([40, 90], jnp.int32)
        bsz = rpa.BlockSizes(block_rows=32, pages_per_compute_block=2)
        run = lambda kk, vv, **kw: rpa.ragged_paged_attention(q, kk, vv, bt, lens, cu, block_sizes=bsz,  # noqa: E731
                                                              interpret=interpret, **kw)
        ref = lambda kk, vv, **kw: rpa.ragged_paged_attention_reference(q, kk, vv, bt, lens, cu, **kw)  # noqa: E731
    np.testing.assert_array_equal(bits(run(kp, vp, **quant)), bits(run(k, v)))
    np.testing.assert_array_equal(bits(ref(kp, vp, **quant)), bits(ref(k, v)))


@pytest.fixture(scope="module")
def tiny_bf16(smollm):
    """A small random Llama in bfloat16 (bf16p packs bfloat16 K/V)."""
    import dataclasses
    import jax
    from infernix_jax.loader import LoadedModel
    from infernix_jax.models import init_params
    cfg = dataclasses.replace(smollm.cfg, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16, scale=0.5)
    return LoadedModel(name="tiny-bf16", path=smollm.path, cfg=cfg, params=params, tokenizer=smollm.tokenizer,
                       dtype=jnp.bfloat16)


def _run(model, prompts, n=8, **kw):
    from infernix_jax.engine import Engine, Request, SamplingParams
    eng = Engine(model, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=2, max_model_len=192, **kw)
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    return eng, [eng.generate([Request(list(x), p)])[0] for x in prompts]      # one after another: prefix hits


@pytest.mark.extended
@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_an_engine_on_bf16p_kv_is_bit_identical_to_bf16(tiny_bf16, impl):
    rng = np.random.default_rng(6)
    shared = list(map(int, rng.integers(10, 40000, 40)))
    prompts = [shared + list(map(int, rng.integers(10, 40000, n))) for n in (3, 20)]
    _, want = _run(tiny_bf16, prompts, attn_impl=impl)
    eng, got = _run(tiny_bf16, prompts, attn_impl=impl, kv_dtype="bf16p")
    _, again = _run(tiny_bf16, prompts, attn_impl=impl, kv_dtype="bf16p", prefix_cache_ram_gib=0.01, ram_resize="off")
    for a, b in zip(want, got):                                  # tokens and log-probs, bit for bit
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert [r.token_ids for r in again] == [r.token_ids for r in want]
    assert any(r.cached_tokens for r in got)                     # the second shared the first's blocks
    assert any(np.asarray(e).any() for e in eng.runner.kv.k_esc + eng.runner.kv.v_esc)   # escapes in play
    # per head and block: 16 rows x (16 sign|mantissa bytes + 8 nibble bytes + a 4-byte base) + 8 escapes
    # (0.94x bf16 at this toy head_dim of 16; 0.77x at 128)
    assert eng.plan.block_bytes == 2 * 2 * 2 * (16 * (16 + 8 + 4) + 4 * kb.ESCAPES)


@pytest.mark.extended
def test_a_request_whose_kv_cannot_be_packed_fails_alone(tiny_bf16, monkeypatch):
    from infernix_jax.engine.runner import Runner
    rng = np.random.default_rng(7)
    prompts = [list(map(int, rng.integers(10, 40000, n))) for n in (30, 50)]
    _, want = _run(tiny_bf16, prompts[1:])
    # a nibble window of 2 binades and no escape slots: every block overflows; the device reports
    # the blocks it could not pack, and the request fails with a clear error
    import jax
    from infernix_jax.engine import Engine, Request, SamplingParams
    monkeypatch.setattr(kb, "ESCAPES", 0)
    monkeypatch.setattr(kb, "FAR", 1)
    jax.clear_caches()                                      # (the steps traced the real window)
    eng = Engine(tiny_bf16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=192, kv_dtype="bf16p")
    events = []
    res = eng.generate([Request(prompts[0], SamplingParams(max_tokens=8, temperature=0), on_event=events.append)])
    assert res[0].finish_reason == "abort"
    assert any(e.kind == "error" and "cannot be stored losslessly" in e.message for e in events)
    monkeypatch.undo()
    jax.clear_caches()
    # one request's blocks lost: it fails, the other runs on to the same tokens as alone
    eng, _ = _run(tiny_bf16, [], kv_dtype="bf16p")
    take = Runner.take_lost
    victim = {}

    def lost_once(self):
        real = take(self)
        if "seq" in victim and not victim.get("done"):
            victim["done"] = True
            return real | set(victim["seq"].block_ids)
        return real
    monkeypatch.setattr(Runner, "take_lost", lost_once)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    victim["seq"] = eng.add(Request(prompts[0], p))
    other = eng.add(Request(prompts[1], p))
    while other.status.name != "FINISHED":
        eng.step()
    assert victim["seq"].finish_reason == "abort" and other.out_ids == want[0].token_ids


@pytest.mark.extended
def test_bf16p_blocks_come_back_from_the_ssd_tier_and_the_cache_file(tiny_bf16, tmp_path):
    from infernix_jax.engine import Engine, Request, SamplingParams
    from infernix_jax.cache.host_tier import GiB
    from infernix_jax.models.kv_pool import kv_bytes_per_block
    rng = np.random.default_rng(9)
    system = list(map(int, rng.integers(10, 40000, 70)))
    prompt = system + [11, 12, 13]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    per_block = kv_bytes_per_block(tiny_bf16.cfg, jnp.bfloat16, "bf16p", 16)
    _, want = _run(tiny_bf16, [prompt], n=6)
    eng = Engine(tiny_bf16, max_num_seqs=1, max_num_batched_tokens=64, decode_steps=2, max_model_len=128,
                 kv_cache_gib=10 * per_block / GiB, prefix_cache_ram_gib=2 * per_block / GiB, kv_dtype="bf16p", ram_resize="off",
                 ssd_context_gib=0.01, ssd_context_dir=str(tmp_path / "ssd"))
    eng.generate([Request(system + [5], p)])
    for _ in range(3):                             # device -> RAM (2 blocks) -> SSD
        eng.generate([Request(list(map(int, rng.integers(10, 40000, 100))), SamplingParams(max_tokens=2))])
    eng.cache.ssd.flush()
    got = eng.generate([Request(prompt, p)])[0]
    assert got.token_ids == want[0].token_ids and got.cached_tokens == 70 and eng.cache.stats["ssd"] > 0
    eng.close()
    path = str(tmp_path / "cache.npz")
    for _ in range(2):                             # written at close, read at the next start
        eng = Engine(tiny_bf16, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128, kv_dtype="bf16p",
                     prefix_cache_file=path)
        got = eng.generate([Request(prompt, p)])[0]
        eng.close()
        assert got.token_ids == want[0].token_ids
    assert got.cached_tokens == len(prompt) - 1


def test_blocks_too_large_for_an_escape_position_are_refused(tiny_bf16):
    import dataclasses
    from infernix_jax.models.kv_pool import init_paged_kv
    cfg = dataclasses.replace(tiny_bf16.cfg, head_dim=128)
    init_paged_kv(cfg, 4, 256, jnp.bfloat16, kv_dtype="bf16p")                  # 256 x 128 = 32768: fine
    with pytest.raises(ValueError, match="use --block-size 256 or less"):
        init_paged_kv(cfg, 4, 512, jnp.bfloat16, kv_dtype="bf16p")
    with pytest.raises(ValueError, match="add --dtype bfloat16"):
        init_paged_kv(cfg, 4, 16, jnp.float32, kv_dtype="bf16p")


def test_the_plan_counts_the_bf16_rebuild_of_a_mixed_step(tiny_bf16):
    from infernix_jax.engine.plan import make_plan
    kw = dict(max_model_len=1000, max_num_seqs=3, kv_cache_gib=0.01)
    plain, packed = make_plan(tiny_bf16.cfg, jnp.bfloat16, **kw), make_plan(tiny_bf16.cfg, jnp.bfloat16, kv_dtype="bf16p", **kw)
    # 4 rows (3 bucketed) x 64 blocks (1016 tokens / 16, bucketed) x 16 tokens x 2 heads x 16 dims x 2 bytes, K and V
    assert packed.workspace_bytes - plain.workspace_bytes == 2 * 4 * 64 * 16 * 2 * 16 * 2


@pytest.mark.extended
def test_a_hybrid_on_bf16p_kv_is_bit_identical_to_bf16(smollm):
    """A Qwen3.5 hybrid (Gated DeltaNet layers beside one attention layer) on bf16p K/V: the same
    tokens and log-probs as on BF16 K/V, the second request reusing the first's prefix."""
    import jax
    from infernix_jax.loader import LoadedModel
    from infernix_jax.models import init_params
    from test_engine_hybrid import tiny_hybrid
    base = tiny_hybrid("qwen3_5", smollm.tokenizer, smollm.cfg.vocab_size)
    model = LoadedModel(name="hybrid-bf16", path="", cfg=base.cfg, tokenizer=base.tokenizer, dtype=jnp.bfloat16,
                        params=init_params(base.cfg, jax.random.PRNGKey(1), jnp.bfloat16, scale=0.5))
    rng = np.random.default_rng(9)
    shared = list(map(int, rng.integers(10, 40000, 70)))
    prompts = [shared + list(map(int, rng.integers(10, 40000, n))) for n in (5, 30)]
    _, want = _run(model, prompts)
    eng, got = _run(model, prompts, kv_dtype="bf16p")
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert any(r.cached_tokens for r in got)
    assert any(np.asarray(e).any() for e in eng.runner.kv.k_esc + eng.runner.kv.v_esc)
