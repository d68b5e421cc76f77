"""Quantized KV pools (`--kv-dtype`, work in progress): a pool of codes [nKV, P, bs, hd'] with one f32
scale per (kv head, block) [nKV, P], so that a block moves (prefix cache, host and SSD tiers) with
its scale and one [bs, hd] tile is dequantized by one multiply.

| fmt  | codes                                         | value            | qmax |
|------|-----------------------------------------------|------------------|------|
| int8 | int8 [.., hd]                                 | scale * q        | 127  |
| fp8  | float8 e4m3 [.., hd]                          | scale * q        | 448  |
| int4 | uint8 [.., hd/2], element 2j in the low nibble, q + 8 (q in -7..7) | scale * q | 7 |

(K8V4 is int8 keys with int4 values.)

A block's scale is set by the largest magnitude written into it so far (amax / qmax: nothing
saturates). A write that raises it re-rounds the rows the block already holds to the new scale
(round to nearest, once per raise: a block filled by one prefill chunk is rounded once; decode may
raise a block's scale a few times while it fills). A write at a block's first slot starts the
block afresh (a block taken from the free list keeps its last owner's scale otherwise)."""
from __future__ import annotations

import jax.numpy as jnp

KV_FORMATS = ("int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}


def code_dims(fmt: str, hd: int) -> int:
    """Stored elements per row of hd values."""
    return hd // 2 if fmt == "int4" else hd


def code_dtype(fmt: str):
    return {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}[fmt]


def encode(x, scale, fmt: str):
    """x [..., hd] f32, scale broadcastable to x[..., :1] -> codes [..., code_dims]."""
    y = x / jnp.where(scale > 0, scale, 1.0)
    if fmt == "fp8":
        return jnp.clip(y, -QMAX[fmt], QMAX[fmt]).astype(jnp.float8_e4m3fn)
    q = jnp.clip(jnp.round(y), -QMAX[fmt], QMAX[fmt])
    if fmt == "int8":
        return q.astype(jnp.int8)
    u = (q + 8).astype(jnp.uint8)                                            # 1 .. 15
    return u[..., 0::2] | (u[..., 1::2] << 4)


def decode(codes, scale, fmt: str):
    """codes [..., code_dims], scale broadcastable to codes[..., :1] -> f32 [..., hd]."""
    if fmt == "int4":
        q = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
        q = q.astype(jnp.float32) - 8.0
    else:
        q = codes.astype(jnp.float32)
    return q * scale


def write(pool, scale, x, slots, fmt: str):
    """x [N, nKV, hd] at flat slots [N] (block * bs + offset; out of range: dropped) into pool
    [nKV, P, bs, code_dims] with scales [nKV, P] -> (pool, scale)."""
    nKV, P, bs, _ = pool.shape
    blk, off = slots // bs, slots % bs
    x = x.astype(jnp.float32).swapaxes(0, 1)                                 # [nKV, N, hd]
    # a block written at its first slot starts afresh
    fresh = jnp.zeros((P,), bool).at[blk].max(off == 0, mode="drop")
    old = jnp.where(fresh[None], 0.0, scale)                                 # [nKV, P]
    need = jnp.max(jnp.abs(x), axis=-1) / QMAX[fmt]                           # [nKV, N]
    new = old.at[:, blk].max(need, mode="drop")
    # re-round what the touched blocks hold where their scale grew (unchanged blocks: ratio 1, exact)
    b = jnp.clip(blk, 0, P - 1)
    held = decode(pool[:, b], old[:, b][..., None, None], fmt)              # [nKV, N, bs, hd]
    grown = new[:, b] > old[:, b]
    redo = encode(held, new[:, b][..., None, None], fmt)
    pool = pool.at[:, blk].set(jnp.where(grown[..., None, None], redo, pool[:, b]), mode="drop")
    pool = pool.at[:, blk, off].set(encode(x, new[:, b][..., None], fmt), mode="drop")
    return pool, new


def gather_blocks(pool, scale, ids, fmt: str):
    """Blocks ids [...] of one pool, dequantized: f32 [nKV, ..., bs, hd]."""
    return decode(pool[:, ids], scale[:, ids][..., None, None], fmt)


__all__ = ["KV_FORMATS", "QMAX", "code_dims", "code_dtype", "decode", "encode", "gather_blocks", "write"]
