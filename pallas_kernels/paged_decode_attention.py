"""Paged decode attention (one query token per sequence) in Pallas, lowered through Triton so that
it runs on any recent NVIDIA GPU; `interpret=True` runs it on the CPU for tests. Plain pools in the
model dtype or quantized ones (kv_quant: codes with a scale per head and token row).

Grid (batch, kv head, split): each program takes one sequence, one KV head with its G query heads
(padded to 16 rows for the tensor cores), and a slice of the sequence (`pages_per_split` blocks).
It walks its blocks `pages_per_compute_block` at a time with an online softmax and writes a partial
(o, max, sum); the splits are merged in jnp afterwards (flash-decoding). When batch x KV heads is
small (batch 1: 8 programs for qwen3-8b on 132 SMs) the slices shrink until there are about
`min_programs` programs: the split size then depends on the batch's shape (B and the block-table
width), as cuBLAS's choice of algorithm does on the row count."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import triton_params
from .paged_attention import paged_decode_attention_reference
from .paged_blocks import (LOG2E, NEG, attend_block, check_pools, extra_operands, fit_pages, pool_specs, split_refs,
                           tile_dtype, value_parts)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # defaults from the sweep on an H200 (docs/benchmarks.md): qwen3-8b heads at batch x context
    # 1 x 32K, 8 x 32K, 32 x 8K, 64 x 4K; the configuration whose worst slowdown against each
    # shape's best was smallest.
    pages_per_compute_block: int = 16    # KV blocks loaded per inner iteration (capped by fit_pages)
    pages_per_split: int = 128           # most KV blocks per program along the sequence
    num_warps: int = 4
    num_stages: int = 3
    # smaller splits while batch x KV heads x splits is below this (0: never): ~2 programs per SM
    min_programs: int = 264
    min_pages_per_split: int = 4         # ... but not below this many blocks per split


def split_pages(B: int, nKV: int, M: int, bs: BlockSizes) -> int:
    """KV blocks per split (a power of two) for a batch of B sequences whose block tables are M wide:
    `pages_per_split`, or fewer when that leaves under `min_programs` programs to fill the GPU."""
    pps = min(bs.pages_per_split, 1 << (M - 1).bit_length())
    if bs.min_programs and B * nKV * pl.cdiv(M, pps) < bs.min_programs:
        want = pl.cdiv(bs.min_programs, B * nKV)                              # splits per sequence
        pps = min(pps, max(bs.min_pages_per_split, 1 << (pl.cdiv(M, want) - 1).bit_length()))
    return pps


def _kernel(bt_ref, lens_ref, q_ref, k_ref, v_ref, *refs, ppb: int, pps: int, scale: float, fmts):
    # bt_ref   [pps]            this split's block ids
    # lens_ref [B]              kv lengths
    # q_ref    [Gp, hd]         queries of this kv head (rows >= G are padding)
    # k_ref, v_ref [P, bs, hd'] this kv head's pool (quantized: codes, then ks_ref, vs_ref [P, bs];
    # bf16p: codes, row bases, then escapes ke_ref, ve_ref [P, E])
    # o_ref [parts, Gp, hd / parts], m_ref / l_ref [Gp]: this split's partial result
    ks_ref, vs_ref, ke_ref, ve_ref, (o_ref, m_ref, l_ref) = split_refs(refs, fmts)
    b, split = pl.program_id(0), pl.program_id(2)
    bs = k_ref.shape[1]
    length = lens_ref[b]
    first_page = split * pps
    n_pages = jnp.clip(pl.cdiv(length, bs) - first_page, 0, pps)
    q = q_ref[...]
    gp, hd = q.shape
    block_k = ppb * bs
    parts = value_parts(fmts)

    def body(i, carry):
        pages = bt_ref[pl.ds(i * ppb, ppb)]                                   # [ppb]
        tok = (first_page + i * ppb) * bs + jnp.arange(block_k)
        return attend_block(q, *carry, k_ref, v_ref, ks_ref, vs_ref, pages,
                            lambda s: jnp.where((tok < length)[None, :], s, NEG), scale, fmts, ke_ref, ve_ref)

    init = (tuple(jnp.zeros((gp, hd // parts), jnp.float32) for _ in range(parts)),
            jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(n_pages, ppb), body, init)
    for i in range(parts):
        o_ref[i] = o[i].astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale", "fmts"))
def paged_decode_attention(q, k_pool, v_pool, block_tables, kv_lens, scale: float | None = None, k_scale=None,
                           v_scale=None, fmts=None, k_esc=None, v_esc=None, block_sizes: BlockSizes = BlockSizes(),
                           interpret: bool = False):
    """q [B, nH, hd]; k_pool, v_pool [nKV, P, bs, hd]; block_tables [B, M]; kv_lens [B] -> [B, nH, hd].
    Quantized pools (kv_quant): codes [nKV, P, bs, hd'], k_scale, v_scale [nKV, P, bs] and
    fmts = (key format, value format); bf16p pools (kv_bf16p): also k_esc, v_esc [nKV, P, E]."""
    B, nH, hd = q.shape
    fmts, parts = check_pools(q, k_pool, v_pool, k_scale, v_scale, fmts, k_esc, v_esc)
    nKV, P, bs, _ = k_pool.shape
    if block_tables.shape[0] != B or kv_lens.shape != (B,):
        raise ValueError(f"block_tables {block_tables.shape} / kv_lens {kv_lens.shape} do not match batch {B}")
    scale = hd ** -0.5 if scale is None else scale
    G = nH // nKV
    gp = max(16, 1 << (G - 1).bit_length())                                   # tensor-core rows
    M = block_tables.shape[1]
    pps = split_pages(B, nKV, M, block_sizes)
    ppb = min(block_sizes.pages_per_compute_block, pps,
              fit_pages(bs, hd, tile_dtype(fmts, k_pool.dtype, q.dtype), block_sizes.num_stages))
    splits = pl.cdiv(M, pps)
    bt = jnp.pad(block_tables, ((0, 0), (0, splits * pps - M)))
    qg = jnp.pad(q.reshape(B, nKV, G, hd), ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    kernel = functools.partial(_kernel, ppb=ppb, pps=pps, scale=scale * LOG2E, fmts=fmts)
    E = k_esc.shape[-1] if k_esc is not None else 0
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, nKV, splits),
        in_specs=[
            pl.BlockSpec((None, pps), lambda b, h, s: (b, s)),                             # block table slice
            pl.BlockSpec((B,), lambda b, h, s: (0,)),                                      # kv_lens
            pl.BlockSpec((None, None, gp, hd), lambda b, h, s: (b, h, 0, 0)),              # q
            *pool_specs(P, bs, hd, fmts, lambda b, h, s: h, E),                            # head h's pools
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, parts, gp, hd // parts), lambda b, h, s: (s, b, h, 0, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, B, nKV, parts, gp, hd // parts), jnp.float32),
            jax.ShapeDtypeStruct((splits, B, nKV, gp), jnp.float32),
            jax.ShapeDtypeStruct((splits, B, nKV, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else triton_params(block_sizes.num_warps, block_sizes.num_stages),
        name="paged_decode_attention",
    )(bt, kv_lens.astype(jnp.int32), qg, k_pool, v_pool, *extra_operands(fmts, k_scale, v_scale, k_esc, v_esc))
    o = jnp.moveaxis(o, 3, 4).reshape(splits, B, nKV, gp, hd)                 # halves side by side
    # merge the splits (flash-decoding): rescale each partial to the global max
    m_all = m.max(axis=0)                                                      # [B, nKV, gp]
    w = jnp.exp2(m - m_all[None])                                              # [S, B, nKV, gp]
    l_all = (l * w).sum(axis=0)
    out = (o * w[..., None]).sum(axis=0) / jnp.maximum(l_all, 1e-30)[..., None]
    return out[:, :, :G].reshape(B, nH, hd).astype(q.dtype)


__all__ = ["BlockSizes", "paged_decode_attention", "split_pages", "paged_decode_attention_reference"]
