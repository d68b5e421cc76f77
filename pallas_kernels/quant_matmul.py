"""Matmul with the weight's dequantization fused, in Pallas (lowered through Triton; `interpret=True`
runs it on the CPU for tests): y [M, N] = x [M, K] @ W [N, K]^T where W is stored quantized in
the checkpoints' [out, in] layout (infernix_jax/quant/formats.py describes the formats). Its
reference: quant_reference.quant_matmul_reference.

Grid (M / bm, N / bn, split): each program owns a [bm, bn] output tile and walks its share of K in
steps of bk: it loads the quantized [bn, bk] weight tile (1 or 1/2 byte per weight: this is what
decode's speed is bound by), dequantizes it in registers to x's dtype and feeds one tensor-core
dot. Decode has few rows, so N / bn tiles alone would leave most SMs idle: K is split as well
(`split`), and the f32 partial sums are added afterwards. Per-channel scales (int8, fp8) multiply
the accumulator once at the end instead of every weight.

The arrays the kernel takes are the QTensor's own (no repacking per call); `kernel_args` names
them per format:
  int8, fp8   data [N, K] 8-bit, scale [N, 1] f32
  fp8b        data [N, K] e4m3, scale [N/128, K/128] f32 (one per 128 x 128 tile)
  mxfp8       data [N, K] e4m3, scale [N, K/32] e8m0 (read as its exponent byte)
  int4        data [N, K/2] bytes (element 2j in the low nibble), scale [N, K/128] f32,
              zero [N, K/128] uint8
  nvfp4       data [N, K/2] e2m1 codes, scale [N, K/16] e4m3, tensor scale [1] f32
  GGUF blocks (q8_0, q4_0, q4_1, q4_k, q6_k, iq4_xs): the arrays ggml_blocks.LAYOUT lists, each
              [N, K / weights per column]; a tile of each is decoded by ggml_blocks.decode
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import ggml_blocks
from .common import triton_params
from .ggml_blocks import spread, unpack_bits
from .quant_reference import GROUP, kernel_args, quant_matmul_reference

PACKED = ("int4", "nvfp4")        # two weights per byte


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    bm: int = 16          # rows of x per program (a smaller batch is masked to its rows)
    bn: int = 64          # output columns per program
    bk: int = 256         # weights along K per inner step
    split: int = 0        # programs along K; 0: enough to give ~2 programs per SM
    num_warps: int = 4
    num_stages: int = 3


class Tiles(NamedTuple):
    most_rows: int | None          # the row counts this entry is for (None: any number)
    formats: tuple                 # the formats it is for (empty: any)
    sizes: BlockSizes
    source: str                    # where the numbers come from


# Default tiles by rows of x, the first entry that fits winning: decode (few rows: bound by the
# weight bytes; a small tile and a K split keep every SM loading), a small batch, many rows (compute
# bound: large tiles; infernix_jax's linear hands those to XLA instead).
TILES = (
    Tiles(16, ("nvfp4",), BlockSizes(bm=16, bn=32, bk=256, split=4),
          "H200, experiments/tune_decode_qmm.py: decoding e2m1 in registers is bound by ALU, not bytes; "
          "32 columns and split 4 were 12% faster in the decode step than the entry below"),
    Tiles(16, (), BlockSizes(bm=16, bn=64, bk=256, split=0),
          "H200, experiments/tune_decode_qmm.py: fp8 kernel time inside a qwen3-8b decode step (q/k/v and "
          "gate/up fused); 64 columns and a K split sized to ~2 programs per SM (2 for qkv, 1 for gate/up, "
          "4 for down) 8% under the best fixed split, 4"),
    Tiles(128, (), BlockSizes(bm=64, bn=64, bk=128),
          "H200, `infernix-bench qmatmul --tune` (docs/benchmarks.md): least total time over int8, mxfp8, "
          "int4 and nvfp4 on qwen3-8b's up projection"),
    Tiles(None, (), BlockSizes(bm=256, bn=128, bk=64, split=1, num_warps=8),
          "H200, the same --tune sweep at prefill rows"),
)


def for_rows(m: int, fmt: str = "") -> BlockSizes:
    """The default tiles for m rows of x and a weight of format fmt (TILES)."""
    return next(t.sizes for t in TILES
                if (t.most_rows is None or m <= t.most_rows) and (not t.formats or fmt in t.formats))


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n (0 if none >= 16: the tensor cores' minimum)."""
    d = 1 << max(0, cap.bit_length() - 1)
    while d >= 16 and n % d:
        d //= 2
    return d if d >= 16 else 0


def unsupported(fmt: str, shape: tuple, x_dtype) -> str | None:
    """Why the kernel cannot take this weight (None if it can): the reference route is used then."""
    if fmt not in GROUP and fmt not in ggml_blocks.LAYOUT:
        return f"format {fmt!r}"
    if len(shape) != 2:
        return f"weight rank {len(shape)} (stacked experts go through the grouped expert kernel)"
    return matrix_unsupported(fmt, shape, x_dtype)


def matrix_unsupported(fmt: str, shape: tuple, x_dtype) -> str | None:
    """Why a [N, K] matrix of format fmt ("" for a plain one) cannot be tiled by these kernels."""
    N, K = shape
    if not _pow2_divisor(N, 16) or not _pow2_divisor(K, 32):
        return f"shape {shape}: N must be a multiple of 16 and K of 32"
    if fmt in ggml_blocks.LAYOUT and K % ggml_blocks.block(fmt):
        return f"shape {shape}: {fmt} blocks need K a multiple of {ggml_blocks.block(fmt)}"
    if jnp.dtype(x_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"activations in {jnp.dtype(x_dtype)}"
    if fmt in E4M3 and _gpu_capability() < (8, 9):
        return "e4m3 needs an Ada or Hopper GPU (compute capability 8.9+)"
    return None


E4M3 = ("fp8", "fp8b", "mxfp8", "nvfp4")        # formats holding e4m3 values or scales


@functools.lru_cache(maxsize=None)
def _gpu_capability() -> tuple[int, int]:
    """The default GPU's compute capability; (99, 0) where there is none (interpret mode on the CPU
    decodes e4m3 anywhere)."""
    try:
        d = jax.devices()[0]
        cc = getattr(d, "compute_capability", None) if d.platform == "gpu" else None
        return tuple(int(x) for x in str(cc).split(".")[:2]) if cc else (99, 0)
    except (RuntimeError, ValueError):
        return (99, 0)


def _e2m1(c):
    """4-bit e2m1 codes (sign << 3 | exponent << 1 | mantissa) -> f32, built as f32 bits: a normal
    code is 2^(e-1) * (1 + m/2), the one subnormal (e = 0, m = 1) is 0.5."""
    c = c.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    bits = jnp.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23)) | ((c >> 3) << 31)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _pow2(u):
    """e8m0 exponent bytes -> 2^(u - 127) in f32 (u = 0, 2^-127, reads as 0: no real scale is that small)."""
    return jax.lax.bitcast_convert_type(u.astype(jnp.uint32) << 23, jnp.float32)


def weight_tile(fmt: str, load, k: int, bk: int, bn: int, dtype, tensor_scale=None):
    """The weight tile [bn, bk] whose first weight along K is k, in dtype (int8 / fp8: the codes;
    their per-channel scale multiplies the accumulator instead). load(j, c0, width) -> the tile's
    rows of array j (kernel_args' order: data, scale, more) at columns [c0, c0 + width); fp8b's
    scale: its one row. nvfp4's tensor scale comes as a value. Shared by quant_matmul and the
    grouped expert kernel (grouped_matmul.py), which differ only in where the rows are."""
    if not fmt:                                              # a plain matrix
        return load(0, k, bk).astype(dtype)
    if fmt in ggml_blocks.LAYOUT:                            # each array's columns for this step
        tiles = [load(j, k // w, max(1, bk // w)) for j, w in enumerate(ggml_blocks.LAYOUT[fmt])]
        return ggml_blocks.decode(fmt, tiles, bk).astype(dtype)
    g = GROUP[fmt]
    per = bk // 2 if fmt in PACKED else bk                   # stored elements per step along K
    d = load(0, k // bk * per, per)
    if fmt == "int8":
        return d.astype(dtype)
    if fmt == "fp8":         # through f32: 13% less kernel time in a decode step than e4m3 -> bf16
        return d.astype(jnp.float32).astype(dtype)           # (experiments/qmm_convert_variants.py)
    G = max(1, bk // g)                                      # scale columns per step
    s = load(1, k // g, G)                                   # [bn or 1, G]
    if fmt == "fp8b":                                        # one row of scales for the whole tile
        w = d.astype(jnp.float32) * spread(jnp.broadcast_to(s, (bn, G)), bk)
    elif fmt == "mxfp8":
        w = d.astype(jnp.float32) * spread(_pow2(s), bk)     # e8m0: the exponent byte
    elif fmt == "int4":
        z = load(2, k // g, G).astype(jnp.float32)
        w = (unpack_bits(d, 4).astype(jnp.float32) - spread(z, bk)) * spread(s, bk)
    else:                                                    # nvfp4
        w = _e2m1(unpack_bits(d, 4)) * spread(s.astype(jnp.float32) * tensor_scale, bk)
    return w.astype(dtype)


def tiling(fmt: str, N: int, K: int, bs: BlockSizes, row_tiles: int) -> tuple[int, int, int, int]:
    """-> (bn, bk, split, steps): output columns per program, weights along K per inner step,
    programs along K (bs.split, or 0: enough for ~2 programs per SM over row_tiles x N / bn output
    tiles, dividing the K steps) and inner steps per program. Shared with grouped_matmul.py."""
    bn = _pow2_divisor(N, min(bs.bn, 128) if fmt == "fp8b" else bs.bn)
    bk = _pow2_divisor(K, max(bs.bk, 32))                    # >= 16 bytes of packed weights per step
    k_steps = K // bk
    split = bs.split or max(1, min(k_steps, 264 // max(row_tiles * (N // bn), 1)))
    while k_steps % split:
        split -= 1
    return bn, bk, split, k_steps // split


def sum_splits(out, dtype):
    """The kernels' output [split, rows, N] (f32 partial sums when split > 1) -> [rows, N] in dtype."""
    return out[0] if out.shape[0] == 1 else out.sum(axis=0).astype(dtype)


def _kernel(*refs, fmt: str, bk: int, bn: int, steps: int, precision, rows: int):
    x_ref, *w_refs, o_ref = refs
    # x_ref [bm, K]; w_refs[0] [bn, K or K/2] this program's weight rows, then the scales (see the
    # module doc: rows of this tile, or the row-block's for fp8b); o_ref [bm, bn]. The last row
    # block may overhang x's `rows` rows (decode's few): its loads and stores are masked to them.
    split = pl.program_id(2)
    bm = x_ref.shape[0]
    ragged = rows % bm != 0
    live = (pl.program_id(0) * bm + jnp.arange(bm) < rows)[:, None]          # [bm, 1]
    tscale = w_refs[2][0] if fmt == "nvfp4" else None

    def body(i, acc):
        k = (split * steps + i) * bk                         # first weight of this step
        x = plt.load(x_ref.at[:, pl.ds(k, bk)], mask=live, other=0) if ragged else x_ref[:, pl.ds(k, bk)]
        w = weight_tile(fmt, lambda j, c0, n: w_refs[j][:, pl.ds(c0, n)], k, bk, bn, x.dtype, tscale)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    if fmt in ("int8", "fp8"):
        acc = acc * w_refs[1][...].reshape(1, bn)
    if ragged:
        plt.store(o_ref, acc.astype(o_ref.dtype), mask=live)
    else:
        o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "shape", "block_sizes", "interpret"))
def quant_matmul(x, args: tuple, fmt: str, shape: tuple, block_sizes: BlockSizes | None = None,
                 interpret: bool = False):
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype, W of `shape` (N, K) given as kernel_args(W).
    f32 activations are multiplied exactly (no TF32): that is the lossless route's arithmetic."""
    why = unsupported(fmt, shape, x.dtype)
    if why:
        raise ValueError(f"quant_matmul cannot take this weight: {why}")
    M, K = x.shape
    N = shape[0]
    if K != shape[1]:
        raise ValueError(f"x has K={K}, the weight {shape}")
    bs = block_sizes or for_rows(M, fmt)
    g = GROUP.get(fmt, 0)
    bm = max(16, min(bs.bm, 1 << max(0, (M - 1).bit_length())))
    row_blocks = pl.cdiv(M, bm)                                # the last may overhang M (masked)
    bn, bk, split, steps = tiling(fmt, N, K, bs, row_blocks)
    d, s, *rest = args
    by_row = (lambda cols: pl.BlockSpec((bn, cols), lambda m, n, k: (n, 0)))     # this tile's rows, all columns
    in_specs = [pl.BlockSpec((bm, K), lambda m, n, k: (m, 0)),
                pl.BlockSpec((bn, d.shape[1]), lambda m, n, k: (n, 0))]
    if fmt in ggml_blocks.LAYOUT:                            # every array: this tile's rows
        in_specs += [by_row(a.shape[1]) for a in (s, *rest)]
    elif g == 0:                                             # a scale per output channel
        in_specs.append(by_row(1))
    elif fmt == "fp8b":                                      # one scale row per 128 output rows
        in_specs.append(pl.BlockSpec((1, s.shape[1]), lambda m, n, k: (n * bn // 128, 0)))
    else:
        in_specs.append(by_row(s.shape[1]))
    if fmt == "int4":
        in_specs.append(by_row(rest[0].shape[1]))
    elif fmt == "nvfp4":
        in_specs.append(pl.BlockSpec((1,), lambda m, n, k: (0,)))
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out_dtype = x.dtype if split == 1 else jnp.float32
    kernel = functools.partial(_kernel, fmt=fmt, bk=bk, bn=bn, steps=steps, precision=precision, rows=M)
    out = pl.pallas_call(
        kernel,
        grid=(row_blocks, N // bn, split),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bm, bn), lambda m, n, k: (k, m, n)),
        out_shape=jax.ShapeDtypeStruct((split, M, N), out_dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(bs.num_warps, bs.num_stages),
        name=f"quant_matmul_{fmt}",
    )(x, d, s, *rest)
    return sum_splits(out, x.dtype)


__all__ = ["BlockSizes", "GROUP", "TILES", "Tiles", "for_rows", "kernel_args", "matrix_unsupported", "quant_matmul",
           "quant_matmul_reference", "sum_splits", "tiling", "unsupported", "weight_tile"]
