"""Lossless packed BF16 KV (`--kv-dtype bf16p`): fewer bytes than BF16, the same bits out. A BF16 value is sign, 8 exponent bits and 7 mantissa bits; within
one K or V row (one head, one token) the exponents sit in a narrow band below the row's largest
(SmolLM2: median span 9, 99th percentile 15), so each value keeps its sign and mantissa in a byte
and its exponent as a 4-bit distance below the row's base:

  codes [nKV, P, bs, hd + hd/2] uint8   bytes 0..hd-1: sign << 7 | mantissa; then the distance
                                        nibbles, element 2j low, 2j + 1 high (interleaved, so that a
                                        kernel rebuilds a whole [rows, hd] tile with Triton's two-way
                                        stack: the scores stay one dot over hd, as for a BF16 pool)
  base  [nKV, P, bs] f32                the row's largest exponent field (0..255, as a number)
  esc   [nKV, P, E] int32               per (head, block) up to E escapes, in position order:
                                        (position in the block + 1) | exponent << 16; 0 = none

Distance 15 means "exponent field 0" (zeros and subnormals: their bits are the sign and mantissa
byte alone) unless an escape names that position: values more than 14 binades below their row's
largest (measured: 2e-4 of K and 1e-4 of V values; at most 5 in any SmolLM2 block of 16 tokens x
64 dims, mean 0.24). A block that needs more than E escapes cannot be packed: the write reports
the tokens it could not store, the engine fails their requests (one bad request never harms
another; nothing of the failed step is cached), and the next write at the block's first slot
starts it afresh. The decode kernel rebuilds each tile in registers and keeps a BF16 pool's tiling
(bit-identical on the H200); prefill rebuilds the batch's blocks as BF16 first and runs the plain
kernel (ragged_paged_attention), so its bits are BF16's by construction.

12 bits a value plus 4 bytes a row plus 4E bytes a block-head: 0.77x BF16's bytes at head_dim 128.

Mixed steps (prefill chunks, and decodes while other work is queued) rebuild their batch's blocks as
BF16 before the plain ragged kernel (the plan budgets that buffer): exact, but such a step moves
more bytes than BF16 KV would; the fused rebuild in the ragged kernel gave other bits than BF16 on
the H200 (not yet understood), so it is not used."""
from __future__ import annotations

import jax
import jax.numpy as jnp

ESCAPES = 8
FAR = 14                       # the largest distance below the base a nibble holds; 15: exponent field 0 / escape
MAX_BLOCK_VALUES = 1 << 16     # an escape's position in its block has 16 bits: block_size x head_dim below this


def check_block(block_size: int, hd: int) -> None:
    if block_size * hd >= MAX_BLOCK_VALUES:
        raise ValueError(f"--kv-dtype bf16p: a block of {block_size} tokens x head_dim {hd} has more values than an "
                         f"escape can address ({MAX_BLOCK_VALUES}); use --block-size {MAX_BLOCK_VALUES // hd // 2} or less")


def code_dims(hd: int) -> int:
    return hd + hd // 2


def _fields(x):
    """x [..., hd] bf16 -> (sign|mantissa byte uint8, exponent field int32) [..., hd]."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    return sm.astype(jnp.uint8), (bits >> 7) & 0xFF


@jax.jit
def encode_rows(x):
    """x [..., hd] bf16 -> (codes [..., hd * 3/2] uint8, base [...] f32, escaped [..., hd] bool,
    exponent field [..., hd] int32)."""
    sm, e = _fields(x)
    base = jnp.max(e, axis=-1)
    d = base[..., None] - e
    normal = e > 0
    nib = jnp.where(normal & (d <= FAR), d, 15).astype(jnp.uint8)
    codes = jnp.concatenate([sm, nib[..., 0::2] | (nib[..., 1::2] << 4)], axis=-1)
    return codes, base.astype(jnp.float32), normal & (d > FAR), e


@jax.jit
def decode_rows(codes, base, esc):
    """codes [..., bs, hd * 3/2], base [..., bs], esc [..., E] (one block's escapes) -> bf16
    [..., bs, hd]: exactly the values written."""
    hd = codes.shape[-1] * 2 // 3
    bs = codes.shape[-2]
    sm = codes[..., :hd].astype(jnp.int32)
    nb = codes[..., hd:]
    nib = jnp.stack([nb & 0xF, nb >> 4], axis=-1).reshape(sm.shape).astype(jnp.int32)
    e = jnp.where(nib == 15, 0, base.astype(jnp.int32)[..., None] - nib)                  # [..., bs, hd]
    flat = e.reshape(*e.shape[:-2], bs * hd)
    at = jnp.arange(bs * hd)
    for i in range(esc.shape[-1]):                       # a few selects per value, as a kernel would
        r = esc[..., i:i + 1]
        flat = jnp.where((r != 0) & (at == (r & 0xFFFF) - 1), r >> 16, flat)
    e = flat.reshape(e.shape)
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


@jax.jit
def write(pool, base, esc, x, slots):
    """x [N, nKV, hd] at flat slots [N] (block * bs + offset; out of range: dropped) into pool
    [nKV, P, bs, hd * 3/2], base [nKV, P, bs], esc [nKV, P, E] -> (pool, base, esc, lost [N] bool:
    tokens whose block ran out of escapes). A sequence's tokens of one block come contiguous and
    in position order (as the engine writes them), so a block's escapes stay in position order."""
    nKV, P, bs, _ = pool.shape
    N, _, hd = x.shape
    E = esc.shape[-1]
    blk, off = slots // bs, slots % bs
    codes, b, escaped, e = encode_rows(x.swapaxes(0, 1))                       # [nKV, N, ...]
    pool = pool.at[:, blk, off].set(codes, mode="drop")
    base = base.at[:, blk, off].set(b, mode="drop")
    # what a touched block keeps: its escapes before the first row this write rewrites (a write
    # at the first slot starts the block afresh; a copied block's rows past the copy point go)
    cut = jnp.full((P,), bs, jnp.int32).at[blk].min(off, mode="drop")          # [P]
    row = ((esc & 0xFFFF) - 1) // hd                                           # [nKV, P, E]
    keep = (esc != 0) & (row < cut[None, :, None])
    kept = keep.sum(-1)                                                        # [nKV, P] (a prefix)
    esc = jnp.where(keep, esc, 0)
    # this write's escapes: rank within their block's run of tokens, after what the block kept
    start = jnp.concatenate([jnp.ones((1,), bool), blk[1:] != blk[:-1]])
    first = jax.lax.cummax(jnp.where(start, jnp.arange(N), 0), axis=0)         # [N] first token of the run
    flat = escaped.reshape(nKV, N * hd).astype(jnp.int32)
    before = jnp.cumsum(flat, axis=1) - flat                                   # [nKV, N*hd] exclusive
    rank = before - before[:, (first * hd)].repeat(hd, axis=1)
    b_ok = jnp.clip(blk, 0, P - 1)
    slot = kept[:, b_ok].repeat(hd, axis=1) + rank                              # [nKV, N*hd]
    lost = (flat > 0) & (slot >= E)
    record = (off[:, None] * hd + jnp.arange(hd) + 1) | (e << 16)              # [nKV, N, hd]
    where_ = jnp.where((flat > 0) & ~lost, slot, E)                             # E: dropped
    esc = esc.at[jnp.arange(nKV)[:, None], jnp.repeat(blk, hd)[None], where_].set(
        record.reshape(nKV, N * hd), mode="drop")
    return pool, base, esc, lost.reshape(nKV, N, hd).any(axis=(0, 2)) & (blk < P)


__all__ = ["ESCAPES", "code_dims", "decode_rows", "encode_rows", "write"]
