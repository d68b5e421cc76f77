"""A model's own sampling defaults, as vLLM reads them: from generation_config.json of a Hugging Face
directory, or from the `general.sampling.*` keys of a GGUF file. The server applies them to every
sampling field a request leaves out; max_new_tokens caps every reply (vLLM's behaviour, and
llama-server's -n)."""
from __future__ import annotations

import json
import math
from pathlib import Path

# field -> (type, low, high): the fields a default may set, with the ranges SamplingParams accepts
FIELDS = {"temperature": (float, 0.0, 100.0), "top_p": (float, 1e-9, 1.0), "top_k": (int, 0, 1 << 30),
          "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 1e-6, 10.0),
          "presence_penalty": (float, -2.0, 2.0), "frequency_penalty": (float, -2.0, 2.0),
          "max_new_tokens": (int, 1, 1 << 30)}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def check(d: dict, source: str, strict: bool = True) -> dict:
    """-> the known fields of d, typed and range-checked. strict: an unknown field is an error (a
    user's override); otherwise it is skipped (a model file carries many other keys). Raises
    ValueError naming the source and the field."""
    if not isinstance(d, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(d).__name__}")
    out = {}
    for k, v in d.items():
        if k not in FIELDS:
            if strict:
                raise ValueError(f"{source}: unknown field {k!r}; known: {', '.join(FIELDS)}")
            continue
        typ, lo, hi = FIELDS[k]
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (typ is int and float(v) != int(v)):
            raise ValueError(f"{source}: {k} must be a{'n integer' if typ is int else ' finite number'}, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"{source}: {k} must be in [{lo:g}, {hi:g}], got {v}")
        out[k] = typ(v)
    if out.get("top_k") == 0:
        del out["top_k"]            # HF's 0 (and our 0) both mean "off": the same as leaving it out
    return out


def from_hf_dir(path: Path) -> dict:
    f = Path(path) / "generation_config.json"
    if not f.exists():
        return {}
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON: {e}") from None
    return check(d, str(f), strict=False)


def from_gguf(kv: dict) -> dict:
    return check({field: kv[key] for key, field in GGUF_KEYS.items() if key in kv}, "GGUF general.sampling", strict=False)


def describe(d: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()) or "none"
