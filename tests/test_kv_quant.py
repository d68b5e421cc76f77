"""Quantized KV pools (pallas_kernels/kv_quant.py, --kv-dtype): codes and one scale per head and token
row, written token by token or a chunk at a time, on fresh random inputs."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant as kq

nKV, P, bs, hd = 2, 6, 16, 8
TABLE = [3, 1, 4]                      # one sequence's blocks, out of order


def slot(p: int) -> int:
    return TABLE[p // bs] * bs + p % bs


def stale_pool(rng, fmt):
    """A pool whose blocks still hold a previous owner's codes and scales."""
    codes = jnp.asarray(rng.integers(0, 100, (nKV, P, bs, kq.code_dims(fmt, hd)))).astype(kq.code_dtype(fmt))
    return codes, jnp.asarray(rng.uniform(1, 2, (nKV, P, bs)), jnp.float32)


def relative_step(fmt):
    """Largest rounding error of one encode, in units of the row's scale."""
    return {"int8": 0.5, "int4": 0.5, "fp8": 448 * 2 ** -4}[fmt]


@pytest.mark.parametrize("fmt", kq.KV_FORMATS)
def test_each_row_is_rounded_once_by_its_own_scale_however_it_is_written(fmt):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(40, nKV, hd)) * rng.uniform(0.1, 5, (40, nKV, 1))).astype(np.float32)
    slots = jnp.asarray([slot(p) for p in range(40)])
    stale = stale_pool(rng, fmt)
    chunk = kq.write(*stale, jnp.asarray(x), slots, fmt)
    pool, scale = stale
    for lo, hi in [(0, 1), (1, 17), (17, 18), (18, 40)]:               # other chunk boundaries
        pool, scale = kq.write(pool, scale, jnp.asarray(x[lo:hi]), slots[lo:hi], fmt)
    for a, b in zip(chunk, (pool, scale)):                             # the same bits either way
        np.testing.assert_array_equal(np.asarray(a[:, TABLE]).view(np.uint8), np.asarray(b[:, TABLE]).view(np.uint8))
    got = np.asarray(kq.gather_blocks(pool, scale, jnp.asarray(TABLE), fmt)).reshape(nKV, -1, hd)[:, :40]
    s = np.asarray(scale[:, TABLE]).reshape(nKV, -1)[:, :40]
    np.testing.assert_allclose(s * kq.QMAX[fmt], np.abs(x).max(axis=-1).T, rtol=1e-6)
    err = np.abs(got - x.swapaxes(0, 1)).max(axis=-1)
    assert (err <= s * relative_step(fmt) * 1.0001).all()


@pytest.mark.parametrize("fmt", kq.KV_FORMATS)
def test_rows_with_inf_or_nan_leave_nothing_that_poisons_a_later_owner(fmt):
    """A request whose K/V overflowed must not leave a non-finite scale or code behind: attention
    multiplies masked slots by 0, and 0 x inf is NaN for whoever reuses the block."""
    rng = np.random.default_rng(4)
    pool, scale = stale_pool(rng, fmt)
    x = rng.normal(size=(3, nKV, hd)).astype(np.float32)
    x[0, 0, 1], x[1, 1, 2], x[2, 0, 0] = np.inf, np.nan, -np.inf
    pool, scale = kq.write(pool, scale, jnp.asarray(x), jnp.asarray([slot(p) for p in range(3)]), fmt)
    got = np.asarray(kq.gather_blocks(pool, scale, jnp.asarray(TABLE), fmt))
    assert np.isfinite(np.asarray(scale)).all() and np.isfinite(got).all()
    assert np.asarray(scale)[0, TABLE[0], 0] == 0 and np.asarray(scale)[1, TABLE[0], 0] > 0    # only the bad rows


def test_int4_packs_the_two_halves_of_a_row():
    x = jnp.asarray(np.arange(1, 9, dtype=np.float32) - 4.5)[None]           # [1, 8]: -3.5 .. 3.5
    codes = np.asarray(kq.encode(x, jnp.asarray([0.5]), "int4"))             # q = -7 .. 7 (odd steps)
    q = np.round(np.asarray(x[0]) / 0.5).astype(int) + 8
    np.testing.assert_array_equal(codes[0] & 0xF, q[:4])
    np.testing.assert_array_equal(codes[0] >> 4, q[4:])
    np.testing.assert_array_equal(np.asarray(kq.decode(jnp.asarray(codes), jnp.asarray([0.5]), "int4")), x)


def test_padding_slots_are_dropped_and_untouched_rows_keep_their_codes():
    rng = np.random.default_rng(3)
    pool, scale = stale_pool(rng, "int8")
    x = jnp.asarray(rng.normal(size=(3, nKV, hd)), jnp.float32)
    new_pool, new_scale = kq.write(pool, scale, x, jnp.asarray([slot(0), P * bs, P * bs + 5]), "int8")
    b, o = TABLE[0], 0
    keep = np.ones((P, bs), bool)
    keep[b, o] = False
    np.testing.assert_array_equal(np.asarray(new_pool)[:, keep], np.asarray(pool)[:, keep])
    np.testing.assert_array_equal(np.asarray(new_scale)[:, keep], np.asarray(scale)[:, keep])
    assert (np.asarray(new_scale)[:, b, o] > 0).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "k8v4", "bf16p"])
def test_quantized_blocks_move_to_the_tiers_and_back_bit_for_bit(smollm, kv_dtype):
    import dataclasses
    from infernix_jax.cache import device
    from infernix_jax.models.kv_pool import init_paged_kv
    cfg = dataclasses.replace(smollm.cfg, num_layers=2)
    rng = np.random.default_rng(4)
    dtype = jnp.bfloat16 if kv_dtype == "bf16p" else jnp.float32
    kv = init_paged_kv(cfg, 8, bs, dtype, kv_dtype=kv_dtype)
    rand = lambda arrays, f: tuple(f(x) for x in arrays)                        # noqa: E731
    ints = lambda x: jnp.asarray(rng.integers(0, 100, x.shape)).astype(x.dtype)  # noqa: E731
    kv = kv.replace(k=rand(kv.k, ints), v=rand(kv.v, ints), k_esc=rand(kv.k_esc, ints), v_esc=rand(kv.v_esc, ints),
                    k_scale=rand(kv.k_scale, lambda x: jnp.asarray(rng.uniform(size=x.shape), jnp.float32)),
                    v_scale=rand(kv.v_scale, lambda x: jnp.asarray(rng.uniform(size=x.shape), jnp.float32)))
    fresh = init_paged_kv(cfg, 8, bs, dtype, kv_dtype=kv_dtype)
    for k, v, lo, hi in device.read_blocks(kv, [1, 2, 5]):
        assert np.asarray(k).dtype == np.uint8                                   # codes and scale as bytes
        fresh = device.write_rows(fresh, np.asarray(k), np.asarray(v), list(range(hi - lo)), [6, 7, 0][lo:hi])
    bits = lambda a: np.ascontiguousarray(a).view(np.uint8)                      # noqa: E731
    every = lambda kv: kv.k + kv.v + kv.k_scale + kv.v_scale + kv.k_esc + kv.v_esc  # noqa: E731
    before = [np.asarray(a) for a in every(kv)]
    copied = device.copy_blocks(kv, [(1, 3)])                                 # (kv is donated)
    for a, b, c in zip(before, every(fresh), every(copied), strict=True):
        np.testing.assert_array_equal(bits(a[:, [1, 2, 5]]), bits(b[:, [6, 7, 0]]))
        np.testing.assert_array_equal(bits(c[:, 3]), bits(a[:, 1]))


@pytest.mark.extended
@pytest.mark.parametrize("kv_dtype,max_kl", [("int8", 0.002), ("fp8", 0.01), ("k8v4", 0.05)])  # measured 0.0005, 0.003, 0.016
def test_quantized_kv_costs_little_against_the_model_dtype(smollm, kv_dtype, max_kl):
    from infernix_jax.quality import compare, scored, window_logprobs
    text = ("The river Tagus rises in the mountains of eastern Spain and flows west through Toledo before "
            "it reaches the Atlantic at Lisbon, where its estuary forms one of the largest natural harbours "
            "of Europe. Its basin drains much of the central plateau, and its water feeds the cities of both "
            "countries through a chain of dams and canals built over the last century.")
    ids = smollm.tokenizer.encode(text)
    ref = window_logprobs(smollm.params, smollm.cfg, ids, smollm.dtype, "reference")
    got = window_logprobs(smollm.params, smollm.cfg, ids, smollm.dtype, "reference", chunk=16, kv_dtype=kv_dtype)
    st = compare([scored(ref, ids)], [scored(got, ids)], [ids])
    assert 0 < st.mean_kl <= max_kl, st


def test_an_engine_on_quantized_kv_is_deterministic_and_planned_smaller(smollm):
    from infernix_jax.engine import Engine, Request, SamplingParams
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    p = SamplingParams(max_tokens=12, temperature=0)
    e = Engine(smollm, max_num_seqs=2, max_model_len=256, kv_dtype="int8", prefix_cache=False)
    a, b = e.generate([Request(ids, p)])[0], e.generate([Request(ids, p)])[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    plain = Engine(smollm, max_num_seqs=2, max_model_len=256, prefix_cache=False)
    assert e.plan.kv_bytes_per_token < 0.3 * plain.plan.kv_bytes_per_token          # f32 model: 4 -> ~1 byte
    with pytest.raises(ValueError, match="unknown --kv-dtype"):
        Engine(smollm, max_num_seqs=1, max_model_len=64, kv_dtype="int3")


def test_k8v4_blocks_of_two_sizes_stack_into_pieces():
    """K8V4's key and value rows differ in size: the RAM tier's pieces keep each its own."""
    from infernix_jax.cache import device
    rng = np.random.default_rng(5)
    blocks = [(rng.integers(0, 255, (2, 3, 1028), dtype=np.uint8), rng.integers(0, 255, (2, 3, 516), dtype=np.uint8))
              for _ in range(3)]
    (k, v, lo, hi), = device.stack_pieces(blocks)
    assert (lo, hi) == (0, 3) and k.shape == (4, 2, 3, 1028) and v.shape == (4, 2, 3, 516)
    for i, (bk, bv) in enumerate(blocks):
        np.testing.assert_array_equal(k[i], bk)
        np.testing.assert_array_equal(v[i], bv)


@pytest.mark.extended
def test_k8v4_serves_prefix_hits_from_the_ram_tier(smollm):
    """Evicted blocks go to the RAM tier as bytes and come back for a request sharing the prefix."""
    from infernix_jax.engine import Engine, Request, SamplingParams
    e = Engine(smollm, max_num_seqs=1, max_model_len=224, kv_dtype="k8v4", kv_cache_gib=0.0024,
               prefix_cache_ram_gib=0.05, ram_resize="off")
    assert e.plan.block_bytes == 30 * 3 * 16 * (64 + 4 + 32 + 4)
    rng = np.random.default_rng(6)
    shared = [int(t) for t in rng.integers(10, 40000, 120)]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = e.generate([Request(shared + [11], p)])[0]
    e.generate([Request([int(t) for t in rng.integers(10, 40000, 200)], p)])       # evicts to the RAM tier
    again = e.generate([Request(shared + [11], p)])[0]
    assert e.cache.stats["ram"] > 0 and again.cached_tokens >= 112, (e.cache.stats, again.cached_tokens)
    assert len(again.token_ids) == len(first.token_ids) == 4
