"""A GGUF file's header read in one pass: the key/values as Python values and the tensors as views
of a memory map. The `gguf` package's GGUFReader makes a numpy view of every element of every
metadata array (a 150K-entry vocabulary: ~3 s before anything else can start); this reads the same
bytes with struct and gives the same values and the same tensor arrays (tests/test_gguf.py checks
both against GGUFReader). Dequantizing stays with the `gguf` package."""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one scalar (8: string, 9: array are read apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# ggml types stored as plain numbers (the others are quantized blocks, viewed as bytes)
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray            # GGUF's dims, innermost first (as GGUFReader's ReaderTensor.shape)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray             # rows first: plain types as numbers, quantized ones as [..., bytes per row]


class Header:
    """fields: key -> value (strings, numbers, lists); tensors: in file order."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(path, "rb") as f:
            buf = f.read(1 << 20)
            self._buf, self._file = buf, f
            self._pos = self._base = 0          # in buf; the file offset of buf[0]
            if self._take(4) != MAGIC:
                raise ValueError("bad GGUF magic")
            (version,) = self._unpack("<I")
            if version not in VERSIONS:
                raise ValueError(f"GGUF version {version} (this reader knows {VERSIONS})")
            n_tensors, n_kv = self._unpack("<QQ")
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._str()
                (vtype,) = self._unpack("<I")
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._str()
                (n_dims,) = self._unpack("<I")
                dims = self._unpack(f"<{n_dims}Q")
                ttype, offset = self._unpack("<IQ")
                infos.append((name, dims, ttype, offset))
            end = self._base + self._pos
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align!r}")
        start = end + (-end % align)
        self._buf = self._file = None
        mm = np.memmap(path, mode="r").view(np.ndarray)     # (views of a plain array: memmap's own are slow)
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name} appears twice")
            seen.add(name)
            gt = GGMLQuantizationType(ttype)
            n = int(np.prod(dims))
            block, size = GGML_QUANT_SIZES[gt]
            n_bytes = n * size // block
            np_dims = tuple(reversed(dims))
            at = start + offset
            if at + n_bytes > mm.size:
                raise ValueError(f"tensor {name} ends past the end of the file (truncated)")
            raw = mm[at:at + n_bytes]
            if gt in _PLAIN:
                data = raw.view(_PLAIN[gt]).reshape(np_dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(np_dims, gt))
            self.tensors.append(Tensor(name, gt, np.asarray(dims, np.uint64), n, n_bytes, at, data))

    # ---- reading the header (buffered: the file is read in 1 MiB pieces as the parse goes) ---------
    def _take(self, n: int) -> bytes:
        while self._pos + n > len(self._buf):
            more = self._file.read(max(1 << 20, n))
            if not more:
                raise ValueError("the header ends past the end of the file (truncated)")
            self._base += self._pos
            self._buf = self._buf[self._pos:] + more
            self._pos = 0
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))

    def _str(self) -> str:
        (n,) = self._unpack("<Q")
        return self._take(n).decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._str()
        if vtype in _SCALAR:
            return self._unpack("<" + _SCALAR[vtype])[0]
        if vtype != 9:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, n = self._unpack("<IQ")
        if etype == 8:
            return [self._str() for _ in range(n)]
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
            return np.frombuffer(self._take(n * dt.itemsize), dt).tolist()
        return [self._value(etype) for _ in range(n)]      # arrays of arrays
