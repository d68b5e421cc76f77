"""Ragged paged attention for prefill chunks (and any mix with decodes) in Pallas/Triton.

Queries of all sequences are flattened into one token axis (cu_q marks where each sequence's
chunk starts); K/V come from the paged pool. Grid (sequence, query block, kv head): a program takes
a tile of rows = (query tokens of one sequence) x (the G query heads sharing one KV head), so that
every K/V block loaded feeds one large matmul, and walks the sequence's KV blocks up to the tile's
causal limit with an online softmax (attend_block, shared with the decode kernel, so quantized
pools work here the same way). Programs whose query block lies past their sequence's chunk exit at
once, so the grid can be sized from static shapes.

Draft trees (speculative decoding; paged_attention's module doc): with tree_lo / anc each query
also needs its ancestor bit for the slots from its row's tree_lo on, so the blocks from there take
the masked path."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .paged_attention import ragged_paged_attention_reference, tree_visible
from .common import triton_params
from .paged_blocks import (LOG2E, NEG, attend_block, check_pools, extra_operands, fit_pages, pool_specs, split_refs,
                           tile_dtype, value_parts)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_rows: int = 128              # query rows per program: tokens x (query heads of one KV head)
    pages_per_compute_block: int = 4   # KV blocks per inner iteration
    num_warps: int = 4
    num_stages: int = 2


def _kernel(cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs, block_q: int, ppb: int, gp: int, scale: float,
            fmts, tree: bool):
    # cu_ref [B + 1], lens_ref [B]; bt_ref [M] this sequence's blocks
    # q_ref [(N + block_q) * gp, hd] this kv head's queries, row = token * gp + head
    #   (the G heads sharing the KV head, padded to gp, so one tile feeds the tensor cores)
    # k_ref, v_ref [P, bs, hd'] this kv head's pool (quantized: codes, then ks_ref, vs_ref [P, bs])
    # tree: lo_ref [B] each row's tree start, anc_ref [(N + block_q) * gp] each query row's ancestor bits
    # o_ref [parts, (N + block_q) * gp, hd / parts] its outputs (int4 values: two halves)
    ks_ref, vs_ref, ke_ref, ve_ref, rest = split_refs(refs, fmts)
    lo_ref, anc_ref, o_ref = rest if tree else (None, None, *rest)
    b, j = pl.program_id(0), pl.program_id(1)
    bs, hd = k_ref.shape[1], q_ref.shape[1]
    parts = value_parts(fmts)
    q_begin, q_end = cu_ref[b], cu_ref[b + 1]
    start = q_begin + j * block_q
    rows = block_q * gp

    @pl.when(start < q_end)
    def _():
        kv_len = lens_ref[b]
        q_len = q_end - q_begin
        tok_of_row = jnp.arange(rows) // gp
        pos0 = kv_len - q_len + (start - q_begin)                                   # the tile's first position
        pos = pos0 + tok_of_row                                                     # [rows]
        last = jnp.minimum(kv_len - q_len + (start - q_begin) + block_q, kv_len)   # exclusive
        block_k = ppb * bs
        q = q_ref[pl.ds(start * gp, rows), :]                                       # [rows, hd]

        def body(i, carry, masked: bool):
            def mask(s):
                if not masked:
                    return s
                tok = i * block_k + jnp.arange(block_k)
                ok = (tok[None, :] <= pos[:, None]) & (tok[None, :] < kv_len)
                if tree:
                    ok &= tree_visible(tok[None, :], lo_ref[b], anc_ref[pl.ds(start * gp, rows)][:, None])
                return jnp.where(ok, s, NEG)
            return attend_block(q, *carry, k_ref, v_ref, ks_ref, vs_ref, bt_ref[pl.ds(i * ppb, ppb)], mask,
                                scale, fmts, ke_ref, ve_ref)

        init = (tuple(jnp.zeros((rows, hd // parts), jnp.float32) for _ in range(parts)),
                jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
        # KV blocks wholly at or before the tile's first query position need no mask; only the
        # blocks on the causal diagonal (and the ragged end) pay for it
        n_full = (pos0 + 1) // block_k
        if tree:
            n_full = jnp.minimum(n_full, lo_ref[b] // block_k)
        n_all = pl.cdiv(pl.cdiv(last, bs), ppb)
        carry = jax.lax.fori_loop(0, n_full, functools.partial(body, masked=False), init)
        o, _, l = jax.lax.fori_loop(n_full, n_all, functools.partial(body, masked=True), carry)
        valid = (start + tok_of_row) < q_end
        for i in range(parts):
            pltriton.store(o_ref.at[pl.ds(i, 1), pl.ds(start * gp, rows), :],
                           (o[i] / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)[None], mask=valid[None, :, None])


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale", "fmts"))
def ragged_paged_attention(q, k_pool, v_pool, block_tables, kv_lens, cu_q, scale: float | None = None, k_scale=None,
                           v_scale=None, fmts=None, k_esc=None, v_esc=None, tree_lo=None, anc=None,
                           block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """q [N, nH, hd]; k_pool, v_pool [nKV, P, bs, hd]; block_tables [B, M]; kv_lens [B]; cu_q [B + 1]
    -> [N, nH, hd] (rows past cu_q[B] are zero). Quantized pools: as paged_decode_attention.
    tree_lo [B], anc [N]: draft trees (paged_attention's module doc; None: none)."""
    N, nH, hd = q.shape
    fmts, parts = check_pools(q, k_pool, v_pool, k_scale, v_scale, fmts, k_esc, v_esc)
    nKV, P, bs, _ = k_pool.shape
    B, M = block_tables.shape
    if fmts[0] == "bf16p":
        # rebuild the batch's blocks as BF16 and run the plain kernel: rebuilding tiles inside this
        # kernel let Hopper pick other MMA instructions for its 128-row tiles (last-bit differences,
        # seen on the H200), and bf16p promises BF16's bits. Prefill is compute-bound: one more pass
        # over its blocks costs little (decode, bandwidth-bound, rebuilds tiles in its kernel).
        from .kv_bf16p import decode_rows
        flat = block_tables.reshape(-1)
        kb, vb = (decode_rows(p[:, flat], s[:, flat], e[:, flat]) for p, s, e in
                  ((k_pool, k_scale, k_esc), (v_pool, v_scale, v_esc)))                 # [nKV, B*M, bs, hd]
        tables = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
        return ragged_paged_attention(q, kb, vb, tables, kv_lens, cu_q, scale, tree_lo=tree_lo, anc=anc,
                                      block_sizes=block_sizes, interpret=interpret)
    if kv_lens.shape != (B,) or cu_q.shape != (B + 1,):
        raise ValueError(f"kv_lens {kv_lens.shape} / cu_q {cu_q.shape} do not match batch {B}")
    scale = hd ** -0.5 if scale is None else scale
    G = nH // nKV
    gp = 1 << (G - 1).bit_length()                                   # power of two for Triton tiles
    # the query tile stays resident for the whole KV walk: keep it within ~64 KiB
    fit = (64 * 1024) // (hd * jnp.dtype(q.dtype).itemsize)
    rows = max(gp, min(block_sizes.block_rows, 1 << max(0, fit.bit_length() - 1)))
    bq = max(1, rows // gp)
    ppb = max(1, min(block_sizes.pages_per_compute_block, M,
                     fit_pages(bs, hd, tile_dtype(fmts, k_pool.dtype, q.dtype), block_sizes.num_stages, 96 * 1024)))
    Mp = pl.cdiv(M, ppb) * ppb
    bt = jnp.pad(block_tables, ((0, 0), (0, Mp - M)))
    qh = q.reshape(N, nKV, G, hd).transpose(1, 0, 2, 3)                              # [nKV, N, G, hd]
    qh = jnp.pad(qh, ((0, 0), (0, bq), (0, gp - G), (0, 0))).reshape(nKV, (N + bq) * gp, hd)
    tree = tree_lo is not None
    kernel = functools.partial(_kernel, block_q=bq, ppb=ppb, gp=gp, scale=scale * LOG2E, fmts=fmts, tree=tree)
    E = k_esc.shape[-1] if k_esc is not None else 0
    tree_specs, tree_args = [], []
    if tree:     # each query row's ancestor bits, as the tile lays its rows out (token * gp + head)
        anc_rows = jnp.repeat(jnp.pad(anc.astype(jnp.int32), (0, bq)), gp)                  # [(N + bq) * gp]
        tree_specs = [pl.BlockSpec((B,), lambda b, j, h: (0,)), pl.BlockSpec(((N + bq) * gp,), lambda b, j, h: (0,))]
        tree_args = [tree_lo.astype(jnp.int32), anc_rows]
    out = pl.pallas_call(
        kernel,
        grid=(B, pl.cdiv(N, bq), nKV),
        in_specs=[
            pl.BlockSpec((B + 1,), lambda b, j, h: (0,)),
            pl.BlockSpec((B,), lambda b, j, h: (0,)),
            pl.BlockSpec((None, Mp), lambda b, j, h: (b, 0)),
            pl.BlockSpec((None, (N + bq) * gp, hd), lambda b, j, h: (h, 0, 0)),
            *pool_specs(P, bs, hd, fmts, lambda b, j, h: h, E),
            *tree_specs,
        ],
        out_specs=pl.BlockSpec((None, parts, (N + bq) * gp, hd // parts), lambda b, j, h: (h, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nKV, parts, (N + bq) * gp, hd // parts), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(block_sizes.num_warps, block_sizes.num_stages),
        name="ragged_paged_attention",
    )(cu_q.astype(jnp.int32), kv_lens.astype(jnp.int32), bt, qh, k_pool, v_pool,
      *extra_operands(fmts, k_scale, v_scale, k_esc, v_esc), *tree_args)
    out = jnp.moveaxis(out.reshape(nKV, parts, N + bq, gp, hd // parts), 1, 3)      # halves side by side
    out = out.reshape(nKV, N + bq, gp, hd)[:, :N, :G].transpose(1, 0, 2, 3).reshape(N, nH, hd)
    valid = jnp.arange(N) < cu_q[B]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


__all__ = ["BlockSizes", "ragged_paged_attention", "ragged_paged_attention_reference"]
