"""Weights declared once: shape, init and the names they have in HF checkpoints and GGUF files
(spec.py), for the decoder every family shares (embeddings, attention, MLP, MoE experts, norms),
with each family's own layers from its package (qwen3_5/params.py: Gated DeltaNet). Loading, random
init and abstract shapes all come from `declare_params`; what each weight is (axes, quantized,
fused) from roles.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .qwen3_5.params import linear_attn_specs
from .spec import ParamSpec


def _norm(cfg: ModelConfig, shape, hf: str, gg: str) -> ParamSpec:
    """An RMSNorm weight. Zero-centred ones (norm(x) * (1 + w)) are stored as 1 + w in GGUF files."""
    if cfg.norm_plus_one:
        return ParamSpec(shape, "zeros", hf, gg, gguf_fix=(("minus1",),))
    return ParamSpec(shape, "ones", hf, gg)


def _layer_specs(cfg: ModelConfig, i: int, hf: str | None = None) -> dict[str, ParamSpec]:
    """Layer i's weights; hf: another name prefix (the MTP layers: full attention, MoE if the model is)."""
    H = cfg.hidden_size
    mtp = hf is not None
    hf, gg = hf or f"model.layers.{i}.", f"blk.{i}."
    s = {
        "attn_norm": _norm(cfg, (H,), hf + "input_layernorm.weight", gg + "attn_norm.weight"),
        # hybrids' GGUF files name it post_attention_norm (ffn_norm elsewhere)
        "mlp_norm": _norm(cfg, (H,), hf + "post_attention_layernorm.weight",
                          gg + ("post_attention_norm.weight" if cfg.layer_types else "ffn_norm.weight")),
    }
    if cfg.is_linear_layer(i) and not mtp:
        s.update(linear_attn_specs(cfg, hf, gg))
    else:
        s.update(_attn_specs(cfg, hf, gg))
    s.update(_mlp_specs(cfg, i, hf, gg, moe=cfg.num_experts > 0 if mtp else None))
    return s


def _mtp_specs(cfg: ModelConfig) -> dict:
    """Qwen3-Next / Qwen3.5 multi-token prediction (MODELS.md section 3): loaded and shape-checked;
    speculative decoding with them is a later issue."""
    H = cfg.hidden_size
    return {"pre_norm_embed": ParamSpec((H,), "zeros", "mtp.pre_fc_norm_embedding.weight", ""),
            "pre_norm_hidden": ParamSpec((H,), "zeros", "mtp.pre_fc_norm_hidden.weight", ""),
            "fc": ParamSpec((H, 2 * H), "normal", "mtp.fc.weight", ""),
            "layers": [_layer_specs(cfg, j, hf=f"mtp.layers.{j}.") for j in range(cfg.mtp_layers)],
            "norm": ParamSpec((H,), "zeros", "mtp.norm.weight", "")}


def _attn_specs(cfg: ModelConfig, hf: str, gg: str) -> dict[str, ParamSpec]:
    H, hd, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    permute = cfg.family == "llama"
    q_rows = nH * hd * (2 if cfg.attn_output_gate else 1)     # gated: [q_h | gate_h] per head
    s = {
        "wq": ParamSpec((q_rows, H), "normal", hf + "self_attn.q_proj.weight", gg + "attn_q.weight",
                        gguf_permute_heads=nH if permute else 0),
        "wk": ParamSpec((nKV * hd, H), "normal", hf + "self_attn.k_proj.weight", gg + "attn_k.weight",
                        gguf_permute_heads=nKV if permute else 0),
        "wv": ParamSpec((nKV * hd, H), "normal", hf + "self_attn.v_proj.weight", gg + "attn_v.weight"),
        "wo": ParamSpec((H, nH * hd), "normal", hf + "self_attn.o_proj.weight", gg + "attn_output.weight"),
    }
    if cfg.qkv_bias:
        s["bq"] = ParamSpec((nH * hd,), "normal", hf + "self_attn.q_proj.bias", gg + "attn_q.bias",
                            gguf_permute_heads=nH if permute else 0)
        s["bk"] = ParamSpec((nKV * hd,), "normal", hf + "self_attn.k_proj.bias", gg + "attn_k.bias",
                            gguf_permute_heads=nKV if permute else 0)
        s["bv"] = ParamSpec((nKV * hd,), "normal", hf + "self_attn.v_proj.bias", gg + "attn_v.bias")
    if cfg.o_bias:
        s["bo"] = ParamSpec((H,), "normal", hf + "self_attn.o_proj.bias", gg + "attn_output.bias")
    if cfg.qk_norm:
        s["q_norm"] = _norm(cfg, (hd,), hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight")
        s["k_norm"] = _norm(cfg, (hd,), hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight")
    return s


def _mlp_specs(cfg: ModelConfig, i: int, hf: str, gg: str, moe: bool | None = None) -> dict[str, ParamSpec]:
    H = cfg.hidden_size
    s = {}
    if cfg.is_moe_layer(i) if moe is None else moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        ex = hf + "mlp.experts."
        s["router"] = ParamSpec((E, H), "normal", hf + "mlp.gate.weight", gg + "ffn_gate_inp.weight")
        s["e_gate"] = ParamSpec((E, I, H), "normal", ex + "{e}.gate_proj.weight", gg + "ffn_gate_exps.weight",
                                hf_fused=(ex + "gate_up_proj", 0))
        s["e_up"] = ParamSpec((E, I, H), "normal", ex + "{e}.up_proj.weight", gg + "ffn_up_exps.weight",
                              hf_fused=(ex + "gate_up_proj", 1))
        s["e_down"] = ParamSpec((E, H, I), "normal", ex + "{e}.down_proj.weight", gg + "ffn_down_exps.weight",
                                hf_fused=(ex + "down_proj", -1))
        if cfg.shared_expert_intermediate_size:          # Qwen3-Next / Qwen3.5-MoE: a sigmoid-gated shared expert
            Is, se = cfg.shared_expert_intermediate_size, hf + "mlp.shared_expert."
            s["s_gate"] = ParamSpec((Is, H), "normal", se + "gate_proj.weight", gg + "ffn_gate_shexp.weight")
            s["s_up"] = ParamSpec((Is, H), "normal", se + "up_proj.weight", gg + "ffn_up_shexp.weight")
            s["s_down"] = ParamSpec((H, Is), "normal", se + "down_proj.weight", gg + "ffn_down_shexp.weight")
            s["s_router"] = ParamSpec((1, H), "normal", hf + "mlp.shared_expert_gate.weight",
                                      gg + "ffn_gate_inp_shexp.weight")
    else:
        I = cfg.intermediate_size
        s["w_gate"] = ParamSpec((I, H), "normal", hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight")
        s["w_up"] = ParamSpec((I, H), "normal", hf + "mlp.up_proj.weight", gg + "ffn_up.weight")
        s["w_down"] = ParamSpec((H, I), "normal", hf + "mlp.down_proj.weight", gg + "ffn_down.weight")
    return s


def declare_params(cfg: ModelConfig) -> dict:
    """The params pytree with a ParamSpec at every leaf."""
    V, H = cfg.vocab_size, cfg.hidden_size
    tree = {
        "embed": ParamSpec((V, H), "normal", "model.embed_tokens.weight", "token_embd.weight"),
        "layers": [_layer_specs(cfg, i) for i in range(cfg.num_layers)],
        "final_norm": _norm(cfg, (H,), "model.norm.weight", "output_norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = ParamSpec((V, H), "normal", "lm_head.weight", "output.weight")
    if cfg.mtp_layers:
        tree["mtp"] = _mtp_specs(cfg)
    return tree


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), declare_params(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02):
    """Random weights (for tests and benchmarks at real shapes without real checkpoints)."""
    specs, treedef = jax.tree.flatten(declare_params(cfg), is_leaf=_is_spec)
    keys = jax.random.split(key, len(specs))

    def one(s: ParamSpec, k):
        if s.init == "ones":
            return jnp.ones(s.shape, dtype)
        if s.init == "zeros":
            return jnp.zeros(s.shape, dtype)
        return (scale * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(s, k) for s, k in zip(specs, keys)])
