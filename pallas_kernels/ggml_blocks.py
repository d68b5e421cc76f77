"""Decoding llama.cpp's (GGML) quantized blocks as infernix_jax/quant/ggml.py repacks them at load:
the one arithmetic used for a [rows, k] tile inside the fused matmul kernel (quant_matmul.py) and for
a whole matrix in the reference dequantization.

Every array is [rows, columns], each column standing for a fixed number of weights along K
(`LAYOUT`, in the order the arrays are passed):

| fmt    | arrays (weights per column)                                          | weight                        |
|--------|----------------------------------------------------------------------|-------------------------------|
| q8_0   | q int8 (1), d f16 (32)                                               | d * q                         |
| q4_0   | q nibbles (2), d f16 (32)                                            | d * (q - 8)                   |
| q4_1   | q nibbles (2), d f16 (32), m f16 (32)                                | d * q + m                     |
| q4_k   | q nibbles (2), sc u8 (32), mn u8 (32), d f16 (256), dmin f16 (256)   | (d * sc) * q - dmin * mn      |
| q6_k   | lo nibbles (2), hi 2-bit (4), sc int8 (16), d f16 (256)             | (d * sc) * (hi:lo - 32)       |
| iq4_xs | q nibbles (2), sc int8 (32, ggml's 6-bit scale - 32), d f16 (256)    | (d * sc) * IQ4NL[q]           |

(IQ4NL[q] is evaluated as a rounded quartic: a chain of 15 selects made the kernel 2x slower.)

Nibbles hold element 2j in byte j's low half, 2-bit codes element 4j + t in bits 2t. Every product
above is exact in f32 (at most 24 significant bits) and at most one addition rounds, so the result is
bit-identical to ggml's own dequantization (gguf-py's, checked by the tests) in any evaluation order."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LAYOUT = {
    "q8_0": (1, 32),
    "q4_0": (2, 32),
    "q4_1": (2, 32, 32),
    "q4_k": (2, 32, 32, 256, 256),
    "q6_k": (2, 4, 16, 256),
    "iq4_xs": (2, 32, 256),
}
# llama.cpp's IQ4_NL / IQ4_XS grid: the 16 values a 4-bit index stands for
IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def block(fmt: str) -> int:
    """Weights per ggml block: K must be a multiple of it."""
    return max(LAYOUT[fmt][1:])


def unpack_bits(b, bits: int):
    """[..., c] bytes -> [..., c * 8 / bits] codes, element (8 / bits) * j + t from bits t * bits.
    Split in halves (Triton's stack takes two operands): a byte's low and high nibble, then each
    nibble's low and high 2 bits."""
    width = 8
    while width > bits:
        width //= 2
        b = jnp.stack([b & ((1 << width) - 1), b >> width], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return b


def spread(s, n: int):
    """[rows, G] per-group values -> [rows, n] in f32 (each repeated over its n / G weights)."""
    rows, G = s.shape
    s = s.astype(jnp.float32)
    return jnp.broadcast_to(s[:, :, None], (rows, G, n // G)).reshape(rows, n)


# IQ4NL as a quartic in the index, rounded: every grid value exactly (max error 0.48 before the
# rounding; the tests check all 16), four FMAs instead of a table (Triton has no gather)
IQ4NL_POLY = tuple(float(c) for c in np.polyfit(np.arange(16.0), np.asarray(IQ4NL, np.float64), 4))


def iq4nl(q):
    """4-bit indices -> IQ4NL values in f32."""
    q = q.astype(jnp.float32)
    v = jnp.full_like(q, IQ4NL_POLY[0])
    for c in IQ4NL_POLY[1:]:
        v = v * q + c
    return jnp.floor(v + 0.5)


def decode(fmt: str, arrays, n: int):
    """The f32 weights [rows, n] that `arrays` (each covering the same n weights along K) stand for."""
    a = arrays
    if fmt == "q8_0":
        return a[0].astype(jnp.float32) * spread(a[1], n)
    q = unpack_bits(a[0], 4).astype(jnp.float32)
    if fmt == "q4_0":
        return spread(a[1], n) * (q - 8.0)
    if fmt == "q4_1":
        return spread(a[1], n) * q + spread(a[2], n)
    if fmt == "q4_k":
        return (spread(a[3], n) * spread(a[1], n)) * q - spread(a[4], n) * spread(a[2], n)
    if fmt == "iq4_xs":
        return (spread(a[2], n) * spread(a[1], n)) * iq4nl(q)
    if fmt == "q6_k":
        q = q + 16.0 * unpack_bits(a[1], 2).astype(jnp.float32)
        return (spread(a[3], n) * spread(a[2], n)) * (q - 32.0)
    raise ValueError(f"unknown ggml format {fmt!r}")
