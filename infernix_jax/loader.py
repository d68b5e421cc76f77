"""`load_model(spec)`: alias, HF directory or .gguf file -> config, params, tokenizer."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax.numpy as jnp

from . import generation_config
from .config import ConfigError, ModelConfig
from .hub import ALIASES, resolve
from .models.params import declare_params
from .tokenizer import Tokenizer, TokenizerError
from .weights.common import ModelLoadError, materialize
from .weights.gguf_io import GGUFSource, open_gguf, read_metadata
from .weights.safetensors_io import SafetensorsSource

log = logging.getLogger("infernix.loader")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    name: str
    path: Path
    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    dtype: object
    generation_defaults: dict = dataclasses.field(default_factory=dict)   # see generation_config.py
    weights_format: str = ""      # --weights: the QTensor format of the projections ("": as loaded)


def _gguf_config(path: Path, kv: dict, src: GGUFSource) -> ModelConfig:
    embed = src.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor; it is not a language model GGUF")
    return ModelConfig.from_gguf_fields(kv, set(src.tensors), int(embed.shape[-1]))


def _load_gguf(path: Path, dtype, with_tokenizer: bool):
    reader = open_gguf(path)
    kv = read_metadata(reader, full_arrays=with_tokenizer)
    src = GGUFSource(reader)
    cfg = _gguf_config(path, kv, src)
    tok = Tokenizer.from_gguf_metadata(kv) if with_tokenizer else None
    params = materialize(declare_params(cfg), src.fetch, dtype, desc=f"loading {path.name}")
    return cfg, params, tok, generation_config.from_gguf(kv)


def _load_hf_dir(path: Path, dtype, with_tokenizer: bool):
    cfg = ModelConfig.from_hf_dir(path)
    src = SafetensorsSource(path)
    tok = Tokenizer.from_hf_dir(path) if with_tokenizer and (path / "tokenizer.json").exists() else None
    if cfg.tie_word_embeddings is False and not src.has("lm_head.weight") and src.has("model.embed_tokens.weight"):
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # some checkpoints omit the flag
    if cfg.mtp_layers and not src.has("mtp.fc.weight"):
        log.info("%s: the config declares %d MTP layer(s) but the checkpoint has no mtp.* weights; "
                 "loading without them", path.name, cfg.mtp_layers)
        cfg = dataclasses.replace(cfg, mtp_layers=0)
    vision = sum(n.startswith(("model.visual.", "visual.")) for n in src.names())
    if vision:
        log.info("%s: skipping %d vision tensors (image input is not supported yet)", path.name, vision)
    params = materialize(declare_params(cfg), src.fetch, dtype, desc=f"loading {path.name}")
    return cfg, params, tok, generation_config.from_hf_dir(path)


def load_config(spec: str) -> ModelConfig:
    """The config alone (no weights are read): for planning memory before a start."""
    path = resolve(spec)
    try:
        if path.is_dir():
            return ModelConfig.from_hf_dir(path)
        if path.suffix == ".gguf" or _looks_like_gguf(path):
            reader = open_gguf(path)
            return _gguf_config(path, read_metadata(reader), GGUFSource(reader))
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    raise ModelLoadError(f"{path} is not a model: pass a Hugging Face model directory "
                         f"(config.json + safetensors), a .gguf file or an alias")


def load_model(spec: str, dtype: str = "float32", with_tokenizer: bool = True, weights: str | None = None) -> LoadedModel:
    """Raises ModelLoadError / ConfigError / TokenizerError with a one-line, actionable message.
    weights: a quant format (quant/formats.py) to quantize the projections to after loading."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    from .quant import FORMATS
    if weights and weights not in FORMATS:
        raise ModelLoadError(f"unknown weight format {weights!r}; choose one of {', '.join(FORMATS)}")
    path = resolve(spec)
    jdt = DTYPES[dtype]
    try:
        if path.is_dir():
            cfg, params, tok, gen = _load_hf_dir(path, jdt, with_tokenizer)
        elif path.suffix == ".gguf" or _looks_like_gguf(path):
            cfg, params, tok, gen = _load_gguf(path, jdt, with_tokenizer)
        else:
            raise ModelLoadError(f"{path} is not a model: pass a Hugging Face model directory "
                                 f"(config.json + safetensors), a .gguf file or an alias")
    except (ConfigError, TokenizerError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if weights:
        from .quant.apply import quantize_params
        params = quantize_params(params, weights)
    return LoadedModel(name=spec if spec in ALIASES else path.name, path=path, cfg=cfg, params=params,
                       tokenizer=tok, dtype=jdt, generation_defaults=gen, weights_format=weights or "")


def _looks_like_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
