"""Logit equivalence with transformers' own implementations, fp32, on tiny random configs:
full forward, and prefill + step-by-step decode through our KV cache."""
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from hf_reference import hf_logits, make_hf_model
from infernix_jax.loader import load_model
from infernix_jax.models import forward, init_cache, logits_from_hidden
from infernix_jax.route import Route

RTOL = 1e-4  # max |ours - hf| / max |hf|, fp32

CASES = {
    "llama-gqa2-untied": ("llama", {}),
    "llama-mqa-tied-gelu": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, hidden_act="gelu")),
    "llama-mha-headdim": ("llama", dict(num_key_value_heads=4, head_dim=12, rope_theta=100000.0)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-bias-gqa4": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=16)),
    "qwen3-tied-hd24": ("qwen3", dict(tie_word_embeddings=True, head_dim=24, num_key_value_heads=1)),
    "qwen3moe-norm": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3moe-nonorm-top3": ("qwen3_moe", dict(norm_topk_prob=False, num_experts_per_tok=3)),
    "qwen3moe-sparse-step": ("qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[2])),
    # hybrids: Gated DeltaNet + gated attention, zero-centred norms, partial RoPE
    "qwen3next-moe-shared": ("qwen3_next", {}),
    "qwen3next-4layers-k4": ("qwen3_next", dict(num_hidden_layers=4, linear_conv_kernel_dim=4, layer_types=None,
                                                full_attention_interval=2, partial_rotary_factor=0.5)),
    "qwen3_5-dense": ("qwen3_5", {}),
    "qwen3_5-dense-tied-k3": ("qwen3_5", dict(tie_word_embeddings=True, linear_conv_kernel_dim=3,
                                              linear_num_value_heads=4)),
    "qwen3_5-moe": ("qwen3_5_moe", {}),
}


INTERPRET = Route.named("pallas_interpret")        # the Pallas kernels, in interpret mode (CPU)

def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@partial(jax.jit, static_argnames=("cfg",))
def _run(params, cfg, tokens, positions, cache):
    h, cache = forward(params, cfg, tokens, positions, cache)
    return logits_from_hidden(params, cfg, h), cache


def ours_full(m, tokens):
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, _ = _run(m.params, m.cfg, jnp.asarray(tokens), pos, init_cache(m.cfg, B, max(16, T)))
    return np.asarray(logits)


def ours_in_pieces(m, tokens, cuts):
    """Prefill in pieces cut at `cuts`, each continuing the cache (chunked prefill; a piece of one
    token is a decode step)."""
    B, T = tokens.shape
    cache = init_cache(m.cfg, B, max(32, T))
    outs = []
    for a, b in zip([0, *cuts], [*cuts, T]):
        pos = jnp.broadcast_to(jnp.arange(a, b), (B, b - a))
        out, cache = _run(m.params, m.cfg, jnp.asarray(tokens[:, a:b]), pos, cache)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1)


def ours_prefill_decode(m, tokens, n_prefill):
    B, T = tokens.shape
    cache = init_cache(m.cfg, B, 32)
    pos = jnp.broadcast_to(jnp.arange(n_prefill), (B, n_prefill))
    out, cache = _run(m.params, m.cfg, jnp.asarray(tokens[:, :n_prefill]), pos, cache)
    outs = [np.asarray(out)]
    for t in range(n_prefill, T):
        step, cache = _run(m.params, m.cfg, jnp.asarray(tokens[:, t:t + 1]), jnp.full((B, 1), t), cache)
        outs.append(np.asarray(step))
    return np.concatenate(outs, axis=1)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    hf = make_hf_model(family, seed=hash(request.param) % 1000, **overrides)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    return hf, load_model(str(d), with_tokenizer=False)


def test_full_forward_matches_transformers(pair):
    hf, m = pair
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 9))
    ref = hf_logits(hf, tokens)
    assert np.std(ref) > 0.05, "reference logits too flat to be a meaningful check"
    assert rel_err(ours_full(m, tokens), ref) <= RTOL


def test_prefill_then_decode_matches_transformers(pair):
    hf, m = pair
    tokens = np.random.default_rng(1).integers(0, m.cfg.vocab_size, (2, 10))
    assert rel_err(ours_prefill_decode(m, tokens, 5), hf_logits(hf, tokens)) <= RTOL


@pytest.mark.extended
@pytest.mark.parametrize("case", ["qwen3next-4layers-k4", "qwen3_5-dense"])
def test_hybrid_prefill_split_at_odd_positions(case, tmp_path):
    """Chunked prefill of a hybrid, cut at odd positions, carries conv and SSM state exactly."""
    family, overrides = CASES[case]
    hf = make_hf_model(family, seed=11, **overrides)
    hf.save_pretrained(tmp_path)
    m = load_model(str(tmp_path), with_tokenizer=False)
    tokens = np.random.default_rng(5).integers(0, m.cfg.vocab_size, (2, 23))
    assert rel_err(ours_in_pieces(m, tokens, [3, 4, 11, 20]), hf_logits(hf, tokens)) <= RTOL


def test_fused_expert_checkpoint_layout(tmp_path):
    """Official Qwen MoE checkpoints store experts fused (gate_up_proj [E, 2I, H]); load that too."""
    hf = make_hf_model("qwen3_moe", seed=3)
    save_file({k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path), with_tokenizer=False)
    tokens = np.random.default_rng(2).integers(0, m.cfg.vocab_size, (1, 6))
    assert rel_err(ours_full(m, tokens), hf_logits(hf, tokens)) <= RTOL


def test_a_moe_model_loads_with_quantized_experts(tmp_path):
    """--weights int8 on a MoE checkpoint quantizes the routed experts at load, and the model stays
    close to the exact one (the loader, the plan and both MoE paths together)."""
    from infernix_jax.quant.formats import QTensor
    hf = make_hf_model("qwen3_moe", seed=5)
    save_file({k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    exact = load_model(str(tmp_path), with_tokenizer=False)
    m = load_model(str(tmp_path), with_tokenizer=False, weights="int8")
    assert isinstance(m.params["layers"][0]["e_up"], QTensor) and m.params["layers"][0]["e_up"].fmt == "int8"
    tokens = np.random.default_rng(3).integers(0, m.cfg.vocab_size, (1, 6))
    assert 0 < rel_err(ours_full(m, tokens), ours_full(exact, tokens)) < 2e-2


def test_sharded_checkpoint(tmp_path):
    hf = make_hf_model("qwen3", seed=4)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    m = load_model(str(tmp_path), with_tokenizer=False)
    tokens = np.random.default_rng(3).integers(0, m.cfg.vocab_size, (1, 6))
    assert rel_err(ours_full(m, tokens), hf_logits(hf, tokens)) <= RTOL


def test_bfloat16_close_to_float32(tmp_path):
    hf = make_hf_model("qwen3", seed=5)
    hf.save_pretrained(tmp_path)
    tokens = np.random.default_rng(4).integers(0, 99, (1, 8))
    f32 = ours_full(load_model(str(tmp_path), with_tokenizer=False), tokens)
    bf16 = ours_full(load_model(str(tmp_path), dtype="bfloat16", with_tokenizer=False), tokens)
    assert rel_err(bf16, f32) < 5e-2


def moe_params(rng, E: int, H: int, I: int) -> dict:
    """One MoE layer's router and experts, random."""
    def r(*shape, scale=0.25):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    return {"router": r(E, H, scale=1.0), "e_gate": r(E, I, H), "e_up": r(E, I, H), "e_down": r(E, H, I)}


@pytest.mark.parametrize("fmt", ["int8", "fp8b", "int4", "nvfp4"])
def test_quantized_experts_compute_as_their_dequantized_weights(fmt):
    """--weights FMT quantizes the routed experts too: both MoE paths multiply by exactly the
    weights the QTensors stand for (decode gathers the chosen experts' codes, then dequantizes)."""
    from infernix_jax.models.moe import moe_mlp
    from infernix_jax.quant.apply import planned_bytes, quantize_layer
    from infernix_jax.quant.formats import QTensor, dequantize
    rng = np.random.default_rng(8)
    H, k = 256, 2
    p = moe_params(rng, 8, H, 128)
    q = quantize_layer(p, fmt)
    assert all(isinstance(q[n], QTensor) for n in ("e_gate", "e_up", "e_down"))
    deq = {**p, **{n: dequantize(q[n]) for n in ("e_gate", "e_up", "e_down")}}
    assert np.abs(np.asarray(deq["e_up"]) - np.asarray(p["e_up"])).max() > 0        # really rounded
    x = jnp.asarray(rng.standard_normal((2, 3, H)), jnp.float32)
    for gather in (True, False):
        got, want = moe_mlp(x, q, k, True, "silu", gather=gather), moe_mlp(x, deq, k, True, "silu", gather=gather)
        assert rel_err(got, np.asarray(want)) < 1e-5, gather
    # the grouped expert kernel dequantizes the same codes inside the kernel (interpret mode)
    got = moe_mlp(x, q, k, True, "silu", route=INTERPRET)
    assert rel_err(got, np.asarray(moe_mlp(x, deq, k, True, "silu", gather=False))) < 1e-5
    abstract = {"layers": [jax.eval_shape(lambda: p)]}
    assert planned_bytes(abstract, 4, fmt) < 0.3 * planned_bytes(abstract, 4)        # the experts shrink


@pytest.mark.parametrize("norm", [True, False])
def test_moe_gather_path_equals_dense(norm):
    """The decode path (chosen experts' weights gathered per token) equals the all-experts path."""
    from infernix_jax.models.moe import moe_mlp
    rng = np.random.default_rng(7)
    H, k = 32, 3
    p = moe_params(rng, 8, H, 24)
    x = jnp.asarray(rng.standard_normal((2, 5, H)), jnp.float32)
    dense = moe_mlp(x, p, k, norm, "silu", gather=False)
    gathered = moe_mlp(x, p, k, norm, "silu", gather=True)
    assert rel_err(gathered, np.asarray(dense)) < 1e-5


@pytest.mark.parametrize("tokens", [5, 150], ids=["small", "prefill"])
def test_moe_grouped_kernel_equals_dense(tokens, monkeypatch):
    """The interpret route (Route.named("pallas_interpret")) routes the pairs through the grouped expert kernel (few tokens: tiles
    of 16 rows, prefill: 64): the same output as every expert on every token, weighted."""
    from infernix_jax.models import moe
    from pallas_kernels import grouped_matmul as gm
    tiles = []
    real = gm.grouped_matmul
    monkeypatch.setattr(gm, "grouped_matmul", lambda *a, **kw: tiles.append(a[6]) or real(*a, **kw))
    rng = np.random.default_rng(9)
    H, k = 64, 2
    p = moe_params(rng, 8, H, 32)
    x = jnp.asarray(rng.standard_normal((1, tokens, H)), jnp.float32)
    assert moe.grouped_route_ok(p, x.dtype)
    dense = moe.moe_mlp(x, p, k, True, "silu", gather=False)
    grouped = moe.moe_mlp(x, p, k, True, "silu", route=INTERPRET)
    assert rel_err(grouped, np.asarray(dense)) < 1e-5
    assert tiles == [16 if tokens < 100 else 64] * 3                     # gate, up, down went through it
    tiles.clear()
    one = moe.moe_mlp(x[:, :1], p, k, True, "silu", route=INTERPRET)
    assert not tiles and rel_err(one, np.asarray(dense[:, :1])) < 1e-5   # 2 pairs < 8 / 2: the gather path
    odd = {**p, "e_gate": p["e_gate"][:, :24], "e_up": p["e_up"][:, :24], "e_down": p["e_down"][:, :, :24]}
    assert not moe.grouped_route_ok(odd, x.dtype)          # I = 24: the jnp paths take it
    tiles.clear()
    assert rel_err(moe.moe_mlp(x, odd, k, True, "silu", route=INTERPRET),
                   np.asarray(moe.moe_mlp(x, odd, k, True, "silu", gather=False))) < 1e-5
    assert not tiles


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_official_layout_with_vision_and_mtp(family, tmp_path, caplog):
    """The official Qwen3.5 checkpoint is the VLM: text weights under model.language_model., vision
    under model.visual. (skipped, with a log line), MTP under mtp. (loaded and shape-checked; MoE
    experts there are per-expert tensors, fused ones in the main layers)."""
    import logging

    from infernix_jax.config import ModelConfig
    from infernix_jax.models.params import declare_params
    from infernix_jax.weights.common import ModelLoadError
    hf = make_hf_model(family, seed=12)
    sd = {k.replace("model.", "model.language_model.", 1): v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    if family == "qwen3_5_moe":       # the main layers' experts are fused, as in the official files
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    sd["model.visual.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)
    text = {**hf.config.to_dict(), "mtp_num_hidden_layers": 1}
    mtp_specs = declare_params(ModelConfig.from_hf_dict(text))["mtp"]
    rng = np.random.default_rng(0)
    for spec in jax.tree.leaves(mtp_specs, is_leaf=lambda s: hasattr(s, "hf")):
        names = [spec.hf.format(e=e) for e in range(spec.shape[0])] if "{e}" in spec.hf else [spec.hf]
        shape = spec.shape[1:] if "{e}" in spec.hf else spec.shape
        for n in names:
            sd[n] = rng.standard_normal(shape).astype(np.float32)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "text_config": text,
                                                      "tie_word_embeddings": False}))
    with caplog.at_level(logging.INFO, logger="infernix.loader"):
        m = load_model(str(tmp_path), with_tokenizer=False)
    assert "skipping 1 vision tensors" in caplog.text
    H = m.cfg.hidden_size
    assert m.params["mtp"]["fc"].shape == (H, 2 * H) and len(m.params["mtp"]["layers"]) == 1
    np.testing.assert_array_equal(np.asarray(m.params["mtp"]["fc"]), sd["mtp.fc.weight"])
    tokens = np.random.default_rng(6).integers(0, m.cfg.vocab_size, (1, 9))
    assert rel_err(ours_full(m, tokens), hf_logits(hf, tokens)) <= RTOL
    sd["mtp.fc.weight"] = np.zeros((H, H), np.float32)                        # a wrong shape is named
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="mtp.fc.weight"):
        load_model(str(tmp_path), with_tokenizer=False)


@pytest.mark.parametrize("change,msg", [(dict(layer_types=["linear_attention"]), "layer_types has 1"),
                                        (dict(layer_types=["mamba", "full_attention"]), "unknown layer types"),
                                        (dict(linear_num_value_heads=6), "multiple of")])
def test_bad_hybrid_configs_are_named(change, msg):
    from infernix_jax.config import ConfigError, ModelConfig
    from hf_reference import hf_config
    d = {**hf_config("qwen3_5").to_dict(), **change}
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_hf_dict(d)
