"""The paged engine on hybrids (Qwen3.5 / Qwen3-Next: Gated DeltaNet + gated attention): a state
pool beside the paged KV, chunked prefill carrying conv and SSM states, padding that never touches
them, preemption, the Pallas decode kernel, and state snapshots at block boundaries."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import hf_config
from infernix_jax.config import ModelConfig
from infernix_jax.cache.block_manager import chain_key
from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.engine.plan import make_plan
from infernix_jax.loader import LoadedModel
from infernix_jax.models import forward, init_cache, init_params, logits_from_hidden

N_NEW = 10


def tiny_hybrid(family: str, tokenizer, vocab: int, **overrides) -> LoadedModel:
    """Four layers (three Gated DeltaNet, one gated attention), random weights, SmolLM2's tokenizer."""
    hc = hf_config(family, vocab_size=vocab, hidden_size=64, num_hidden_layers=4, layer_types=None,
                   full_attention_interval=4, max_position_embeddings=512, **overrides)
    cfg = ModelConfig.from_hf_dict(hc.to_dict())
    params = init_params(cfg, jax.random.PRNGKey(1), scale=0.5)
    return LoadedModel(name=family, path="", cfg=cfg, params=params, tokenizer=tokenizer, dtype=jnp.float32)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, smollm):
    return tiny_hybrid(request.param, smollm.tokenizer, smollm.cfg.vocab_size)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    lens = [1, 7, 64, 65, 150, 33, 120, 90]      # one token, chunk-sized, across chunks and blocks
    return [list(map(int, rng.integers(10, 49000, n))) for n in lens]


def greedy(n=N_NEW):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def alone(model, prompts):
    eng = Engine(model, max_num_seqs=1, max_num_batched_tokens=256, chunked_prefill=False, decode_steps=1)
    return [eng.generate([Request(p, greedy())])[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(hybrid, prompts):
    return alone(hybrid, prompts)


def assert_all_released(eng):
    assert eng.bm.num_free == eng.bm.num_blocks
    assert sorted(eng.scheduler.free_slots) == list(range(eng.scheduler.max_num_seqs))


@pytest.mark.extended
def test_alone_follows_the_contiguous_forward(hybrid, prompts, reference):
    """Teacher-forced: each generated token is the contiguous forward's argmax (the forward that
    matches transformers in test_models), so the engine's own single-request path is right."""
    cfg = hybrid.cfg
    seqs = [p + out for p, out in zip(prompts, reference)]
    T = max(map(len, seqs))
    tokens = np.array([s + [0] * (T - len(s)) for s in seqs])               # right padding: causal, harmless
    h, _ = jax.jit(forward, static_argnames="cfg")(hybrid.params, cfg, jnp.asarray(tokens),
                                                   jnp.broadcast_to(jnp.arange(T), tokens.shape),
                                                   init_cache(cfg, len(seqs), T))
    logits = np.asarray(logits_from_hidden(hybrid.params, cfg, h))
    for i, (p, out) in enumerate(zip(prompts, reference)):
        rows = logits[i, len(p) - 1:len(p) - 1 + len(out)]                    # [N_NEW, V]
        picked = rows[np.arange(len(out)), out]
        assert np.all(picked >= rows.max(axis=1) - 1e-4 * np.abs(rows).max()), f"prompt {i}"


@pytest.mark.extended
def test_8_concurrent_mixed_lengths_equal_each_alone(hybrid, prompts, reference):
    eng = Engine(hybrid, max_num_seqs=8, max_num_batched_tokens=48, decode_steps=3)
    got = eng.generate([Request(p, greedy()) for p in prompts])
    assert [r.token_ids for r in got] == reference
    assert_all_released(eng)


@pytest.mark.extended
def test_preemption_restarts_the_state(hybrid, prompts, reference):
    per_tok = 2 * hybrid.cfg.num_kv_heads * hybrid.cfg.head_dim * 4          # one attention layer, fp32
    eng = Engine(hybrid, max_num_seqs=4, max_num_batched_tokens=64, decode_steps=2, max_model_len=176,
                 kv_cache_gib=20 * 16 * per_tok / 2**30)                     # 20 blocks: not all four fit
    got = eng.generate([Request(p, greedy()) for p in prompts[4:]])
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in got] == reference[4:]
    assert_all_released(eng)


@pytest.mark.extended
def test_pallas_decode_kernel_in_the_engine(hybrid, prompts, reference):
    eng = Engine(hybrid, max_num_seqs=8, max_num_batched_tokens=64, decode_steps=3, attn_impl="pallas_interpret")
    got = eng.generate([Request(p, greedy()) for p in prompts[:5]])
    assert [r.token_ids for r in got] == reference[:5]


@pytest.mark.extended
def test_snapshots_at_block_boundaries_hold_the_prefix_state(hybrid, prompts):
    cfg = hybrid.cfg
    prompt = prompts[4]                                                       # 150 tokens
    eng = Engine(hybrid, max_num_seqs=2, max_num_batched_tokens=100, decode_steps=1, state_snapshots=4)
    eng.generate([Request(prompt, greedy(2))])
    # after 64 and 128 tokens, and where the request ended (150 prompt + 1 output token computed)
    assert eng.snapshots.interval == 64 and len(eng.snapshots) == 3
    bs = eng.bm.block_size
    key = eng.bm.root
    for j in range(128 // bs):                                                # the key of block 8's prefix
        key = chain_key(key, prompt[j * bs:(j + 1) * bs])
    snap = eng.snapshots.get(key)
    assert snap is not None and snap.num_tokens == 128
    _, cache = jax.jit(forward, static_argnames="cfg")(hybrid.params, cfg, jnp.asarray([prompt[:128]]),
                                                       jnp.arange(128)[None], init_cache(cfg, 1, 128))
    lin = [i for i in range(cfg.num_layers) if cfg.is_linear_layer(i)]
    for j, i in enumerate(lin):
        # (fp32 through 100- and 128-token chunks: the layers before sum in other orders, for both
        # states; at the tests' XLA:CPU flags, conftest.py, the conv states differ by up to 2.4e-5)
        np.testing.assert_allclose(snap.ssm[j], np.asarray(cache.ssm[i][0]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(snap.conv[j], np.asarray(cache.conv[i][0]), rtol=1e-4, atol=1e-5)
    # host -> device into another slot of a fresh pool -> back: unchanged
    eng.runner.reset_kv()
    eng.runner.restore_snapshot(1, snap)
    again = eng.runner.take_snapshot(1, 128)
    for a, b in zip(snap.ssm + snap.conv, again.ssm + again.conv):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="state shapes"):
        eng.runner.restore_snapshot(0, dataclasses.replace(snap, conv=snap.conv[:1]))


def test_memory_plan_counts_the_state_pool(hybrid):
    cfg = hybrid.cfg
    plan = make_plan(cfg, jnp.float32, max_model_len=256, max_num_seqs=8, kv_cache_gib=0.01)
    per_layer = (cfg.lin_conv_kernel - 1) * (2 * cfg.lin_k_heads * cfg.lin_k_dim + cfg.lin_v_heads * cfg.lin_v_dim) * 4 \
        + cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
    assert plan.state_bytes == 8 * 3 * per_layer
    assert plan.kv_bytes_per_token == 2 * 1 * cfg.num_kv_heads * cfg.head_dim * 4      # one attention layer
    assert "state pool" in plan.describe()


@pytest.mark.extended
def test_loop_guard_inside_a_multi_step_decode_recomputes_the_state(hybrid, prompts, monkeypatch):
    """When the thinking-loop guard injects </think> in the middle of a multi-step dispatch, the rest
    of the dispatch is dropped; the recurrent state already absorbed it, so the sequence is recomputed:
    the same tokens as one step per dispatch. (The guard is forced at the 32nd token.)"""
    from infernix_jax.engine import engine as engine_mod
    monkeypatch.setattr(engine_mod, "repeats", lambda ids: len(ids) == 32)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, think_open=True)

    def run(k):   # one request at a time: after the prefill token, dispatches of k tokens (1 + 4m + 3 = 32)
        eng = Engine(hybrid, max_num_seqs=4, max_num_batched_tokens=64, decode_steps=k)
        eng.think_ids = eng.runner.think_ids = (500, 501, ())
        return [eng.generate([Request(p, params)])[0].token_ids for p in prompts[:3]], eng
    one, _ = run(1)
    many, eng = run(4)
    assert all(ids[32] == 501 for ids in one)                                 # the guard fired in each
    assert many == one
    assert eng.scheduler.num_requeued == 3                                    # mid-dispatch in each
    assert_all_released(eng)


def test_scoring_a_hybrid_in_pieces_carries_its_state(hybrid, prompts):
    from infernix_jax.quality import window_logprobs
    ids = prompts[4]                                   # 150 tokens: across blocks and pieces
    whole = window_logprobs(hybrid.params, hybrid.cfg, ids, hybrid.dtype, "reference")
    pieces = window_logprobs(hybrid.params, hybrid.cfg, ids, hybrid.dtype, "reference", chunk=64)
    # the chunked delta rule sums in another order: a few log-probabilities of ~-9 move by ~2e-3 on
    # some CPUs (AVX-512), by 4.5e-3 on another (AMD EPYC, 2026-12-07), the mean by 1.3e-5; a lost
    # state by whole units
    np.testing.assert_allclose(pieces, whole, rtol=1e-4, atol=8e-3)
    assert np.abs(pieces - whole).mean() < 1e-4
