"""Mixture-of-experts MLP (Qwen3-MoE): softmax router, top-k, optional renormalisation.

With the Pallas route (impl "pallas", the GPU's default, or "pallas_interpret"), the (token,
expert) pairs are sorted by expert and multiplied by the grouped expert kernel
(pallas_kernels/grouped_matmul.py): only the chosen pairs are computed, each chosen expert's
weights (plain or quantized, dequantized in the kernel) read once per tile of its tokens. It runs
from N * k >= E / 2 pairs; below (decode of a few rows) the gather path is faster: sorting the
pairs into tiles costs more than it saves there.

Otherwise, two plain-jnp paths with the same result: when the step has few tokens (decode:
N * k <= E), the chosen experts' weights are gathered per token, so a step reads only k experts per
token instead of all E; else every expert runs on every token and the results are weighted (each
expert's weights read once, E/k times the FLOPs of the routed kernel)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..sharding import active
from ..route import REFERENCE, Route
from .layers import activation, linear


def _top_k(x, router_w, top_k: int, norm_topk_prob: bool):
    """x [N, H] -> weights [N, k] in x.dtype, expert ids [N, k]."""
    logits = linear(x, router_w)                                       # [N, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)                               # [N, k]
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype), idx


def combine_weights(x, router_w, top_k: int, norm_topk_prob: bool):
    """x [N, H] -> combine weights [N, E] (zero outside each token's top-k), in x.dtype."""
    w, idx = _top_k(x, router_w, top_k, norm_topk_prob)
    onehot = jax.nn.one_hot(idx, router_w.shape[0], dtype=x.dtype)     # [N, k, E]
    return jnp.einsum("nk,nke->ne", w, onehot)


def experts(w, idx=None, dtype=None):
    """Stacked expert weights [E, O, I] (or those of idx [...]: [..., O, I]) as an array in dtype.
    Quantized experts (--weights FMT: a QTensor whose arrays keep the expert axis first) are
    dequantized by XLA after the gather, so decode reads only the chosen experts' codes (the jnp
    paths; the grouped expert kernel dequantizes inside instead)."""
    from ..quant.formats import QTensor, dequantize
    if not isinstance(w, QTensor):
        return w if idx is None else w[idx]
    if idx is not None:
        take = lambda a: a if a is None or a.ndim == 0 else a[idx]  # noqa: E731  (nvfp4's tensor scale: one)
        w = w.replace(data=take(w.data), scale=take(w.scale), zero=take(w.zero),
                      more=tuple(take(a) for a in w.more), shape=tuple(idx.shape) + tuple(w.shape[1:]))
    return dequantize(w, dtype or jnp.float32)


def _kernel_operands(w):
    """Stacked experts (array [E, O, I] or QTensor) -> (arrays, format, shape) for grouped_matmul."""
    from pallas_kernels.quant_matmul import kernel_args
    from ..quant.formats import QTensor
    return (kernel_args(w), w.fmt, tuple(w.shape)) if isinstance(w, QTensor) else ((w,), "", tuple(w.shape))


def grouped_route_ok(p, dtype) -> bool:
    """Whether the grouped expert kernel takes this layer's experts (else the jnp paths run)."""
    from pallas_kernels.grouped_matmul import unsupported
    return all(unsupported(*_kernel_operands(p[n])[1:], dtype) is None for n in ("e_gate", "e_up", "e_down"))


def _grouped_moe(xf, p, top_k: int, norm_topk_prob: bool, act: str, interpret: bool):
    """xf [N, H] -> [N, H] through the grouped expert kernel: gate/up on each pair's token row,
    down on the pairs' hidden rows, then each token's k outputs weighted by its router weights."""
    from pallas_kernels import grouped_matmul as gm
    N = xf.shape[0]
    E = p["router"].shape[0]
    P = N * top_k
    w, idx = _top_k(xf, p["router"], top_k, norm_topk_prob)                     # [N, k]
    bm = 16 if P < 32 * E else 64                    # decode: a pair or a few per expert; prefill: tiles
    order, te, where = gm.align(idx.reshape(-1), E, bm)                          # [R], [R / bm], [P]
    R = order.shape[0]
    real = order < P

    def mm(x, rows, name):
        args, fmt, shape = _kernel_operands(p[name])
        return gm.grouped_matmul(x, rows, te, args, fmt, shape, bm, interpret=interpret)
    tok = jnp.where(real, order // top_k, N)                                     # each row's token
    h = activation(act)(mm(xf, tok, "e_gate")) * mm(xf, tok, "e_up")             # [R, I]
    y = mm(h, jnp.where(real, jnp.arange(R), R), "e_down")                       # [R, H]
    return jnp.einsum("nk,nkh->nh", w, y[where].reshape(N, top_k, -1))


def moe_mlp(x, p, top_k: int, norm_topk_prob: bool, act: str, gather: bool | None = None,
            route: Route = REFERENCE):
    """x [B, T, H]; p holds router [E, H], e_gate/e_up [E, I, H], e_down [E, H, I] (arrays or
    quantized QTensors). A route of the Pallas kernels (route.py): the grouped expert kernel where
    it takes the experts' shapes. gather: None picks by the (static) token count; True/False force a
    jnp path (tests)."""
    B, T, H = x.shape
    E = p["router"].shape[0]
    xf = x.reshape(B * T, H)
    dt = x.dtype
    if route.pallas and gather is None and grouped_route_ok(p, dt) \
            and 2 * B * T * top_k >= E and not active():          # (on a mesh: the jnp paths, which XLA splits)
        # the kernel from half as many pairs as experts: on the H200 (qwen3-30b-a3b's layer) it was
        # 1.65x faster than the gather path at 8 tokens (64 pairs, 128 experts) but 0.4x at one and
        # 0.8x at two, and 0.28x at one with fp8 experts (docs/benchmarks.md "Grouped expert kernel")
        return _grouped_moe(xf, p, top_k, norm_topk_prob, act, route.interpret).reshape(B, T, H)
    if gather if gather is not None else B * T * top_k <= E:
        w, idx = _top_k(xf, p["router"], top_k, norm_topk_prob)                # [N, k]
        g = activation(act)(jnp.einsum("nh,nkih->nki", xf, experts(p["e_gate"], idx, dt)))  # [N, k, I]
        h = g * jnp.einsum("nh,nkih->nki", xf, experts(p["e_up"], idx, dt))
        out = jnp.einsum("nki,nkhi,nk->nh", h, experts(p["e_down"], idx, dt), w)
        return out.reshape(B, T, H)
    comb = combine_weights(xf, p["router"], top_k, norm_topk_prob)                       # [N, E]
    h = activation(act)(jnp.einsum("nh,eih->nei", xf, experts(p["e_gate"], dtype=dt))) \
        * jnp.einsum("nh,eih->nei", xf, experts(p["e_up"], dtype=dt))
    out = jnp.einsum("nei,ehi,ne->nh", h, experts(p["e_down"], dtype=dt), comb)
    return out.reshape(B, T, H)
