"""HF checkpoints: model.safetensors, or shards listed in model.safetensors.index.json."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..models.params import ParamSpec
from .common import ModelLoadError


class SafetensorsSource:
    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index} is corrupt ({e}); re-download the model") from None
            files = sorted(set(weight_map.values()))
        elif (d / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise ModelLoadError(f"{d} has no model.safetensors or model.safetensors.index.json; "
                                 f"it is not a Hugging Face model directory with safetensors weights")
        self._where: dict[str, object] = {}
        self._handles = []
        for f in files:
            path = d / f
            if not path.exists():
                raise ModelLoadError(f"shard {path} is missing; re-download the model")
            try:
                h = safe_open(str(path), framework="flax")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise ModelLoadError(f"{path} is not a valid safetensors file ({e}); "
                                     f"it may be truncated or corrupt: re-download it") from None
            self._handles.append(h)
            for k in h.keys():
                self._where[k] = h

    def has(self, name: str) -> bool:
        return self._resolve(name) in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def _resolve(self, name: str) -> str:
        """Qwen3.5's official checkpoints are the VLM: the text model sits under model.language_model."""
        if name not in self._where and name.startswith("model."):
            alt = "model.language_model." + name[len("model."):]
            if alt in self._where:
                return alt
        return name

    def _get(self, name: str) -> np.ndarray:
        name = self._resolve(name)
        h = self._where.get(name)
        if h is None:
            raise ModelLoadError(f"tensor {name} is missing from the checkpoint")
        try:
            return np.asarray(h.get_tensor(name), dtype=np.float32)
        except Exception as e:
            raise ModelLoadError(f"tensor {name} cannot be read ({e}); the file may be truncated") from None

    def fetch(self, spec: ParamSpec) -> np.ndarray:
        if "{e}" not in spec.hf:
            return self._get(spec.hf)
        # Experts: per-expert tensors (transformers' save_pretrained) or a fused one (official Qwen).
        first = spec.hf.format(e=0)
        if self.has(first):
            return np.stack([self._get(spec.hf.format(e=e)) for e in range(spec.shape[0])])
        if spec.hf_fused and self.has(spec.hf_fused[0]):
            name, part = spec.hf_fused
            fused = self._get(name)
            return fused if part < 0 else np.split(fused, 2, axis=-2)[part]
        raise ModelLoadError(f"expert tensors {first} (or {spec.hf_fused and spec.hf_fused[0]}) are missing")
