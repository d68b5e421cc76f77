"""Mixture-of-experts MLP (Qwen3-MoE): softmax router, top-k, optional renormalisation.

This plain-jnp version evaluates every expert on every token and weights the results, which is
exact and simple but costs E/k times the FLOPs of a routed kernel; the grouped expert kernel
replaces it on the GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .layers import activation, linear


def route(x, router_w, top_k: int, norm_topk_prob: bool):
    """x [N, H] -> combine weights [N, E] (zero outside each token's top-k), in x.dtype."""
    logits = linear(x, router_w)                                       # [N, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)                               # [N, k]
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    w = w.astype(x.dtype)
    onehot = jax.nn.one_hot(idx, router_w.shape[0], dtype=x.dtype)     # [N, k, E]
    return jnp.einsum("nk,nke->ne", w, onehot)


def moe_mlp(x, p, top_k: int, norm_topk_prob: bool, act: str):
    """x [B, T, H]; p holds router [E, H], e_gate/e_up [E, I, H], e_down [E, H, I]."""
    B, T, H = x.shape
    xf = x.reshape(B * T, H)
    comb = route(xf, p["router"], top_k, norm_topk_prob)                       # [N, E]
    h = activation(act)(jnp.einsum("nh,eih->nei", xf, p["e_gate"])) * jnp.einsum("nh,eih->nei", xf, p["e_up"])
    out = jnp.einsum("nei,ehi,ne->nh", h, p["e_down"], comb)
    return out.reshape(B, T, H)
