"""The Gated DeltaNet layers' weights (Qwen3-Next, Qwen3.5): shapes, init and checkpoint names."""
from __future__ import annotations

from ...config import ModelConfig
from ..spec import ParamSpec


def linear_attn_specs(cfg: ModelConfig, hf: str, gg: str) -> dict[str, ParamSpec]:
    """Gated DeltaNet weights (Qwen3-Next: grouped qkvz / ba projections; Qwen3.5: separate ones).
    GGUF (llama.cpp's converter, MODELS.md section 8): ssm_a = -exp(A_log), conv squeezed, Qwen3-Next's
    qkvz split into attn_qkv + attn_gate, and for Qwen3.5 the value heads in tiled order."""
    H, K = cfg.hidden_size, cfg.lin_conv_kernel
    Hk, dk, dv = cfg.lin_k_heads, cfg.lin_k_dim, cfg.lin_v_dim
    key_dim, value_dim, Hv = Hk * dk, cfg.lin_v_heads * dv, cfg.lin_v_heads
    r = Hv // Hk
    # Qwen3.5 files hold value heads tiled (h' = i * Hk + g for HF head g * r + i); Qwen3-Next's grouped
    untile = () if cfg.lin_grouped_proj or r == 1 else (Hk, r)
    rows = lambda off, d: (("untile_rows", off, *untile, d),) if untile else ()  # noqa: E731
    la = hf + "linear_attn."
    s = {"lin_conv": ParamSpec((2 * key_dim + value_dim, 1, K), "normal", la + "conv1d.weight",
                               gg + "ssm_conv1d.weight", gguf_fix=rows(2 * key_dim, dv)),
         "lin_A_log": ParamSpec((Hv,), "normal", la + "A_log", gg + "ssm_a", gguf_fix=(("a_log",), *rows(0, 1))),
         "lin_dt_bias": ParamSpec((Hv,), "ones", la + "dt_bias", gg + "ssm_dt.bias", gguf_fix=rows(0, 1)),
         "lin_norm": ParamSpec((dv,), "ones", la + "norm.weight", gg + "ssm_norm.weight"),
         "lin_out": ParamSpec((H, value_dim), "normal", la + "out_proj.weight", gg + "ssm_out.weight",
                              gguf_fix=(("untile_cols", *untile, dv),) if untile else ())}
    if cfg.lin_grouped_proj:
        s["lin_qkvz"] = ParamSpec((2 * key_dim + 2 * value_dim, H), "normal", la + "in_proj_qkvz.weight",
                                  gg + "attn_qkv.weight", gguf_fix=(("qkvz", gg + "attn_gate.weight", Hk, dk, r * dv),))
        s["lin_ba"] = ParamSpec((2 * Hv, H), "normal", la + "in_proj_ba.weight", gg + "ssm_ba.weight")
    else:
        s["lin_qkv"] = ParamSpec((2 * key_dim + value_dim, H), "normal", la + "in_proj_qkv.weight",
                                 gg + "attn_qkv.weight", gguf_fix=rows(2 * key_dim, dv))
        s["lin_z"] = ParamSpec((value_dim, H), "normal", la + "in_proj_z.weight", gg + "attn_gate.weight",
                               gguf_fix=rows(0, dv))
        s["lin_b"] = ParamSpec((Hv, H), "normal", la + "in_proj_b.weight", gg + "ssm_beta.weight", gguf_fix=rows(0, 1))
        s["lin_a"] = ParamSpec((Hv, H), "normal", la + "in_proj_a.weight", gg + "ssm_alpha.weight",
                               gguf_fix=rows(0, 1))
    return s
