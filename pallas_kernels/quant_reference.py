"""The quantized weight formats as plain arithmetic: the pure-jnp reference of the fused dequantizing
matmul (quant_matmul.py; grouped_matmul.py multiplies stacked experts by the same weights) and the
fallback where no kernel runs. It reads the kernels' own arrays (`kernel_args`: a QTensor's arrays,
e8m0 scales as their exponent byte); infernix_jax/quant/formats.py describes the formats and builds
them (quantize), with the packing helpers here.

GROUP: weights per scale along K (0: one scale per output channel). GGUF blocks are decoded by
ggml_blocks.decode, the same arithmetic the kernels run on a tile."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import ggml_blocks
from .ggml_blocks import unpack_bits

GROUP = {"int8": 0, "fp8": 0, "fp8b": 128, "mxfp8": 32, "int4": 128, "nvfp4": 16}
# the 16 values of an e2m1 code (sign bit 3): what nvfp4's nibbles decode to
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0., -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def groups(w, g: int):
    """[..., O, I] -> [..., O, I/g, g] (I padded with zeros to a multiple of g)."""
    I = w.shape[-1]
    pad = -I % g
    if pad:
        w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])
    return w.reshape(*w.shape[:-1], -1, g)


def ungroup(w, I: int):
    """[..., O, I/g, g] -> [..., O, I] (the padding dropped)."""
    return w.reshape(*w.shape[:-2], -1)[..., :I]


def pack4(codes):
    """uint8 codes < 16 [..., I] (I even) -> bytes [..., I/2]: element 2j in the low nibble
    (ggml_blocks.unpack_bits(b, 4) undoes it)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def pad_even(q):
    """[..., I] -> [..., I rounded up to even] (a zero code appended): what pack4 needs."""
    return q if q.shape[-1] % 2 == 0 else jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, 1)])


def kernel_args(q) -> tuple:
    """The arrays of a QTensor the kernels read, in their order (e8m0 scales as their exponent byte)."""
    if q.fmt == "mxfp8":
        return q.data, jax.lax.bitcast_convert_type(q.scale, jnp.uint8)
    if q.fmt == "int4":
        return q.data, q.scale, q.zero
    if q.fmt == "nvfp4":
        return q.data, q.scale, q.tensor_scale.reshape(1)
    return q.arrays


@functools.partial(jax.jit, static_argnames=("fmt", "shape", "dtype"))
def dequantize(args: tuple, fmt: str, shape: tuple, dtype=jnp.float32):
    """The matrix [..., O, I] of `shape` that the arrays args (kernel_args) stand for, in dtype
    (computed in f32)."""
    I = shape[-1]
    if fmt in ggml_blocks.LAYOUT:
        arrays = [a.reshape(-1, a.shape[-1]) for a in args]
        return ggml_blocks.decode(fmt, arrays, I).reshape(shape).astype(dtype)
    data, scale, *rest = args
    f32 = jnp.float32
    if fmt in ("int8", "fp8"):                          # scale [..., O, 1]
        w = data.astype(f32) * scale
    elif fmt == "fp8b":                                 # scale [..., O/128, I/128]
        s = jnp.repeat(jnp.repeat(scale.astype(f32), 128, axis=-2)[..., :shape[-2], :], 128, axis=-1)[..., :I]
        w = data.astype(f32) * s
    elif fmt == "mxfp8":                                # scale: e8m0 exponent bytes [..., O, I/32]
        s = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).astype(f32)
        w = ungroup(groups(data.astype(f32), 32) * s[..., None], I)
    elif fmt == "int4":                                 # scale, zero [..., O, I/128]
        t = groups(unpack_bits(data, 4)[..., :I].astype(f32), 128)
        w = ungroup((t - rest[0].astype(f32)[..., None]) * scale[..., None], I)
    elif fmt == "nvfp4":                                # scale e4m3 [..., O, I/16], tensor scale [1]
        vals = jnp.asarray(E2M1)[unpack_bits(data, 4)[..., :I]]
        w = ungroup(groups(vals, 16) * (scale.astype(f32) * rest[0])[..., None], I)
    else:
        raise ValueError(f"unknown weight format {fmt!r}")
    return w.astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "shape"))
def quant_matmul_reference(x, args: tuple, fmt: str, shape: tuple):
    """What quant_matmul computes: x [M, K] @ W^T -> [M, N] f32, W of `shape` (N, K) given as
    kernel_args(W), dequantized in x's dtype (as the kernel feeds its dot), the products exact in f32."""
    w = dequantize(args, fmt, shape, x.dtype).astype(jnp.float32)
    return jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w, precision="highest")


__all__ = ["E2M1", "GROUP", "dequantize", "groups", "kernel_args", "pack4", "pad_even", "quant_matmul_reference",
           "ungroup"]
