"""Drafting with the checkpoint's multi-token prediction head (`--speculative mtp`).

Two heads: a random one (its drafts almost never hold) and a "copy" head on a one-layer model
(the head's layer is the model's layer, its fc passes the next token's embedding through), whose
drafts mostly hold, so that accepted paths, chained drafts and rejections all occur. Checked: the
output is plain decoding's token for token (greedy and seeded); every draft the engine proposes is
the one the plain-jnp head (mtp_reference) makes from the target's own hidden states over the
whole sequence (prompt chunks, decode dispatches and verify steps alike); and the choices around
it (no head, auto, the pool's extra K/V layer)."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.config import PRESETS
from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.engine.spec.mtp import usable, use_mtp
from infernix_jax.loader import LoadedModel
from infernix_jax.models import forward, init_cache, init_params
from infernix_jax.models.kv_pool import num_attention_layers, num_kv_layers
from infernix_jax.models.qwen3_5.mtp import mtp_reference
from scripts.bench_prefix import IdsTokenizer

N_NEW = 20
VOCAB = 512


def tiny(shape: str = "qwen3.5-27b", layers: int = 4, mtp: int = 1, seed: int = 0) -> LoadedModel:
    base = PRESETS[shape]
    cfg = dataclasses.replace(base, hidden_size=64, intermediate_size=128, num_layers=layers,
                              layer_types=base.layer_types[:layers] if layers > 1 else ("full_attention",),
                              num_heads=4, num_kv_heads=2, head_dim=16, lin_k_heads=2,
                              lin_v_heads=2 * (base.lin_v_heads // base.lin_k_heads), vocab_size=VOCAB,
                              num_experts=min(base.num_experts, 8), moe_intermediate_size=32,
                              shared_expert_intermediate_size=base.shared_expert_intermediate_size and 32,
                              max_position_embeddings=1024, mtp_layers=mtp)
    params = init_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    return LoadedModel(name=f"tiny-{shape}", path="", cfg=cfg, params=params, tokenizer=IdsTokenizer(),
                       dtype=jnp.float32)


def copy_head() -> LoadedModel:
    """One attention layer, and a head that is nearly that model one position on: its layer is the
    model's, fc passes the (unit-RMS) embedding of the next token, its norm is the final norm. It
    differs from the model only in never seeing the first token, so its drafts mostly hold."""
    m = tiny(layers=1)
    p = dict(m.params)
    e = p["embed"]
    p["embed"] = e / jnp.sqrt(jnp.mean(e * e, axis=-1, keepdims=True))
    H = m.cfg.hidden_size
    mtp = dict(p["mtp"], layers=[p["layers"][0]], norm=p["final_norm"],
               fc=jnp.concatenate([jnp.eye(H), jnp.zeros((H, H))], axis=1))
    p["mtp"] = mtp
    return dataclasses.replace(m, params=p)


@pytest.fixture(scope="module")
def copy_model():
    return copy_head()


def prompts(count=5, seed=0):
    rng = np.random.default_rng(seed)
    lens = [3, 17, 70, 130, 40, 9][:count]            # one chunk, several chunks (64 a step), across blocks
    return [list(map(int, rng.integers(1, VOCAB, n))) for n in lens]


def engine(model, mode, **kw):
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, decode_steps=3, speculative=mode, max_model_len=512,
              kv_cache_gib=0.05) | kw
    return Engine(model, **kw)


def run(eng, ps, temperature=0.0):
    out = eng.generate([Request(p, SamplingParams(max_tokens=N_NEW, temperature=temperature, seed=i + 1,
                                                  ignore_eos=True)) for i, p in enumerate(ps)])
    assert eng.bm.num_free == eng.bm.num_blocks
    return [r.token_ids for r in out]


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.9, marks=pytest.mark.extended)])
def test_drafting_with_the_head_changes_nothing(copy_model, temperature):
    ps = prompts()
    plain = run(engine(copy_model, "off"), ps, temperature)
    eng = engine(copy_model, "mtp")
    assert run(eng, ps, temperature) == plain
    st = eng.spec.stats["mtp"]
    assert st.rounds > 0 and 0 < st.accepted < st.drafted       # drafts held and failed


@pytest.mark.extended
@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_a_random_head_on_a_hybrid_changes_nothing(shape):
    """Gated DeltaNet layers beside the head (their states roll back on rejection), MoE in the head."""
    model = tiny(shape)
    ps = prompts()
    plain = run(engine(model, "off"), ps)
    eng = engine(model, "mtp")
    assert run(eng, ps) == plain and eng.spec.stats["mtp"].rounds > 0


def target_hidden(model, ids):
    """The target's final hidden states over the whole sequence, contiguous: [T, H]."""
    cache = init_cache(model.cfg, 1, len(ids) + 1, jnp.float32)
    h, _ = forward(model.params, model.cfg, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids))[None], cache)
    return h[0]


@pytest.mark.parametrize("every,tight", [(2, False), pytest.param(1, False, marks=pytest.mark.extended),
                                         (1, True)])
def test_every_draft_is_the_reference_heads(copy_model, every, tight):
    """Each proposal's drafts (seq.mtp_next) equal mtp_reference on the sequence as it stands: the
    head's K/V over prompt chunks, decode dispatches, verify steps with accepted and rejected
    nodes is what the whole sequence gives. every=2: every other round decodes plainly (the head
    then runs inside the multi-step decode). tight: a pool too small for every sequence at once, so
    sequences are preempted and recomputed (their outputs fed again as chunks)."""
    kw = dict(kv_cache_gib=13 * 8192 / 2**30, max_model_len=192) if tight else {}
    eng = engine(copy_model, "mtp", prefix_cache=False, **kw)
    seen, calls = [], [0]
    propose = eng.spec.propose

    def spy(seq, batch, tokens_left):
        ids = list(seq.all_ids)
        if seq.mtp_next is not None and seq.mtp_next[0] == len(ids):
            seen.append((ids, list(seq.mtp_next[1])))
        calls[0] += 1
        return propose(seq, batch, tokens_left) if calls[0] % every == 0 else None
    eng.spec.propose = spy
    ps = prompts()
    final = {tuple(p): p + o for p, o in zip(ps, run(eng, ps))}
    assert len(seen) >= 10 and max(len(d) for _, d in seen) == eng.runner.mtp_depth
    assert (eng.scheduler.num_preemptions > 0) == tight
    hidden = {k: target_hidden(copy_model, list(v)) for k, v in final.items()}   # (causal: any prefix's too)
    ref = jax.jit(partial(mtp_reference, depth=eng.runner.mtp_depth), static_argnums=1)
    for ids, drafts in seen:
        key = next(k for k, v in final.items() if v[:len(ids)] == ids)
        tokens = jnp.asarray(final[key] + [0], jnp.int32)        # (padded: the reference reads the first len(ids))
        want = ref(copy_model.params, copy_model.cfg, hidden[key], tokens, length=len(ids) - 1)
        assert drafts == np.asarray(want)[:len(drafts)].tolist(), len(ids)


def test_head_choices():
    with_head, without = tiny(layers=4), tiny(layers=4, mtp=0)
    with pytest.raises(ValueError, match="has no multi-token prediction head"):
        use_mtp(without, "mtp")
    for mode, runs in (("mtp", True), ("auto", True), ("ngram", False), ("off", False)):
        m, on = use_mtp(with_head, mode)
        assert on == runs and ("mtp" in m.params) == runs and (m.cfg.mtp_layers == 1) == runs
    # --kv-dtype bf16p: the chain's K/V could overflow a block's escapes; auto drafts with n-grams only
    with pytest.raises(ValueError, match="bf16p"):
        use_mtp(with_head, "mtp", "bf16p")
    assert use_mtp(with_head, "auto", "bf16p")[1] is False and use_mtp(with_head, "auto", "int8")[1]
    # the head's K/V: one more layer in the pool, only where it runs
    assert num_kv_layers(with_head.cfg) == num_attention_layers(with_head.cfg) + 1
    eng = engine(with_head, "ngram")
    assert eng.runner.mtp_depth == 0 and len(eng.runner.kv.k) == num_attention_layers(with_head.cfg)
    eng = engine(with_head, "mtp", num_speculative_tokens=2)
    assert eng.runner.mtp_depth == 2 and len(eng.runner.kv.k) == num_attention_layers(with_head.cfg) + 1
    # the host's cut of a chain at the row's last slot
    assert usable(np.array([5, 6, 7]), 10, 16) == [5, 6, 7]
    assert usable(np.array([5, 6, 7]), 14, 16) == [5, 6]
    assert usable(np.array([5, 6, 7]), 15, 16) == [5]


def test_auto_with_a_head_is_exact_and_reports_it(copy_model):
    ps = prompts(3, seed=1)
    plain = run(engine(copy_model, "off"), ps)
    eng = engine(copy_model, "auto")
    assert run(eng, ps) == plain
    st = eng.spec.stats["mtp"]
    assert st.rounds > 0
    from server.metrics import Metrics
    text = Metrics(eng).render().decode()                             # /metrics' per-method counters
    assert f'infernix_spec_rounds{{method="mtp"}} {float(st.rounds)}' in text


def test_bench_shapes_times_the_head_and_sampling_beside_plain_decode(tmp_path, monkeypatch):
    from scripts import bench_shapes
    cfg = dataclasses.replace(tiny().cfg, mtp_layers=0)
    monkeypatch.setitem(bench_shapes.PRESETS, "tiny-hybrid", cfg)
    monkeypatch.setattr(bench_shapes, "copy_bandwidth", lambda: 1e11)     # (the roofline's inputs: slow on a
    monkeypatch.setattr(bench_shapes, "matmul_flops", lambda: 1e12)       # CPU, unused here)
    res = bench_shapes.run("tiny-hybrid", str(tmp_path), [2], [32], [], False, [], "reference", 2, mtp_depth=3,
                           sampled=True)
    plain, head, sampled = res["decode"]
    assert "mtp_depth" not in plain and head["mtp_depth"] == 3 and head["vs_plain"] > 0
    assert sampled["sampling"] == bench_shapes.SAMPLED and "mtp_depth" not in sampled and sampled["vs_plain"] > 0
    with pytest.raises(ValueError, match="not a Qwen3.5"):
        bench_shapes.Bench("smollm2-135m", tmp_path, impl="reference", mtp_depth=3)


@pytest.mark.extended
def test_bench_spec_frees_each_modes_engine_before_the_next(smollm, monkeypatch):
    """On a GPU each engine's KV pool takes most of the free memory: the bench must drop one mode's
    engine before it builds the next (it ran out of memory on an H100 when it did not)."""
    import gc
    import weakref

    import infernix_jax.engine as engine_pkg
    from scripts import bench_spec
    alive = []

    class Tracked(Engine):
        def __init__(self, *a, **kw):
            gc.collect()
            assert not [r for r in alive if r() is not None], "the previous mode's engine is still alive"
            super().__init__(*a, **kw)
            alive.append(weakref.ref(self))
    monkeypatch.setattr(engine_pkg, "Engine", Tracked)
    res = bench_spec.run(smollm, 6, ["free-chat"], ["off", "ngram"], None)
    assert len(alive) == 2 and set(res["free-chat"]) == {"off", "ngram", "replay"}
    assert all(v >= 1 for v in res["free-chat"]["replay"].values())     # (tokens a round: the bonus at least)
    # the replay of an output that copies the first of two versions: after "1 2" a tree holds both
    # continuations (3 ..., 4), a chain only the latest (4), and the output takes 3
    copy = bench_spec.replay([9, 1, 2, 3, 5, 6, 7, 8, 1, 2, 4, 1, 2], [3, 5, 6, 7, 8])
    assert copy["chain7"] == 5 / 2 and copy["tree16"] == 5.0     # (chains: a failed round, then the rest)
