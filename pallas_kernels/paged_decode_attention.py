"""Paged decode attention (one query token per sequence) in Pallas, lowered through Triton so that
it runs on any recent NVIDIA GPU; `interpret=True` runs it on the CPU for tests.

Grid (batch, kv head, split): each program takes one sequence, one KV head with its G query heads
(padded to 16 rows for the tensor cores), and a fixed-size slice of the sequence (`pages_per_split`
blocks, independent of the batch size, so that results never depend on what else is batched).
It walks its blocks `pages_per_compute_block` at a time with an online softmax and writes a partial
(o, max, sum); the splits are merged in jnp afterwards (flash-decoding)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .paged_attention import paged_decode_attention_reference

NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = 1.4426950408889634   # softmax in base 2: exp2 is one instruction, exp is exp2 plus a multiply


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # defaults from the sweep on an H200 (docs/benchmarks.md): qwen3-8b heads at batch x context
    # 1 x 32K, 8 x 32K, 32 x 8K, 64 x 4K; the configuration whose worst slowdown against each
    # shape's best was smallest. The split size is fixed, whatever the batch.
    pages_per_compute_block: int = 16    # KV blocks loaded per inner iteration (capped by fit_pages)
    pages_per_split: int = 128           # KV blocks per program along the sequence
    num_warps: int = 4
    num_stages: int = 3


def fit_pages(bs: int, hd: int, dtype, stages: int, smem_budget: int = 160 * 1024) -> int:
    """Most KV blocks per iteration whose K and V tiles, pipelined `stages` deep, fit in shared
    memory (f32 tiles are twice the bf16 ones; Hopper has ~227 KiB per block)."""
    per_page = 2 * bs * hd * jnp.dtype(dtype).itemsize * max(stages, 1)
    return max(1, 1 << max(0, (smem_budget // per_page).bit_length() - 1))


def _dot_nt(a, b):
    """a [m, d] x b [n, d] -> [m, n] f32 (lax.dot_general: portable across Pallas versions)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [m, k] x b [k, n] -> [m, n] f32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _compiler_params(bs: BlockSizes):
    try:
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    except (ImportError, AttributeError):  # older/newer module layouts: fall back to defaults
        return None


def _kernel(bt_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, ppb: int, pps: int, scale: float):
    # bt_ref   [pps]            this split's block ids
    # lens_ref [B]              kv lengths
    # q_ref    [Gp, hd]         queries of this kv head (rows >= G are padding)
    # k_ref, v_ref [P, bs, hd]  this kv head's pool
    # o_ref [Gp, hd], m_ref / l_ref [Gp]: this split's partial result
    b, split = pl.program_id(0), pl.program_id(2)
    bs, hd = k_ref.shape[1], k_ref.shape[2]
    length = lens_ref[b]
    first_page = split * pps
    n_pages = jnp.clip(pl.cdiv(length, bs) - first_page, 0, pps)
    q = q_ref[...]
    gp = q.shape[0]
    block_k = ppb * bs

    def body(i, carry):
        o, m, l = carry
        pages = bt_ref[pl.ds(i * ppb, ppb)]                                   # [ppb]
        k = k_ref[pages].reshape(block_k, hd)
        v = v_ref[pages].reshape(block_k, hd)
        s = _dot_nt(q, k) * scale            # [Gp, block_k], log2 units
        tok = (first_page + i * ppb) * bs + jnp.arange(block_k)
        s = jnp.where((tok < length)[None, :], s, NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * corr + p.sum(axis=-1)
        o = o * corr[:, None] + _dot_nn(p.astype(v.dtype), v)
        return o, m_new, l

    init = (jnp.zeros((gp, hd), jnp.float32), jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(n_pages, ppb), body, init)
    o_ref[...] = o.astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale"))
def paged_decode_attention(q, k_pool, v_pool, block_tables, kv_lens, scale: float | None = None,
                           block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """q [B, nH, hd]; k_pool, v_pool [nKV, P, bs, hd]; block_tables [B, M]; kv_lens [B] -> [B, nH, hd]."""
    B, nH, hd = q.shape
    nKV, P, bs, hd_k = k_pool.shape
    if hd_k != hd or v_pool.shape != k_pool.shape or nH % nKV:
        raise ValueError(f"shape mismatch: q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}")
    if block_tables.shape[0] != B or kv_lens.shape != (B,):
        raise ValueError(f"block_tables {block_tables.shape} / kv_lens {kv_lens.shape} do not match batch {B}")
    scale = hd ** -0.5 if scale is None else scale
    G = nH // nKV
    gp = max(16, 1 << (G - 1).bit_length())                                   # tensor-core rows
    M = block_tables.shape[1]
    pps = min(block_sizes.pages_per_split, 1 << (M - 1).bit_length())
    ppb = min(block_sizes.pages_per_compute_block, pps, fit_pages(bs, hd, k_pool.dtype, block_sizes.num_stages))
    splits = pl.cdiv(M, pps)
    bt = jnp.pad(block_tables, ((0, 0), (0, splits * pps - M)))
    qg = jnp.pad(q.reshape(B, nKV, G, hd), ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    kernel = functools.partial(_kernel, ppb=ppb, pps=pps, scale=scale * LOG2E)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, nKV, splits),
        in_specs=[
            pl.BlockSpec((None, pps), lambda b, h, s: (b, s)),                             # block table slice
            pl.BlockSpec((B,), lambda b, h, s: (0,)),                                      # kv_lens
            pl.BlockSpec((None, None, gp, hd), lambda b, h, s: (b, h, 0, 0)),              # q
            pl.BlockSpec((None, P, bs, hd), lambda b, h, s: (h, 0, 0, 0)),                 # k pool of head h
            pl.BlockSpec((None, P, bs, hd), lambda b, h, s: (h, 0, 0, 0)),                 # v pool of head h
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, hd), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, B, nKV, gp, hd), jnp.float32),
            jax.ShapeDtypeStruct((splits, B, nKV, gp), jnp.float32),
            jax.ShapeDtypeStruct((splits, B, nKV, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(block_sizes),
        name="paged_decode_attention",
    )(bt, kv_lens.astype(jnp.int32), qg, k_pool, v_pool)
    # merge the splits (flash-decoding): rescale each partial to the global max
    m_all = m.max(axis=0)                                                      # [B, nKV, gp]
    w = jnp.exp2(m - m_all[None])                                              # [S, B, nKV, gp]
    l_all = (l * w).sum(axis=0)
    out = (o * w[..., None]).sum(axis=0) / jnp.maximum(l_all, 1e-30)[..., None]
    return out[:, :, :G].reshape(B, nH, hd).astype(q.dtype)


__all__ = ["BlockSizes", "paged_decode_attention", "paged_decode_attention_reference"]
