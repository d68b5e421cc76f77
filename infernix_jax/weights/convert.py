"""infernix-convert's writer: a model (alias, HF directory or GGUF file) into a converted checkpoint
(the layout is in converted.py, which reads it back), one part at a time so that a model larger
than RAM converts."""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from ..hub import resolve
from ..loader import DTYPES, block_keeper, gguf_block_source, source_of
from ..models.kv_pool import check_kv_dtype
from ..models.params import declare_params
from ..quant import check_weights
from ..quant.apply import quantize_layer
from .common import materialize
from .converted import FORMAT, HF_FILES, MANIFEST, VERSION, _ckpt, _config_digest, parts_of, write_part


def convert(spec: str, dst: str | Path, weights: str | None = None, dtype: str = "bfloat16",
            progress: bool = True, kv_dtype: str = "") -> dict:
    """Convert a model (alias, HF directory or GGUF file) into dst, a layer at a time: read the
    layer's tensors, quantize its projections to `weights`, save, let go. kv_dtype: the KV cache
    dtype the manifest names as the checkpoint's default. Returns the manifest."""
    check_weights(weights, dtype)
    check_kv_dtype(kv_dtype, dtype=DTYPES.get(dtype))
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    src_path = resolve(spec)
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty directory; choose a new one")
    if weights == "gguf":                     # the file's own blocks, as --weights gguf loads them
        cfg, src, tok, gen = gguf_block_source(src_path)
        specs = declare_params(cfg)
        fetch, keep = src.fetch, block_keeper(specs, src)
    else:
        cfg, fetch, tok, gen = source_of(src_path)
        specs, keep = declare_params(cfg), None
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-"))
    ocp, ck = _ckpt()
    try:
        manifest = _convert_into(ck, tmp, src_path, cfg, specs, fetch, keep, tok, gen, weights, dtype, progress,
                                 kv_dtype)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)           # the directory appears whole or not at all
        return manifest
    except OSError as e:
        raise ValueError(f"writing {dst} failed: {e}") from None
    finally:
        ck.close()
        shutil.rmtree(tmp, ignore_errors=True)      # gone after the rename; a failure leaves nothing


def _convert_into(ck, tmp: Path, src_path: Path, cfg, specs, fetch, keep, tok, gen, weights, dtype,
                  progress, kv_dtype: str = "") -> dict:
    (tmp / "params").mkdir()
    t0 = time.perf_counter()
    tensors: dict = {}
    parts = parts_of(specs)
    bar = tqdm(parts.items(), desc=f"converting {src_path.name}", unit="part", disable=None if progress else True)
    for part, items in bar:
        vals = materialize({n: s for n, s in items}, fetch, DTYPES[dtype], desc=part, keep=keep)
        if weights and weights != "gguf" and part != "top":                  # "layers/3/wq" -> quantize_layer's "wq" and back
            full = {n.split("/", 2)[2]: n for n in vals}
            vals = {full[k]: v for k, v in quantize_layer({k: vals[n] for k, n in full.items()}, weights).items()}
        tensors.update(write_part(ck, tmp, part, vals))
        del vals
    _write_tokenizer(src_path, tmp, tok, gen)
    total = sum(e.get("bytes", 0) + sum(a["bytes"] for a in e.get("arrays", {}).values()) for e in tensors.values())
    config = dataclasses.asdict(cfg)
    manifest = {"format": FORMAT, "version": VERSION, "source": str(src_path), "dtype": dtype,
                "weights": weights or "", "kv_dtype": kv_dtype, "config": config, "config_blake2b": _config_digest(config),
                "total_bytes": total, "seconds": round(time.perf_counter() - t0, 1), "tensors": tensors}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _write_tokenizer(src: Path, dst: Path, tok, gen: dict) -> None:
    if src.is_dir():
        for f in HF_FILES:
            if (src / f).exists():
                shutil.copy2(src / f, dst / f)
        return
    if tok is None:
        return
    tok.tok.save(str(dst / "tokenizer.json"))
    cfg = {k: v for k, v in tok.special_tokens_map.items()}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": list(tok.eos_ids)}, indent=1))
