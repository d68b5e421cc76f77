"""GGUF files' quantized blocks kept quantized on the device (`--weights gguf`).

A GGUF projection stored as Q8_0, Q4_0, Q4_1, Q4_K, Q6_K or IQ4_XS is repacked at load, without
changing a single value, into the column arrays pallas_kernels/ggml_blocks.py describes: codes
unpacked from ggml's per-block order into plain element order (two 4-bit codes per byte, Q6_K's top
two bits four per byte) and the scales pulled out of the blocks into arrays of their own, so that the
fused matmul kernel reads any [rows, k] tile with plain slices. The repacked matrix takes the same
bytes as the file's blocks, give or take the 6-bit scales unpacked to bytes (Q4_K 4.625 bits a weight
instead of 4.5, IQ4_XS 4.31 instead of 4.25). It is a QTensor: data and scale are its first two arrays,
`more` the rest. Other tensor types are dequantized at load as before."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pallas_kernels.ggml_blocks import LAYOUT, block

from .. import choices
from .formats import QTensor

GGML_FORMATS = tuple(LAYOUT)
assert GGML_FORMATS == choices.GGML_FORMATS, "choices.GGML_FORMATS is what the command lines offer"
# bytes of one ggml block, per type
_BYTES = {f: GGML_QUANT_SIZES[GGMLQuantizationType[f.upper()]][1] for f in GGML_FORMATS}


def _f16(b):
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs, half: int):
    """ggml's nibble runs [..., nb, c * half] -> codes [..., nb, 2 * c * half]: each run of `half`
    bytes holds elements [0, half) in its low nibbles and [half, 2 * half) in its high ones."""
    r = qs.reshape(*qs.shape[:-1], -1, 1, half) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (r & 0x0F).reshape(*qs.shape[:-1], -1)


def _pack(codes, bits: int):
    """codes [O, n] (< 2**bits) -> [O, n * bits / 8] bytes, element (8 / bits) * j + t in bits t * bits."""
    per = 8 // bits
    c = codes.reshape(codes.shape[0], -1, per).astype(np.uint8)
    out = np.zeros(c.shape[:-1], np.uint8)
    for t in range(per):
        out |= c[..., t] << (bits * t)
    return out


def _k_scales(s):
    """Q4_K's 12 scale bytes [O, nb, 12] -> (sc, mn) [O, nb, 8] 6-bit values (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _arrays(fmt: str, b) -> tuple:
    """ggml blocks [O, nb, bytes] -> the kernel's arrays (LAYOUT order), all [O, columns]."""
    O = b.shape[0]
    flat = lambda a: np.ascontiguousarray(a).reshape(O, -1)
    if fmt == "q8_0":
        return flat(b[..., 2:].view(np.int8)), flat(_f16(b[..., :2]))
    if fmt in ("q4_0", "q4_1"):
        off = 2 if fmt == "q4_0" else 4
        q = _pack(flat(_nibbles(b[..., off:], 16)), 4)
        return (q, flat(_f16(b[..., :2]))) + ((flat(_f16(b[..., 2:4])),) if fmt == "q4_1" else ())
    if fmt == "q4_k":
        sc, mn = _k_scales(b[..., 4:16])
        q = _pack(flat(_nibbles(b[..., 16:], 32)), 4)
        return q, flat(sc), flat(mn), flat(_f16(b[..., 0:2])), flat(_f16(b[..., 2:4]))
    if fmt == "q6_k":
        lo = _nibbles(b[..., :128], 64)                                   # [O, nb, 256]
        qh = b[..., 128:192].reshape(O, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        hi = (qh & 3).reshape(O, b.shape[1], 256)                         # element 128h + 32t + byte
        return (_pack(flat(lo), 4), _pack(flat(hi), 2), flat(b[..., 192:208].view(np.int8)),
                flat(_f16(b[..., 208:210])))
    if fmt == "iq4_xs":
        sh = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)            # [O, nb, 1]
        sl = b[..., 4:8]
        ib = np.arange(8)
        low = (sl[..., ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
        high = ((sh >> (2 * ib).astype(np.uint16)) & 3).astype(np.uint8)
        sc = (low | (high << 4)).astype(np.int16) - 32                   # [O, nb, 8] in [-32, 31]
        q = _pack(flat(_nibbles(b[..., 8:], 16)), 4)
        return q, flat(sc.astype(np.int8)), flat(_f16(b[..., :2]))
    raise ValueError(f"unknown ggml format {fmt!r}")


def from_blocks(fmt: str, raw: np.ndarray, shape: tuple) -> QTensor:
    """A GGUF tensor's raw bytes [..., O, bytes per row] (gguf's reader layout) of type fmt -> a
    QTensor of the [..., O, I] matrix (or stack of them: MoE experts) they hold, with numpy arrays
    (the caller moves them to the device)."""
    *lead, O, I = shape
    bs = block(fmt)
    if I % bs or raw.shape != (*lead, O, I // bs * _BYTES[fmt]):
        raise ValueError(f"{fmt} blocks of {tuple(raw.shape)} bytes do not hold a {' x '.join(map(str, shape))} matrix")
    rows = int(np.prod(lead, dtype=np.int64)) * O
    data, scale, *more = (a.reshape(*lead, O, a.shape[-1])
                          for a in _arrays(fmt, raw.reshape(rows, I // bs, _BYTES[fmt])))
    return QTensor(data, scale, None, None, fmt, tuple(shape), more=tuple(more))


# the f16 scale fields of a block (byte offsets) and a scale that gives weights of about 0.05
_SCALES = {"q8_0": ([0], 4e-4), "q4_0": ([0], 6e-3), "q4_1": ([0, 2], 6e-3), "q4_k": ([0, 2], 5e-5),
           "q6_k": ([208], 1e-5), "iq4_xs": ([0], 1e-5)}


def random_blocks(rng: np.random.Generator, fmt: str, rows: int, cols: int) -> np.ndarray:
    """Random blocks of type fmt holding a [rows, cols] matrix, as raw bytes [rows, bytes per row]
    (for tests and benchmarks: gguf-py cannot quantize to the K and IQ types). Codes and sub-block
    scales are random bytes; the f16 scales are small and finite, so the matrix looks like weights."""
    raw = rng.integers(0, 256, (rows, cols // block(fmt), _BYTES[fmt]), dtype=np.uint8)
    offsets, scale = _SCALES[fmt]
    for off in offsets:
        d = (np.abs(rng.normal(size=raw.shape[:2])) * scale).astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
