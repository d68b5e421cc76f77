"""Mixture-of-experts MLP (Qwen3-MoE): softmax router, top-k, optional renormalisation.

Two plain-jnp paths with the same result: when the step has few tokens (decode: N * k <= E), the
chosen experts' weights are gathered per token, so a step reads only k experts per token instead of
all E; otherwise every expert runs on every token and the results are weighted (each expert's
weights read once, E/k times the FLOPs of a routed kernel). A grouped expert kernel replaces the
second on the GPU later."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .layers import activation, linear


def _top_k(x, router_w, top_k: int, norm_topk_prob: bool):
    """x [N, H] -> weights [N, k] in x.dtype, expert ids [N, k]."""
    logits = linear(x, router_w)                                       # [N, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)                               # [N, k]
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype), idx


def route(x, router_w, top_k: int, norm_topk_prob: bool):
    """x [N, H] -> combine weights [N, E] (zero outside each token's top-k), in x.dtype."""
    w, idx = _top_k(x, router_w, top_k, norm_topk_prob)
    onehot = jax.nn.one_hot(idx, router_w.shape[0], dtype=x.dtype)     # [N, k, E]
    return jnp.einsum("nk,nke->ne", w, onehot)


def experts(w, idx=None, dtype=None):
    """Stacked expert weights [E, O, I] (or those of idx [...]: [..., O, I]) as an array in dtype.
    Quantized experts (--weights FMT: a QTensor whose arrays keep the expert axis first) are
    dequantized by XLA after the gather, so decode reads only the chosen experts' codes (there is
    no grouped quantized expert kernel yet)."""
    from ..quant.formats import QTensor, dequantize
    if not isinstance(w, QTensor):
        return w if idx is None else w[idx]
    if idx is not None:
        take = lambda a: a if a is None or a.ndim == 0 else a[idx]  # noqa: E731  (nvfp4's tensor scale: one)
        w = w.replace(data=take(w.data), scale=take(w.scale), zero=take(w.zero),
                      more=tuple(take(a) for a in w.more), shape=tuple(idx.shape) + tuple(w.shape[1:]))
    return dequantize(w, dtype or jnp.float32)


def moe_mlp(x, p, top_k: int, norm_topk_prob: bool, act: str, gather: bool | None = None):
    """x [B, T, H]; p holds router [E, H], e_gate/e_up [E, I, H], e_down [E, H, I] (arrays or
    quantized QTensors). gather: None picks by the (static) token count; True/False force a path (tests)."""
    B, T, H = x.shape
    E = p["router"].shape[0]
    xf = x.reshape(B * T, H)
    dt = x.dtype
    if gather if gather is not None else B * T * top_k <= E:
        w, idx = _top_k(xf, p["router"], top_k, norm_topk_prob)                # [N, k]
        g = activation(act)(jnp.einsum("nh,nkih->nki", xf, experts(p["e_gate"], idx, dt)))  # [N, k, I]
        h = g * jnp.einsum("nh,nkih->nki", xf, experts(p["e_up"], idx, dt))
        out = jnp.einsum("nki,nkhi,nk->nh", h, experts(p["e_down"], idx, dt), w)
        return out.reshape(B, T, H)
    comb = route(xf, p["router"], top_k, norm_topk_prob)                       # [N, E]
    h = activation(act)(jnp.einsum("nh,eih->nei", xf, experts(p["e_gate"], dtype=dt))) \
        * jnp.einsum("nh,eih->nei", xf, experts(p["e_up"], dtype=dt))
    out = jnp.einsum("nei,ehi,ne->nh", h, experts(p["e_down"], dtype=dt), comb)
    return out.reshape(B, T, H)
