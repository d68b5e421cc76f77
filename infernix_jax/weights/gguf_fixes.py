"""Undoing llama.cpp's conversion of hybrid (Qwen3-Next / Qwen3.5) weights, step by step.

Each ParamSpec.gguf_fix is a tuple of steps (name, *args), applied in order to the dequantized
tensor (numpy, rows first):
  minus1                        zero-centred norms: GGUF stores 1 + w
  a_log                         ssm_a = -exp(A_log)  ->  A_log = log(-ssm_a)
  untile_rows off Hk r d        rows from `off` on are value heads of d rows each in llama.cpp's
                                tiled order (h' = i * Hk + g); back to HF's grouped order (h = g * r + i)
  untile_cols Hk r d            the same along the columns (out_proj's input dimension)
  qkvz gate Hk dk vz            Qwen3-Next: attn_qkv [q_all | k_all | v_all] and attn_gate (the
                                tensor named `gate`) back to in_proj_qkvz, grouped per key head
                                [q_g | k_g | v_g | z_g] with vz = (Hv / Hk) * dv rows of v and of z
MODELS.md section 8 lists what the converter does; these are its inverses."""
from __future__ import annotations

from typing import Callable

import numpy as np


def _untile(x: np.ndarray, Hk: int, r: int, d: int) -> np.ndarray:
    """x [r * Hk * d, ...] in tiled head order -> grouped order."""
    rest = x.shape[1:]
    return x.reshape(r, Hk, d, *rest).swapaxes(0, 1).reshape(-1, *rest)


def apply(w: np.ndarray, steps: tuple, read: Callable[[str], np.ndarray]) -> np.ndarray:
    for step in steps:
        kind, *a = step
        if kind == "minus1":
            w = w - 1.0
        elif kind == "a_log":
            if np.any(w >= 0):
                raise ValueError("ssm_a must be negative (it is -exp(A_log))")
            w = np.log(-w)
        elif kind == "untile_rows":
            off, Hk, r, d = a
            w = np.concatenate([w[:off], _untile(w[off:], Hk, r, d)], axis=0)
        elif kind == "untile_cols":
            Hk, r, d = a
            w = _untile(w.T, Hk, r, d).T
        elif kind == "qkvz":
            gate, Hk, dk, vz = a
            z = read(gate)
            H = w.shape[-1]
            q, k, v = w[:Hk * dk], w[Hk * dk:2 * Hk * dk], w[2 * Hk * dk:]
            parts = [t.reshape(Hk, -1, H) for t in (q, k, v, z.reshape(-1, H))]
            if parts[2].shape[1] != vz or parts[3].shape[1] != vz:
                raise ValueError(f"attn_qkv / attn_gate rows do not split into {Hk} key-head groups")
            w = np.concatenate(parts, axis=1).reshape(-1, H)
        else:
            raise ValueError(f"unknown GGUF fix {kind!r}")
    return w
