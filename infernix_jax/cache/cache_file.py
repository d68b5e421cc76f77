"""`--prefix-cache-file PATH`: the prefix cache across restarts.

At shutdown the cached blocks (the device's first, then the RAM tier's, most recently used first,
up to a size cap), the hybrids' state snapshots and the SSD tier's index are written to PATH (to a
temporary file first, then renamed: a crash never leaves half a file). At start the file is loaded
if its fingerprint (format version, model identity, dtype, KV format, block size, device kind)
matches this server's; otherwise it is ignored once, with a log line, and replaced at shutdown.
The blocks come back into the RAM tier, so a prompt re-sent after a restart resumes from there."""
from __future__ import annotations

import json
import logging
import os
import zipfile

import numpy as np

log = logging.getLogger("infernix.cache")
FORMAT = 2          # 2: SSD records check their payload with zstd's frame checksum


def weights_identity(path) -> str:
    """The checkpoint behind a model: its files' paths, sizes and modification times (a served alias
    or a config says nothing about which weights computed the KV)."""
    import pathlib
    if not path:
        return ""
    p = pathlib.Path(path)
    files = sorted(x for x in p.iterdir() if x.suffix in (".safetensors", ".gguf", ".json")) if p.is_dir() else [p]
    return ";".join(f"{x.resolve()}:{x.stat().st_size}:{x.stat().st_mtime_ns}" for x in files if x.exists())


def fingerprint(model_id: str, dtype: str, kv_format: str, block_size: int, device_kind: str) -> dict:
    return {"format": FORMAT, "model": model_id, "dtype": dtype, "kv": kv_format, "block_size": block_size,
            "device": device_kind}


def save(path: str, fp: dict, blocks: list, snapshots: list, ssd_state: dict | None) -> int:
    """blocks: (key, parent, tokens, k, v) with k, v [L, nKV, bs, hd] (quantized KV: [L, nKV, R]
    uint8 rows); snapshots: (key, StateSnapshot).
    Returns the bytes written."""
    meta = {"fingerprint": fp, "keys": [str(b[0]) for b in blocks], "parents": [str(b[1]) for b in blocks],
            "snapshots": [[str(key), s.num_tokens, len(s.conv)] for key, s in snapshots], "ssd": ssd_state}
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    if blocks:
        tokens = [np.asarray(b[2], np.int32) for b in blocks]
        arrays["tok_len"] = np.asarray([len(t) for t in tokens], np.int32)
        arrays["tokens"] = np.concatenate(tokens)
        arrays["k"] = np.stack([b[3] for b in blocks])
        arrays["v"] = np.stack([b[4] for b in blocks])
    for i, (_, s) in enumerate(snapshots):
        for j, (c, m) in enumerate(zip(s.conv, s.ssm)):
            arrays[f"s{i}_conv{j}"], arrays[f"s{i}_ssm{j}"] = np.asarray(c), np.asarray(m)
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "wb") as f:
        np.savez(f, **{k: _savable(v) for k, v in arrays.items()})
    os.replace(tmp, path)
    return os.path.getsize(path)


def _savable(a: np.ndarray) -> np.ndarray:
    # bfloat16 (ml_dtypes) has no .npy type code: store its bits, tagged by the uint16 view
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def load(path: str, fp: dict, dtype, block_dtype=None) -> dict | None:
    """The saved cache, or None (with a log line) when there is none or it does not match. dtype:
    the model's; block_dtype: the KV blocks' when it differs (quantized KV travels as uint8 bytes)."""
    block_dtype = dtype if block_dtype is None else block_dtype
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("fingerprint") != fp:
                log.warning("prefix cache file %s was written for %s, not %s: ignored (replaced at shutdown)",
                            path, meta.get("fingerprint"), fp)
                return None
            out = {"blocks": [], "snapshots": [], "ssd": meta.get("ssd")}
            if meta["keys"]:
                lens = z["tok_len"]
                starts = np.concatenate([[0], np.cumsum(lens)])
                toks, k, v = z["tokens"], _typed(z["k"], block_dtype), _typed(z["v"], block_dtype)
                for i, (key, parent) in enumerate(zip(meta["keys"], meta["parents"])):
                    out["blocks"].append((int(key), int(parent), tuple(toks[starts[i]:starts[i + 1]].tolist()),
                                          k[i], v[i]))
            for i, (key, n, layers) in enumerate(meta["snapshots"]):
                conv = tuple(_typed(z[f"s{i}_conv{j}"], dtype) for j in range(layers))
                ssm = tuple(z[f"s{i}_ssm{j}"] for j in range(layers))
                out["snapshots"].append((int(key), n, conv, ssm))
            return out
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        log.warning("prefix cache file %s cannot be read (%s): ignored (replaced at shutdown)", path, e)
        return None


def _typed(a: np.ndarray, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    return a.view(dtype) if a.dtype == np.uint16 and dtype.name == "bfloat16" else a.astype(dtype, copy=False)
