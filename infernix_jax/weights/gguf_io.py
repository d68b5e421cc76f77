"""GGUF files: the header (gguf_header.py), and every tensor type the `gguf` package can dequantize."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..models.params import ParamSpec
from ..quant.ggml import GGML_FORMATS, from_blocks
from . import gguf_fixes
from .common import ModelLoadError
from .gguf_header import Header

_ARRAY_KEYS_SKIPPED = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.scores"}


def open_gguf(path: str | Path) -> Header:
    p = Path(path)
    if p.stat().st_size < 24:
        raise ModelLoadError(f"{p} is too small to be a GGUF file; it is truncated: re-download it")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{p} is not a GGUF file (bad magic {magic!r}); pass a .gguf model file")
    try:
        return Header(p)
    except Exception as e:  # truncated tensor data or header: numpy/struct errors of many kinds
        raise ModelLoadError(f"{p} is a corrupt or truncated GGUF file ({type(e).__name__}: {e}); "
                             f"re-download it") from None


def read_metadata(reader: Header, full_arrays: bool = False) -> dict[str, Any]:
    """GGUF key/values as Python values; the large tokenizer arrays only when asked for."""
    return {k: v for k, v in reader.fields.items() if full_arrays or k not in _ARRAY_KEYS_SKIPPED}


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) back to HF's rotate_half order."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


class GGUFSource:
    def __init__(self, reader: Header):
        import gguf
        self._gguf = gguf
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """One tensor, dequantized to float32, rows first."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"tensor {name} is missing from the GGUF file")
        try:
            return np.asarray(self._gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise ModelLoadError(f"tensor {name} uses GGUF type {t.tensor_type.name}, which the gguf "
                                 f"package cannot dequantize; convert the file to another type") from None
        except Exception as e:
            raise ModelLoadError(f"tensor {name} cannot be read ({e}); the file may be corrupt") from None

    def fetch(self, spec: ParamSpec) -> np.ndarray:
        w = self.read(spec.gguf)
        if spec.gguf_fix:
            try:
                w = gguf_fixes.apply(w, spec.gguf_fix, self.read)
            except ValueError as e:
                raise ModelLoadError(f"tensor {spec.gguf}: {e}") from None
        w = w.reshape(spec.shape) if w.size == np.prod(spec.shape) else w
        if spec.gguf_permute_heads:
            w = unpermute_rope_rows(w, spec.gguf_permute_heads)
        return w

    def block_format(self, spec: ParamSpec) -> str:
        """The GGUF type a tensor is kept on the device in under --weights gguf ("" where it is
        dequantized at load: a type without a kernel, a tensor that is neither a matrix nor a stack
        of MoE expert matrices, or one whose values llama.cpp's conversion changed and loading must
        undo)."""
        t = self.tensors.get(spec.gguf)
        fmt = t.tensor_type.name.lower() if t is not None else ""
        if fmt not in GGML_FORMATS or spec.gguf_fix or len(spec.shape) not in (2, 3):
            return ""
        lead = len(spec.shape) - 1
        return fmt if tuple(np.asarray(t.data).shape[:lead]) == spec.shape[:lead] else ""

    def blocks(self, spec: ParamSpec):
        """The tensor as a QTensor of its own GGUF blocks (quant/ggml.py), or None (see block_format).
        llama's q/k row permutation moves whole rows, so it applies to the blocks as they are."""
        fmt = self.block_format(spec)
        if not fmt:
            return None
        raw = np.asarray(self.tensors[spec.gguf].data)
        if spec.gguf_permute_heads:
            raw = unpermute_rope_rows(raw, spec.gguf_permute_heads)
        try:
            return from_blocks(fmt, raw, spec.shape)
        except ValueError as e:
            raise ModelLoadError(f"tensor {spec.gguf}: {e}; the file does not match its config") from None
