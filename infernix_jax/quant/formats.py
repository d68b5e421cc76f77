"""Quantized weight formats, for matrices in the checkpoints' [..., out, in] layout (the reduction
axis, `in`, last; leading axes such as MoE experts are kept).

| fmt   | values                         | scales                                               |
|-------|--------------------------------|------------------------------------------------------|
| int8  | int8, symmetric                | f32 per output channel                               |
| fp8   | float8 e4m3                    | f32 per output channel                               |
| fp8b  | float8 e4m3                    | f32 per 128 x 128 tile (DeepSeek / Qwen FP8 layout)   |
| mxfp8 | float8 e4m3                    | e8m0 (a power of two) per 32 inputs (OCP MX)          |
| int4  | 4-bit unsigned, two per byte   | f32 scale and zero point per group of 128 inputs     |
| nvfp4 | e2m1, two per byte             | e4m3 per 16 inputs, times one f32 tensor scale        |

Every format rounds to nearest (even) after scaling, and each block's scale maps its largest
magnitude onto the format's largest value, so nothing saturates. A QTensor may also hold a GGUF
file's own blocks (q8_0, q4_0, q4_1, q4_k, q6_k, iq4_xs: quant/ggml.py), which nothing here
quantizes to; their arrays are listed in pallas_kernels/ggml_blocks.py. `dequantize` (the arithmetic in
pallas_kernels/quant_reference.py, beside the kernels it is the reference of) is also the fallback
where they do not run."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import quant_reference as qref
from pallas_kernels.quant_reference import E2M1, GROUP, groups, pack4, pad_even, ungroup

from ..choices import LOSSY_FORMATS as FORMATS  # (the names --weights offers)

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0
E2M1_MAX = 6.0


@struct.dataclass
class QTensor:
    """A quantized [..., O, I] matrix. data: the values ([..., O, I], or [..., O, I/2] bytes for the
    4-bit formats); scale: see the table above; zero: int4's zero points (else None); tensor_scale:
    nvfp4's global f32 scale (else None). GGUF blocks: data and scale are the first two of the
    format's arrays (ggml_blocks.LAYOUT), `more` the rest."""
    data: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    tensor_scale: jax.Array | None
    fmt: str = struct.field(pytree_node=False)
    shape: tuple = struct.field(pytree_node=False)      # of the dequantized matrix
    # the GGUF block formats' further arrays (quant/ggml.py; pallas_kernels/ggml_blocks.LAYOUT)
    more: tuple = ()
    # on several devices (sharding.py): the mesh axis each of [O, I] is split over, every array split
    # alike (e.g. ("tensor", None)); () where it is whole or its arrays are not split alike
    split: tuple = struct.field(pytree_node=False, default=())

    @property
    def arrays(self) -> tuple:
        return tuple(a for a in (self.data, self.scale, self.zero, self.tensor_scale, *self.more) if a is not None)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.arrays)


def _safe(s):
    return jnp.where(s > 0, s, 1.0)


def quantize(w, fmt: str) -> QTensor:
    """w [..., O, I] (any float dtype) -> QTensor. Scales are computed in f32."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
    return _quantize(jnp.asarray(w), fmt)


@functools.partial(jax.jit, static_argnames=("fmt",))     # (one compile per shape, not one per op)
def _quantize(w, fmt: str) -> QTensor:
    w = w.astype(jnp.float32)
    shape, I = tuple(w.shape), w.shape[-1]
    amax_row = jnp.max(jnp.abs(w), axis=-1, keepdims=True)                 # [..., O, 1]
    if fmt == "int8":
        s = _safe(amax_row / 127.0)
        return QTensor(jnp.clip(jnp.round(w / s), -127, 127).astype(jnp.int8), s, None, None, fmt, shape)
    if fmt == "fp8":
        s = _safe(amax_row / F8_MAX)
        return QTensor((w / s).astype(F8), s, None, None, fmt, shape)
    if fmt == "fp8b":
        O = w.shape[-2]
        t = groups(w, 128)                                                # [..., O, nI, 128]
        padO = -O % 128
        t = jnp.pad(t, [(0, 0)] * (t.ndim - 3) + [(0, padO), (0, 0), (0, 0)])
        t = t.reshape(*t.shape[:-3], -1, 128, t.shape[-2], 128)            # [..., nO, 128, nI, 128]
        s = _safe(jnp.max(jnp.abs(t), axis=(-3, -1)) / F8_MAX)            # [..., nO, nI]
        q = (t / s[..., :, None, :, None]).astype(F8)
        q = q.reshape(*q.shape[:-4], -1, q.shape[-2], 128)[..., :O, :, :]
        return QTensor(ungroup(q, I), s, None, None, fmt, shape)
    g = GROUP[fmt]
    t = groups(w, g)                                                      # [..., O, I/g, g]
    amax = jnp.max(jnp.abs(t), axis=-1)                                    # [..., O, I/g]
    if fmt == "mxfp8":
        # a power-of-two scale per 32 (OCP MX); rounded up, 2^ceil(log2(amax / 448)) (as Transformer
        # Engine does) rather than the spec's 2^(floor(log2 amax) - 8), which clips up to 1/8 of a
        # block's largest values
        e = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, F8_MAX) / F8_MAX))
        s = jnp.exp2(e)
        q = jnp.clip(t / s[..., None], -F8_MAX, F8_MAX).astype(F8)
        return QTensor(ungroup(q, I), s.astype(jnp.float8_e8m0fnu), None, None, fmt, shape)
    if fmt == "int4":
        lo, hi = jnp.min(t, axis=-1), jnp.max(t, axis=-1)
        lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)               # zero stays exact
        s = _safe((hi - lo) / 15.0)
        z = jnp.clip(jnp.round(-lo / s), 0, 15)
        q = jnp.clip(jnp.round(t / s[..., None]) + z[..., None], 0, 15).astype(jnp.uint8)
        return QTensor(pack4(pad_even(ungroup(q, I))), s, z.astype(jnp.uint8), None, fmt, shape)
    # nvfp4: a tensor scale brings the block scales into e4m3's range; values are e2m1 codes
    ts = _safe(jnp.max(amax) / (F8_MAX * E2M1_MAX))
    sb = (amax / E2M1_MAX / ts).astype(F8)                                 # [..., O, I/g]
    scale = _safe(sb.astype(jnp.float32) * ts)
    x = t / scale[..., None]
    codes = _e2m1_codes(x)
    return QTensor(pack4(pad_even(ungroup(codes, I))), sb, None, ts, fmt, shape)


def _e2m1_codes(x):
    """Nearest e2m1 value (ties to the even code) as a 4-bit code: sign << 3 | magnitude index."""
    mags = jnp.asarray(E2M1[:8])
    a = jnp.minimum(jnp.abs(x), E2M1_MAX)
    d = jnp.abs(a[..., None] - mags)                                       # [..., 8]
    # ties: argmin takes the first (smaller) magnitude; prefer the even index instead
    best = jnp.min(d, axis=-1, keepdims=True)
    cand = (d == best)
    even = cand & (jnp.arange(8) % 2 == 0)
    idx = jnp.where(even.any(-1), jnp.argmax(even, -1), jnp.argmax(cand, -1))
    return (idx | jnp.where(x < 0, 8, 0)).astype(jnp.uint8)


def dequantize(q: QTensor, dtype=jnp.float32):
    """The matrix a QTensor stands for, [..., O, I] in dtype (computed in f32)."""
    return qref.dequantize(qref.kernel_args(q), q.fmt, q.shape, dtype)


def nominal_bits(fmt: str) -> float:
    """Bits per weight including scales (for reports): values plus their share of the scales."""
    return {"int8": 8, "fp8": 8, "fp8b": 8 + 32 / 128 ** 2, "mxfp8": 8 + 8 / 32,
            "int4": 4 + 40 / 128, "nvfp4": 4 + 8 / 16, "bf16p": 12,
            # GGUF blocks as held on the device (quant/ggml.py)
            "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5, "q4_k": 4 + 16 / 32 + 32 / 256, "q6_k": 6 + 8 / 16 + 16 / 256,
            "iq4_xs": 4 + 8 / 32 + 16 / 256}[fmt]
