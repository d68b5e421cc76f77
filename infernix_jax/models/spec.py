"""A weight's declaration: its shape, how random init fills it, and its names in HF checkpoints
and GGUF files (what it *is*, for sharding, quantization and fusing: roles.py)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    init: str                      # "normal" | "ones" | "zeros"
    hf: str                        # safetensors name; "{e}" marks a per-expert name to stack
    gguf: str                      # GGUF tensor name
    hf_fused: tuple[str, int] | None = None   # (fused name, chunk index along dim -2)
    gguf_permute_heads: int = 0    # llama GGUF: undo the interleaved-RoPE row order of q/k
    gguf_fix: tuple = ()           # steps undoing llama.cpp's conversion (weights/gguf_fixes.py)
