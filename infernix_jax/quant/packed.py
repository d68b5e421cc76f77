"""Lossless 12-bit packing of BF16 weights (`--weights bf16p`).

A BF16 weight is sign (1 bit), exponent (8) and mantissa (7). A weight matrix uses few exponents:
its values span a few binades below its largest, and almost nothing lies 2^-14 below it. So each
weight keeps its sign and mantissa in one byte and its exponent as a 4-bit code into a window of 15
consecutive exponents (the window that covers the most of this matrix's weights); code 15 marks an
escape, whose value is stored apart (flat index and BF16 value). 12 bits a weight plus 6 bytes an
escape, and the matrix comes back bit for bit: multiplying by it gives the same output as the plain
BF16 matrix, because it is the plain BF16 matrix by the time the matmul sees it.

The unpacking runs on the device before each product (XLA fuses the bit operations); the memory is
saved, not time."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.ggml_blocks import unpack_bits
from pallas_kernels.quant_reference import pack4, pad_even

WINDOW = 15          # exponents a code can name; code 15 is the escape
ESCAPE = 15


@struct.dataclass
class Packed12:
    """lo [..., O, I] uint8: sign << 7 | mantissa; codes [..., O, ceil(I/2)] uint8: two 4-bit
    exponent codes (element 2j in the low nibble); base: int32, the exponent of code 0 (a scalar,
    or [O, 1] for a matrix fused from parts with windows of their own: models/fuse.py);
    esc_idx [E] int32: flat indices of the escapes; esc_val [E] bfloat16: their values."""
    lo: jax.Array
    codes: jax.Array
    base: jax.Array
    esc_idx: jax.Array
    esc_val: jax.Array
    shape: tuple = struct.field(pytree_node=False)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize
                   for a in (self.lo, self.codes, self.base, self.esc_idx, self.esc_val))


def pack(w) -> Packed12:
    """A BF16 matrix (any leading axes) -> Packed12. Runs on the host (numpy): the number of
    escapes is the matrix's own."""
    w = np.asarray(w)
    if w.dtype != jnp.bfloat16:
        raise ValueError(f"bf16p packs bfloat16 weights, not {w.dtype}: load the model with --dtype bfloat16")
    bits = w.view(np.uint16)
    e = ((bits >> 7) & 0xFF).astype(np.int32)
    hist = np.bincount(e.ravel(), minlength=256 + WINDOW)
    covered = np.convolve(hist, np.ones(WINDOW, np.int64), mode="valid")[:256]   # window starting at b
    base = int(np.argmax(covered))
    code = e - base
    esc = (code < 0) | (code >= WINDOW)
    code = np.where(esc, ESCAPE, code).astype(np.uint8)
    lo = (((bits >> 15) << 7) | (bits & 0x7F)).astype(np.uint8)
    idx = np.flatnonzero(esc).astype(np.int32)
    return Packed12(jnp.asarray(lo), pack4(pad_even(jnp.asarray(code))), jnp.asarray(base, jnp.int32),
                    jnp.asarray(idx), jnp.asarray(w.reshape(-1)[idx]), tuple(w.shape))


def unpack(p: Packed12):
    """Packed12 -> the BF16 matrix, bit for bit (jittable)."""
    code = unpack_bits(p.codes, 4)[..., :p.shape[-1]]
    e = (p.base + code.astype(jnp.int32)).astype(jnp.uint16) & 0xFF
    lo = p.lo.astype(jnp.uint16)
    bits = ((lo >> 7) << 15) | (e << 7) | (lo & 0x7F)
    w = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    if p.esc_idx.shape[0]:
        w = w.reshape(-1).at[p.esc_idx].set(p.esc_val).reshape(p.shape)
    return w


def report(params: dict) -> tuple[int, int, int]:
    """(bytes as BF16, bytes packed, escapes) over a model's packed matrices."""
    plain = packed = esc = 0
    for p in params["layers"]:
        for v in p.values():
            if isinstance(v, Packed12):
                plain += int(np.prod(v.shape)) * 2
                packed += v.nbytes
                esc += int(v.esc_idx.shape[0])
    return plain, packed, esc


__all__ = ["Packed12", "pack", "report", "unpack"]
