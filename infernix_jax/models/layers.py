"""Building blocks shared by the families: RMSNorm, RoPE, gated MLP, attention over a KV cache."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import quant_matmul as qmm

from ..quant.formats import QTensor, dequantize
from ..quant.packed import Packed12, unpack
from ..route import current
from ..sharding import active, constrain, local_shape, split_product
from .fuse import split_rows
from .roles import BIAS, FUSED

_ACT = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def activation(name: str):
    return _ACT[name]


def rms_norm(x, w, eps: float):
    # Statistics in fp32, result cast back before the weight multiply (as transformers does).
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope_cos_sin(positions, head_dim: int, theta: float):
    """positions [B, T] int -> cos, sin [B, T, head_dim] fp32 (NeoX / rotate_half layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)                       # [B, T, hd]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, N, hd]; cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)


# Rows up to which a quantized matmul runs the fused kernel: decode and small batches are bound by
# the weight bytes, which the kernel reads once. Past it, the product is compute bound and XLA
# dequantizing the weight into a bf16 temporary for cuBLAS was faster on the H200 (1.5-3x at 4K
# rows; about even at 256: docs/benchmarks.md).
KERNEL_MAX_ROWS = 128

# int8 and fp8 (one scale per output channel) in this range of rows: dot(x, codes in x's dtype) in
# f32 times the scale, written so that XLA fuses the codes' conversion into its own GEMM (its
# autotuned Triton emitter; nothing between the two). On the H200 it beat the Pallas kernel from 32
# rows (qwen3-8b decode at batch 64: 1.23x) and dequantizing first up to 1024 rows; the kernel
# stays faster up to 16 rows, dequantizing first at 4K (experiments/xla_fused_dequant.py,
# docs/benchmarks.md). XLA fuses no blocked scales this way: the other formats keep the routes above.
XLA_FUSED_ROWS = (16, 1024)          # (exclusive, inclusive)
XLA_FUSED_FORMATS = ("int8", "fp8")


def _after(w, x):
    """w, made to wait for x: the full-size matrix dequantized from w then exists only while its
    layer runs. Without this XLA may unpack every layer's weights up front (they depend on nothing
    else), holding the whole model at full size beside its packed form."""
    return jax.lax.optimization_barrier((w, x))[0]


def linear(x, w, b=None):
    """x [..., in] @ w[out, in]^T (+ b): weights stay in the checkpoints' [out, in] layout. A
    quantized w (--weights) goes through the fused dequantizing kernel where the current route
    (route.py: the step's) runs the Pallas kernels, the rows are few and the kernel takes its shape;
    else it is dequantized first."""
    if isinstance(w, QTensor):
        route = current()
        rows = math.prod(x.shape[:-1])
        lo, hi = XLA_FUSED_ROWS
        # on a mesh the kernel runs on each device's shard (split_product) where the weight is split
        # alike in all its arrays; else XLA's routes, which XLA splits like any product (a Pallas call
        # it would run whole on every device, gathering the weight)
        kernel = route.pallas and rows <= KERNEL_MAX_ROWS and (not active() or bool(w.split)) \
            and qmm.unsupported(w.fmt, local_shape(w), x.dtype) is None
        if w.fmt in XLA_FUSED_FORMATS and route.pallas and x.dtype != jnp.float32 and rows <= hi \
                and (lo < rows or not kernel):
            y = jnp.einsum("...i,oi->...o", x, w.data.astype(x.dtype), preferred_element_type=jnp.float32)
            y = (y * w.scale.reshape(-1)).astype(x.dtype)                  # [..., out]
            return y if b is None else y + b
        if kernel:
            interpret = route.interpret
            mm = lambda x, w: qmm.quant_matmul(x, qmm.kernel_args(w), w.fmt, w.shape, interpret=interpret)  # noqa: E731
            x2 = x.reshape(-1, x.shape[-1])
            y = split_product(mm, x2, w) if active() else mm(x2, w)
            y = y.reshape(*x.shape[:-1], w.shape[0])
            return y if b is None else y + b
        w = dequantize(_after(w, x), x.dtype)
    elif isinstance(w, Packed12):        # lossless: the very BF16 matrix, then the same product
        w = unpack(_after(w, x))
    y = jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def projections(x, p, name: str, sizes: tuple) -> list:
    """The outputs of FUSED[name]'s parts ([..., size] each, biases added): one product where the
    loader fused them into p[name] (models/fuse.py), else one per part."""
    bname, bparts = BIAS.get(name, ("", ()))
    if name in p:
        return split_rows(linear(x, p[name], p.get(bname)), sizes)
    return [linear(x, p[n], p.get(b)) for n, b in zip(FUSED[name], bparts or (None,) * len(sizes))]


def gated_mlp(x, p, act: str, prefix: str = "w"):
    """act(x @ gate^T) * (x @ up^T) @ down^T with p's {prefix}_gate, _up (or fused _gate_up), _down."""
    I = p[prefix + "_down"].shape[-1]
    g, u = projections(x, p, prefix + "_gate_up", (I, I))
    h = constrain(activation(act)(g) * u, *(None,) * (x.ndim - 1), "ffn")           # [..., I]
    return linear(h, p[prefix + "_down"])


def attention(q, k_cache, v_cache, q_pos, kv_len=None):
    """Causal GQA attention of new queries against a contiguous cache.

    q [B, T, nH, hd]; k_cache/v_cache [B, S, nKV, hd] already holding this step's keys;
    q_pos [B, T] absolute positions of the queries. A key at slot s is visible iff s <= q_pos:
    slots past a sequence's end hold stale or padding data but are always in its future.
    Returns [B, T, nH, hd]."""
    B, T, nH, hd = q.shape
    nKV = k_cache.shape[2]
    G = nH // nKV
    qg = q.reshape(B, T, nKV, G, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    S = k_cache.shape[1]
    visible = jnp.arange(S)[None, None, :] <= q_pos[:, :, None]              # [B, T, S]
    if kv_len is not None:
        visible = visible & (jnp.arange(S)[None, None, :] < kv_len[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache)
    return out.reshape(B, T, nH, hd)


def write_cache(cache_l, new, positions):
    """cache_l [B, S, nKV, hd] <- new [B, T, nKV, hd] at slots positions [B, T]."""
    b = jnp.arange(new.shape[0])[:, None]
    return cache_l.at[b, positions].set(new.astype(cache_l.dtype), mode="drop")
