"""Grouped expert matmul for mixture-of-experts layers, in Pallas (Triton backend; `interpret=True`
on the CPU): each (token, expert) pair's row times its own expert's matrix, the experts' weights
plain or quantized (every format quant_matmul takes), dequantized inside the kernel.

The pairs are laid out sorted by expert, each expert's run padded to whole tiles of bm rows
(`align`), so that every row tile belongs to one expert: grid (row tiles, N / bn, K splits), each
program reads its tile's expert id, gathers its bm input rows, and streams that expert's [bn, K]
weight rows through the same tile decoding as quant_matmul (`weight_tile`). A prefill step thus
reads each chosen expert's weights once per tile of its tokens and computes only the chosen
pairs, where the dense fallback runs every expert on every token (E / k times the FLOPs); decode
reads only the chosen experts' bytes, with no dequantized copy in memory.

Padding rows (row index >= the input's rows) read zeros and give zero rows; tiles past the last
expert's (tile expert -1) write zeros."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import triton_params
from .quant_matmul import BlockSizes, Tiles, matrix_unsupported, sum_splits, tiling, weight_tile
from .quant_matmul import unsupported as qmm_unsupported


@functools.partial(jax.jit, static_argnames=("num_experts", "bm"))
def align(expert_ids, num_experts: int, bm: int):
    """expert_ids [P] int32 (each pair's expert) -> (order [R] int32: the pair in each padded row,
    P for padding; tile_expert [R / bm] int32, -1 past the used tiles; where [P]: each pair's row).
    R = bm * (cdiv(P, bm) + min(E, P)): enough for any routing (each used expert wastes < bm rows)."""
    P = expert_ids.shape[0]
    tiles = pl.cdiv(P, bm) + min(num_experts, P)
    R = tiles * bm
    counts = jnp.bincount(expert_ids, length=num_experts)                      # [E]
    padded = (counts + bm - 1) // bm * bm
    start = jnp.cumsum(padded) - padded                                        # [E] first row of each
    by_expert = jnp.argsort(expert_ids, stable=True)                           # pairs sorted by expert
    first = jnp.cumsum(counts) - counts
    rank = jnp.arange(P) - first[expert_ids[by_expert]]                        # place within its expert
    rows = start[expert_ids[by_expert]] + rank                                 # [P] padded row of each
    order = jnp.full((R,), P, jnp.int32).at[rows].set(by_expert.astype(jnp.int32))
    where = jnp.zeros((P,), jnp.int32).at[by_expert].set(rows.astype(jnp.int32))
    tile_start = jnp.arange(tiles) * bm
    ends = jnp.cumsum(padded)                                                  # [E]
    te = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)    # the expert owning each tile
    return order, jnp.where(tile_start < ends[-1], te, -1), where


@jax.jit
def grouped_matmul_reference(x, rows, tile_expert, w):
    """x [T, K]; rows [R] (x's row for each output row, >= T: padding); tile_expert [R / bm];
    w [E, N, K] (already dequantized) -> [R, N] in x's dtype, f32 accumulation."""
    R = rows.shape[0]
    bm = R // tile_expert.shape[0]
    e = jnp.repeat(tile_expert, bm)                                            # [R]
    valid = (rows < x.shape[0]) & (e >= 0)
    xr = jnp.where(valid[:, None], x[jnp.minimum(rows, x.shape[0] - 1)], 0).astype(jnp.float32)
    wr = w[jnp.maximum(e, 0)].astype(jnp.float32)                              # [R, N, K]
    y = jnp.einsum("rk,rnk->rn", xr, wr, precision="highest")
    return jnp.where(valid[:, None], y, 0).astype(x.dtype)


def _kernel(rows_ref, te_ref, x_ref, *refs, fmt: str, bk: int, bn: int, steps: int, precision):
    # rows_ref [bm] this tile's input rows; te_ref [tiles]; x_ref [T, K] all input rows;
    # refs: the experts' arrays [E, N, ...] whole (kernel_args' order), then o_ref [bm, bn]
    *w_refs, o_ref = refs
    t, n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = te_ref[t]
    T = x_ref.shape[0]
    rows = rows_ref[...]
    live = rows < T
    safe = jnp.where(live, rows, 0)
    n0 = n * bn
    tscale = w_refs[2][0] if fmt == "nvfp4" else None                        # one for the whole stack

    def load(j, c0, width):                 # this expert's rows of array j (fp8b's scale: one row)
        if fmt == "fp8b" and j == 1:
            return w_refs[1][e, pl.ds(n0 // 128, 1), pl.ds(c0, width)]
        return w_refs[j][e, pl.ds(n0, bn), pl.ds(c0, width)]

    def body(i, acc):
        k = (split * steps + i) * bk
        x = jnp.where(live[:, None], x_ref[safe, pl.ds(k, bk)], 0)                # [bm, bk] gathered rows
        w = weight_tile(fmt, load, k, bk, bn, x.dtype, tscale)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

    @pl.when(e >= 0)
    def _():
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
        if fmt in ("int8", "fp8"):
            acc = acc * w_refs[1][e, pl.ds(n0, bn), :].reshape(1, bn)
        o_ref[...] = jnp.where(live[:, None], acc, 0).astype(o_ref.dtype)

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


# tiles by rows per expert tile, the first entry that fits winning (quant_matmul.Tiles)
TILES = (
    Tiles(16, (), BlockSizes(bm=16, bn=32, bk=256, split=0),
          "not swept: the quantized matmul's decode tiles at 32 columns (quant_matmul.TILES); timed at "
          "1 and 8 tokens on an H200 (docs/benchmarks.md, grouped expert kernel)"),
    Tiles(None, (), BlockSizes(bm=64, bn=128, bk=64, split=1, num_warps=4),
          "not swept: compute-bound tiles of 64 rows (each expert is padded to whole tiles, so smaller "
          "tiles than the dense matmul's 256 waste less); the sweep past 8 tokens is still to do"),
)


def for_rows(m: int) -> BlockSizes:
    """The default tiles for m rows per expert tile (TILES)."""
    return next(t.sizes for t in TILES if t.most_rows is None or m <= t.most_rows)


def unsupported(fmt: str, shape: tuple, x_dtype) -> str | None:
    """Why the kernel cannot take experts of this format and shape (E, N, K) (None if it can)."""
    if len(shape) != 3:
        return f"expert stack of rank {len(shape)}"
    return qmm_unsupported(fmt, shape[1:], x_dtype) if fmt else matrix_unsupported("", shape[1:], x_dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "shape", "bm", "block_sizes", "interpret"))
def grouped_matmul(x, rows, tile_expert, args: tuple, fmt: str, shape: tuple, bm: int,
                   block_sizes: BlockSizes | None = None, interpret: bool = False):
    """x [T, K]; rows [R] int32 (x's row for each output row, >= T: padding; R = tiles * bm);
    tile_expert [tiles] int32 (-1: unused); args: the experts' arrays [E, ...] (kernel_args of a
    stacked QTensor, or (w,) for plain w [E, N, K]); fmt "" for plain; shape (E, N, K) ->
    [R, N] in x's dtype. f32 inputs are multiplied exactly (no TF32)."""
    E, N, K = shape
    if x.shape[1] != K or rows.shape[0] != tile_expert.shape[0] * bm:
        raise ValueError(f"x {x.shape} / rows {rows.shape} / tiles {tile_expert.shape} do not match {shape}, bm {bm}")
    why = unsupported(fmt, shape, x.dtype)
    if why:
        raise ValueError(f"grouped_matmul cannot take these experts: {why}")
    bs = block_sizes or for_rows(bm)
    tiles = tile_expert.shape[0]
    bn, bk, split, steps = tiling(fmt, N, K, bs, tiles)
    whole = [pl.BlockSpec(a.shape, lambda t, n, k, r=a.ndim: (0,) * r) for a in args]
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out_dtype = x.dtype if split == 1 else jnp.float32
    kernel = functools.partial(_kernel, fmt=fmt, bk=bk, bn=bn, steps=steps, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(tiles, N // bn, split),
        in_specs=[pl.BlockSpec((bm,), lambda t, n, k: (t,)),
                  pl.BlockSpec((tiles,), lambda t, n, k: (0,)),
                  pl.BlockSpec(x.shape, lambda t, n, k: (0, 0)),
                  *whole],
        out_specs=pl.BlockSpec((None, bm, bn), lambda t, n, k: (k, t, n)),
        out_shape=jax.ShapeDtypeStruct((split, rows.shape[0], N), out_dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(bs.num_warps, bs.num_stages),
        name=f"grouped_matmul_{fmt or 'plain'}",
    )(rows.astype(jnp.int32), tile_expert.astype(jnp.int32), x, *args)
    return sum_splits(out, x.dtype)


__all__ = ["TILES", "align", "for_rows", "grouped_matmul", "grouped_matmul_reference", "unsupported"]
