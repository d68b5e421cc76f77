"""Quantized KV pools (`--kv-dtype`): a pool of codes [nKV, P, bs, hd'] with one f32 scale per
head and token row of each block [nKV, P, bs], so that a block moves (prefix cache, host and SSD
tiers) with its scales, and the attention kernels scale a whole row of scores (keys) or of
probabilities (values) once instead of dequantizing each element.

| fmt  | codes                                                         | value     | qmax |
|------|---------------------------------------------------------------|-----------|------|
| int8 | int8 [.., hd]                                                 | scale * q | 127  |
| fp8  | float8 e4m3 [.., hd]                                          | scale * q | 448  |
| int4 | uint8 [.., hd/2]: element j in the low nibble, j + hd/2 in the high one, as q + 8 (q in -7..7) | scale * q | 7 |

(K8V4 is int8 keys with int4 values.) int4 packs the two halves of a row rather than neighbouring
elements so that a kernel unpacks a tile into two half-width tiles with a mask and a shift, and
multiplies each by its own half of the output: no interleaving in registers.

Why a scale per token row and not one per block: a block's scale would be set by the largest value
written into it so far, so what a block holds would depend on how it was written (one prefill
chunk, or token by token with re-rounding as the scale grows), and a prefix-cache hit would not
give the same KV as a fresh prefill. With a row's scale set by that row alone (amax / qmax: nothing
saturates), every token's codes are a function of its own K/V only: writes are plain scatters,
a hit is bit-identical to a miss, and the scales cost 4 bytes per head and token (3% of int8 keys
at head_dim 128).

encode, decode, write and gather_blocks are jitted (inlined inside a model's step): called alone
(tests, the prefix cache's block moves) each shape compiles once rather than op by op."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

KV_FORMATS = ("int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}


def code_dims(fmt: str, hd: int) -> int:
    """Stored elements per row of hd values."""
    return hd // 2 if fmt == "int4" else hd


def code_dtype(fmt: str):
    return {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}[fmt]


def row_scale(x, fmt: str):
    """x [..., hd] f32 -> [...] f32: each row's scale (0 for a row of zeros, and for a row holding
    inf or NaN: its request's output is lost anyway, and a stale non-finite scale or code would
    poison another request reusing the block (0 x inf in a masked slot))."""
    s = jnp.max(jnp.abs(x), axis=-1) / QMAX[fmt]
    return jnp.where(jnp.isfinite(s), s, 0.0)


@functools.partial(jax.jit, static_argnames=("fmt",))
def encode(x, scale, fmt: str):
    """x [..., hd] f32, scale [...] -> codes [..., code_dims]."""
    y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    y = jnp.where(jnp.isfinite(y), y, 0.0)
    if fmt == "fp8":
        return jnp.clip(y, -QMAX[fmt], QMAX[fmt]).astype(jnp.float8_e4m3fn)
    q = jnp.clip(jnp.round(y), -QMAX[fmt], QMAX[fmt])
    if fmt == "int8":
        return q.astype(jnp.int8)
    u = (q + 8).astype(jnp.uint8)                                            # 1 .. 15
    h = u.shape[-1] // 2
    return u[..., :h] | (u[..., h:] << 4)


def unscaled(codes, fmt: str, dtype=jnp.float32):
    """codes [..., code_dims] -> the integers / e4m3 values they hold [..., hd] in dtype (exact in
    bf16 for every format: at most 8 significant bits)."""
    if fmt == "int4":
        codes = jnp.concatenate([codes & 0xF, codes >> 4], axis=-1).astype(jnp.int32) - 8
    return codes.astype(jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt",))
def decode(codes, scale, fmt: str):
    """codes [..., code_dims], scale [...] -> f32 [..., hd]."""
    return unscaled(codes, fmt) * scale[..., None]


@functools.partial(jax.jit, static_argnames=("fmt",))
def write(pool, scale, x, slots, fmt: str):
    """x [N, nKV, hd] at flat slots [N] (block * bs + offset; out of range: dropped) into pool
    [nKV, P, bs, code_dims] with scales [nKV, P, bs] -> (pool, scale)."""
    bs = pool.shape[2]
    blk, off = slots // bs, slots % bs
    x = x.astype(jnp.float32).swapaxes(0, 1)                                 # [nKV, N, hd]
    s = row_scale(x, fmt)                                                    # [nKV, N]
    pool = pool.at[:, blk, off].set(encode(x, s, fmt), mode="drop")
    return pool, scale.at[:, blk, off].set(s, mode="drop")


@functools.partial(jax.jit, static_argnames=("fmt",))
def gather_blocks(pool, scale, ids, fmt: str):
    """Blocks ids [...] of one pool, dequantized: f32 [nKV, ..., bs, hd]."""
    return decode(pool[:, ids], scale[:, ids], fmt)


__all__ = ["KV_FORMATS", "QMAX", "code_dims", "code_dtype", "decode", "encode", "gather_blocks", "row_scale",
           "unscaled", "write"]
