"""Ragged paged attention for prefill chunks (and any mix with decodes) in Pallas/Triton.

Queries of all sequences are flattened into one token axis (cu_q marks where each sequence's
chunk starts); K/V come from the paged pool. Grid (sequence, query block, kv head): a program takes
`block_q` query tokens of one sequence and the G query heads sharing one KV head, and walks the
sequence's KV blocks up to its causal limit with an online softmax. Programs whose query block lies
past their sequence's chunk exit at once, so the grid can be sized from static shapes."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .paged_attention import ragged_paged_attention_reference
from .paged_decode_attention import NEG, _compiler_params, _dot_nn, _dot_nt, fit_pages


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64                  # query tokens per program
    pages_per_compute_block: int = 4   # KV blocks per inner iteration
    num_warps: int = 4
    num_stages: int = 2


def _kernel(cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, block_q: int, ppb: int, G: int, scale: float):
    # cu_ref [B + 1], lens_ref [B]; bt_ref [M] this sequence's blocks
    # q_ref, o_ref [G, N + block_q, hd] this kv head's queries / outputs (padded by block_q rows)
    # k_ref, v_ref [P, bs, hd] this kv head's pool
    b, j = pl.program_id(0), pl.program_id(1)
    bs, hd = k_ref.shape[1], k_ref.shape[2]
    q_begin, q_end = cu_ref[b], cu_ref[b + 1]
    start = q_begin + j * block_q

    @pl.when(start < q_end)
    def _():
        kv_len = lens_ref[b]
        q_len = q_end - q_begin
        rows = jnp.arange(block_q)
        pos = kv_len - q_len + (start - q_begin) + rows                          # [block_q]
        last = jnp.minimum(kv_len - q_len + (start - q_begin) + block_q, kv_len)  # exclusive
        n_pages = pl.cdiv(last, bs)
        block_k = ppb * bs
        qs = [q_ref[g, pl.ds(start, block_q), :] for g in range(G)]             # G x [block_q, hd]

        def body(i, carry):
            pages = bt_ref[pl.ds(i * ppb, ppb)]
            k = k_ref[pages].reshape(block_k, hd)
            v = v_ref[pages].reshape(block_k, hd)
            tok = i * block_k + jnp.arange(block_k)
            visible = (tok[None, :] <= pos[:, None]) & (tok[None, :] < kv_len)
            out = []
            for g in range(G):
                o, m, l = carry[g]
                s = _dot_nt(qs[g], k) * scale      # [block_q, block_k]
                s = jnp.where(visible, s, NEG)
                m_new = jnp.maximum(m, s.max(axis=-1))
                corr = jnp.exp(m - m_new)
                p = jnp.exp(s - m_new[:, None])
                out.append((o * corr[:, None] + _dot_nn(p.astype(v.dtype), v),
                            m_new, l * corr + p.sum(axis=-1)))
            return tuple(out)

        init = tuple((jnp.zeros((block_q, hd), jnp.float32), jnp.full((block_q,), NEG, jnp.float32),
                      jnp.zeros((block_q,), jnp.float32)) for _ in range(G))
        res = jax.lax.fori_loop(0, pl.cdiv(n_pages, ppb), body, init)
        valid = (start + rows) < q_end
        for g in range(G):
            o, _, l = res[g]
            o = o / jnp.maximum(l, 1e-30)[:, None]
            pltriton.store(o_ref.at[pl.ds(g, 1), pl.ds(start, block_q), :], o.astype(o_ref.dtype)[None],
                           mask=valid[None, :, None])


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale"))
def ragged_paged_attention(q, k_pool, v_pool, block_tables, kv_lens, cu_q, scale: float | None = None,
                           block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """q [N, nH, hd]; k_pool, v_pool [nKV, P, bs, hd]; block_tables [B, M]; kv_lens [B]; cu_q [B + 1]
    -> [N, nH, hd] (rows past cu_q[B] are zero)."""
    N, nH, hd = q.shape
    nKV, P, bs, hd_k = k_pool.shape
    B, M = block_tables.shape
    if hd_k != hd or v_pool.shape != k_pool.shape or nH % nKV:
        raise ValueError(f"shape mismatch: q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}")
    if kv_lens.shape != (B,) or cu_q.shape != (B + 1,):
        raise ValueError(f"kv_lens {kv_lens.shape} / cu_q {cu_q.shape} do not match batch {B}")
    scale = hd ** -0.5 if scale is None else scale
    G = nH // nKV
    # the G query tiles stay resident for the whole KV walk: keep them within ~64 KiB
    fit_q = (64 * 1024) // (G * hd * jnp.dtype(q.dtype).itemsize)
    bq = max(16, min(block_sizes.block_q, 1 << max(0, fit_q.bit_length() - 1)))
    ppb = max(1, min(block_sizes.pages_per_compute_block, M,
                     fit_pages(bs, hd, k_pool.dtype, block_sizes.num_stages, 96 * 1024)))
    Mp = pl.cdiv(M, ppb) * ppb
    bt = jnp.pad(block_tables, ((0, 0), (0, Mp - M)))
    qh = jnp.pad(q.reshape(N, nKV, G, hd).transpose(1, 2, 0, 3), ((0, 0), (0, 0), (0, bq), (0, 0)))  # [nKV, G, N+bq, hd]
    kernel = functools.partial(_kernel, block_q=bq, ppb=ppb, G=G, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid=(B, pl.cdiv(N, bq), nKV),
        in_specs=[
            pl.BlockSpec((B + 1,), lambda b, j, h: (0,)),
            pl.BlockSpec((B,), lambda b, j, h: (0,)),
            pl.BlockSpec((None, Mp), lambda b, j, h: (b, 0)),
            pl.BlockSpec((None, G, N + bq, hd), lambda b, j, h: (h, 0, 0, 0)),
            pl.BlockSpec((None, P, bs, hd), lambda b, j, h: (h, 0, 0, 0)),
            pl.BlockSpec((None, P, bs, hd), lambda b, j, h: (h, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, G, N + bq, hd), lambda b, j, h: (h, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nKV, G, N + bq, hd), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(block_sizes),
        name="ragged_paged_attention",
    )(cu_q.astype(jnp.int32), kv_lens.astype(jnp.int32), bt, qh, k_pool, v_pool)
    out = out[:, :, :N].transpose(2, 0, 1, 3).reshape(N, nH, hd)
    valid = jnp.arange(N) < cu_q[B]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


__all__ = ["BlockSizes", "ragged_paged_attention", "ragged_paged_attention_reference"]
