"""Qwen3-Next / Qwen3.5 (dense and MoE) hybrids as pure functions: Gated DeltaNet layers (a linear
recurrence with a fixed-size state per sequence) and gated full-attention layers with partial RoPE.
Equations, weight layouts and cache shapes: ../shared/MODELS.md sections 3-6.

This module holds the layers and the contiguous-cache forward (tests, scoring); `paged.py` beside it
runs the same layers over the engine's paged KV and state pool. Per sequence the cache holds, for
each linear layer, the conv state (the last K-1 pre-conv rows) and the SSM state [Hv, dk, dv] in
fp32; for each full layer, the usual K/V."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.gated_deltanet import gated_delta_rule_chunked, gated_delta_rule_recurrent

from ...config import ModelConfig
from ...sharding import constrain
from ...route import REFERENCE, Route
from ..layers import apply_rope, attention, gated_mlp, linear, projections, rms_norm, rope_cos_sin, write_cache
from ..moe import moe_mlp


@struct.dataclass
class HybridCache:
    """Per layer i: full layers k[i], v[i] [B, S, nKV, hd] (None for linear layers); linear layers
    conv[i] [B, K-1, conv_dim] (model dtype), ssm[i] [B, Hv, dk, dv] fp32 (None for full layers)."""
    k: tuple
    v: tuple
    conv: tuple
    ssm: tuple


def conv_dim(cfg: ModelConfig) -> int:
    return 2 * cfg.lin_k_heads * cfg.lin_k_dim + cfg.lin_v_heads * cfg.lin_v_dim


def state_shapes(cfg: ModelConfig, batch: int, dtype):
    """((conv shape, dtype), (ssm shape, dtype)) of one linear layer's state for `batch` sequences."""
    return (((batch, cfg.lin_conv_kernel - 1, conv_dim(cfg)), dtype),
            ((batch, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), jnp.float32))


def init_hybrid_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> HybridCache:
    kv, conv, ssm = [], [], []
    for i in range(cfg.num_layers):
        lin = cfg.is_linear_layer(i)
        kv.append(None if lin else jnp.zeros((batch, max_len, cfg.num_kv_heads, cfg.head_dim), dtype))
        (cs, cd), (ss, sd) = state_shapes(cfg, batch, dtype)
        conv.append(jnp.zeros(cs, cd) if lin else None)
        ssm.append(jnp.zeros(ss, sd) if lin else None)
    return HybridCache(k=tuple(kv), v=tuple(kv), conv=tuple(conv), ssm=tuple(ssm))


def rms_norm_1p(x, w, eps: float):
    """Zero-centred RMSNorm (Qwen3-Next, Gemma): norm(x) * (1 + w), all in fp32, then cast."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _gated_rms_norm(o, z, w, eps: float):
    """The GDN output norm: the plain RMSNorm w * norm(o), times silu(z) in fp32. o, z [..., dv]."""
    return (rms_norm(o, w, eps).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def gated_attention(cfg: ModelConfig, p, x, positions, attend):
    """x [B, T, H], positions [B, T] -> output [B, T, H]. attend(q, k, v) -> o [B, T, nH, hd] stores
    this step's k/v wherever the cache lives and attends (contiguous here, paged in the engine)."""
    B, T, _ = x.shape
    nH, nKV, hd, rot = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
    qw = nH * hd * (2 if cfg.attn_output_gate else 1)                # q rows: each head's q, then its gate
    qg, k, v = projections(x, p, "wqkv", (qw, nKV * hd, nKV * hd))
    qg = constrain(qg.reshape(B, T, nH, -1), "batch", "seq", "heads", None)
    k = constrain(k.reshape(B, T, nKV, hd), "batch", "seq", "kv_heads", None)
    v = constrain(v.reshape(B, T, nKV, hd), "batch", "seq", "kv_heads", None)
    q, gate = (qg[..., :hd], qg[..., hd:]) if cfg.attn_output_gate else (qg, None)
    q, k = rms_norm_1p(q, p["q_norm"], cfg.rms_norm_eps), rms_norm_1p(k, p["k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, rot, cfg.rope_theta)      # RoPE on the first `rot` dims only
    q = jnp.concatenate([apply_rope(q[..., :rot], cos, sin), q[..., rot:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[..., :rot], cos, sin), k[..., rot:]], axis=-1)
    o = constrain(attend(q, k, v), "batch", "seq", "heads", None)  # [B, T, nH, hd]
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    return linear(o.reshape(B, T, -1), p["wo"])


def gdn_inputs(cfg: ModelConfig, p, x):
    """-> mixed [B, T, conv_dim] (q|k|v, head-major), z [B, T, Hv, dv], b, a [B, T, Hv]."""
    B, T, _ = x.shape
    Hk, Hv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    r = Hv // Hk
    if cfg.lin_grouped_proj:     # Qwen3-Next: rows per key head g = [q_g | k_g | v_g (r heads) | z_g (r heads)]
        y = linear(x, p["lin_qkvz"]).reshape(B, T, Hk, 2 * dk + 2 * r * dv)
        q, k = y[..., :dk], y[..., dk:2 * dk]
        v, z = y[..., 2 * dk:2 * dk + r * dv], y[..., 2 * dk + r * dv:]
        ba = linear(x, p["lin_ba"]).reshape(B, T, Hk, 2 * r)
        b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
        mixed = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        return mixed, z.reshape(B, T, Hv, dv), b, a
    mixed = linear(x, p["lin_qkv"])
    return (mixed, linear(x, p["lin_z"]).reshape(B, T, Hv, dv), linear(x, p["lin_b"]), linear(x, p["lin_a"]))


def gdn_core(cfg: ModelConfig, p, mixed, b, a, conv_state, ssm_state, lens=None, decode_fn=None, chunked_fn=None):
    """The recurrent part of a GDN layer for B sequences that each continue their state.
    mixed [B, T, C] (pre-conv q|k|v), b, a [B, T, Hv]; conv_state [B, K-1, C]; ssm_state [B, Hv, dk, dv].
    lens [B]: real tokens per row (right padding; None = all T). Padding gets beta = g = 0, so it
    never touches the SSM state, and the new conv state is the K-1 rows before each row's end.
    decode_fn(q, k, v, g, beta, state) replaces the jnp recurrence when T == 1, and chunked_fn (one
    sequence, vmapped here) the jnp chunked form when T > 1: the Pallas kernels.
    -> (o [B, T, Hv, dv] fp32, conv_state, ssm_state)."""
    B, T, _ = mixed.shape
    Hk, Hv, dk, dv, K = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, cfg.lin_conv_kernel
    # causal depthwise conv over time, continuing from the previous K-1 rows
    xp = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)         # [B, K-1+T, C]
    w = p["lin_conv"][:, 0, :]                                                      # [C, K]
    conv = jax.nn.silu(sum(xp[:, j:j + T] * w[:, j] for j in range(K)))
    if lens is None:
        conv_state = xp[:, T:]                                                      # the last K-1 rows
    else:
        rows = lens[:, None] + jnp.arange(K - 1)[None, :]                           # [B, K-1]
        conv_state = jnp.take_along_axis(xp, rows[..., None], axis=1)
    kd = Hk * dk
    q = conv[..., :kd].reshape(B, T, Hk, dk)
    k = conv[..., kd:2 * kd].reshape(B, T, Hk, dk)
    v = conv[..., 2 * kd:].reshape(B, T, Hv, dv)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["lin_A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["lin_dt_bias"].astype(jnp.float32))
    if lens is not None:
        real = (jnp.arange(T)[None, :] < lens[:, None])[..., None]                  # [B, T, 1]
        beta, g = jnp.where(real, beta, 0.0), jnp.where(real, g, 0.0)
    if T == 1 and decode_fn is not None:
        o, ssm_state = decode_fn(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm_state)
        return o[:, None], conv_state, ssm_state
    rule = gated_delta_rule_recurrent if T == 1 else (chunked_fn or gated_delta_rule_chunked)
    o, ssm_state = jax.vmap(rule)(q, k, v, g, beta, ssm_state)                    # [B, T, Hv, dv]
    return o, conv_state, ssm_state


def gdn_output(cfg: ModelConfig, p, o, z, dtype):
    """o [..., Hv, dv] (fp32 core output), z [..., Hv, dv] -> [..., H]: gated RMSNorm, out-projection."""
    o = _gated_rms_norm(o.astype(dtype), z, p["lin_norm"], cfg.rms_norm_eps)
    return linear(o.reshape(*o.shape[:-2], -1), p["lin_out"])


def _gated_deltanet(cfg: ModelConfig, p, x, conv_state, ssm_state):
    """x [B, T, H] -> (output [B, T, H], conv_state [B, K-1, C], ssm_state [B, Hv, dk, dv])."""
    mixed, z, b, a = gdn_inputs(cfg, p, x)
    o, conv_state, ssm_state = gdn_core(cfg, p, mixed, b, a, conv_state, ssm_state)
    return gdn_output(cfg, p, o, z, x.dtype), conv_state, ssm_state


def hybrid_mlp(cfg: ModelConfig, p, i: int | None, y, route: Route = REFERENCE):
    """Layer i's MLP (i None: an MTP layer's, MoE whenever the model has experts)."""
    if not (cfg.num_experts > 0 if i is None else cfg.is_moe_layer(i)):
        return gated_mlp(y, p, cfg.hidden_act)
    out = moe_mlp(y, p, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act, route=route)
    if "s_down" in p:
        shared = gated_mlp(y, p, cfg.hidden_act, prefix="s")
        out = out + jax.nn.sigmoid(linear(y, p["s_router"])) * shared
    return out


def hybrid_forward(params, cfg: ModelConfig, tokens, positions, cache: HybridCache):
    """tokens, positions [B, T] (each sequence continues its cache: positions are contiguous from its
    length so far) -> hidden [B, T, H] after the final norm, updated cache."""
    eps = cfg.rms_norm_eps
    k, v, conv, ssm = list(cache.k), list(cache.v), list(cache.conv), list(cache.ssm)
    x = params["embed"][tokens]
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            h = rms_norm_1p(x, p["attn_norm"], eps)
            if cfg.is_linear_layer(i):
                h, conv[i], ssm[i] = _gated_deltanet(cfg, p, h, conv[i], ssm[i])
            else:
                def attend(q, kk, vv, i=i):
                    k[i], v[i] = write_cache(k[i], kk, positions), write_cache(v[i], vv, positions)
                    return attention(q, k[i], v[i], positions)
                h = gated_attention(cfg, p, h, positions, attend)
            x = x + h
            x = x + hybrid_mlp(cfg, p, i, rms_norm_1p(x, p["mlp_norm"], eps))
    return rms_norm_1p(x, params["final_norm"], eps), HybridCache(tuple(k), tuple(v), tuple(conv), tuple(ssm))
