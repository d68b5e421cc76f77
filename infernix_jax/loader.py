"""`load_model(spec)`: alias, HF directory or .gguf file -> config, params, tokenizer."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import generation_config
from .config import ConfigError, ModelConfig
from .hub import ALIASES, resolve
from .models.fuse import fuse_params
from .models.params import ParamSpec, declare_params
from .tokenizer import Tokenizer, TokenizerError
from .quant import check_weights
from .quant.ggml import GGML_FORMATS
from .quant.packed import report
from .weights.common import ModelLoadError, materialize
from .weights.converted import config_from_manifest, converted_bytes, is_converted, load_params, read_manifest
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
    generation_source: str = ""          # where they come from (for the start-up line)
    # --weights: the QTensor format of the projections ("": as loaded; "gguf": each projection in its
    # GGUF file's own block type, quant/ggml.py, or dequantized where that type has no kernel)
    weights_format: str = ""


def _gguf_config(path: Path, kv: dict, src: GGUFSource) -> ModelConfig:
    embed = src.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor; it is not a language model GGUF")
    return ModelConfig.from_gguf_fields(kv, set(src.tensors), int(embed.shape[-1]))


def _gguf_parts(path: Path, with_tokenizer: bool):
    reader = open_gguf(path)
    kv = read_metadata(reader, full_arrays=with_tokenizer)
    src = GGUFSource(reader)
    cfg = _gguf_config(path, kv, src)
    # a file without any tokenizer (a test file, a bare export) loads without one: serving says so
    tok = Tokenizer.from_gguf_metadata(kv) if with_tokenizer and "tokenizer.ggml.model" in kv else None
    return cfg, src, tok, generation_config.from_gguf(kv)


def _gguf_source(path: Path, with_tokenizer: bool):
    cfg, src, tok, gen = _gguf_parts(path, with_tokenizer)
    return cfg, src.fetch, tok, gen


def _hf_source(path: Path, with_tokenizer: bool):
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
    return cfg, src.fetch, tok, generation_config.from_hf_dir(path)


def source_of(path: Path, with_tokenizer: bool = True):
    """(config, fetch(ParamSpec) -> numpy array, tokenizer, generation defaults) of an HF directory
    or a GGUF file: what loading and converting read tensor by tensor."""
    try:
        if path.is_dir() and not is_converted(path):
            return _hf_source(path, with_tokenizer)
        if path.suffix == ".gguf" or _looks_like_gguf(path):
            return _gguf_source(path, with_tokenizer)
    except (ConfigError, TokenizerError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    raise ModelLoadError(f"{path} is not a model: pass a Hugging Face model directory "
                         f"(config.json + safetensors), a .gguf file, a converted checkpoint or an alias")


def _load_converted(path: Path, dtype: str, with_tokenizer: bool, weights: str | None):
    m = read_manifest(path)
    cfg = config_from_manifest(path, m)
    stored = m.get("weights", "")
    if weights == "gguf" and stored != "gguf":
        raise ModelLoadError(f"{path} is a converted checkpoint without GGUF blocks; --weights gguf keeps a .gguf "
                             f"file's blocks: convert the .gguf with --weights gguf, or drop the flag")
    _check_weights(weights, dtype, stored, path)
    params = load_params(path, m, cfg, DTYPES[dtype])
    tok = Tokenizer.from_hf_dir(path) if with_tokenizer and (path / "tokenizer.json").exists() else None
    return cfg, params, tok, generation_config.from_hf_dir(path), stored


def stored_route(spec: str) -> tuple[str | None, str, str]:
    """(dtype, weight format, default KV dtype) a converted checkpoint was written with; (None, "", "")
    for other models."""
    p = Path(spec).expanduser()
    if spec not in ALIASES and is_converted(p):
        m = read_manifest(p)
        return m.get("dtype"), m.get("weights", ""), m.get("kv_dtype", "")
    return None, "", ""


def load_config(spec: str) -> ModelConfig:
    """The config alone (no weights are read): for planning memory before a start."""
    path = resolve(spec)
    if is_converted(path):
        return config_from_manifest(path, read_manifest(path))
    try:
        if path.is_dir():
            return ModelConfig.from_hf_dir(path)
        if path.suffix == ".gguf" or _looks_like_gguf(path):
            reader = open_gguf(path)
            return _gguf_config(path, read_metadata(reader), GGUFSource(reader))
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    raise ModelLoadError(f"{path} is not a model: pass a Hugging Face model directory "
                         f"(config.json + safetensors), a .gguf file, a converted checkpoint or an alias")


def _projections(specs: dict) -> list:
    """The specs of the matrices --weights quantizes (models/roles.py: QUANTIZABLE and the routed MoE
    experts' stacks), layer by layer."""
    from .models.roles import EXPERTS, QUANTIZABLE
    return [p[n] for p in specs["layers"] for n in sorted((QUANTIZABLE | EXPERTS) & p.keys())]


def gguf_block_source(path: Path, with_tokenizer: bool = True):
    """(config, GGUFSource, tokenizer, generation defaults) of a GGUF file for --weights gguf."""
    if not (path.suffix == ".gguf" or _looks_like_gguf(path)):
        raise ModelLoadError(f"--weights gguf keeps a GGUF file's quantized blocks on the device, and {path} "
                             f"is not a .gguf file: pick another --weights format")
    try:
        return _gguf_parts(path, with_tokenizer)
    except (ConfigError, TokenizerError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None


def block_keeper(specs: dict, src: GGUFSource):
    """materialize's `keep` for --weights gguf: the projections of `specs` (this very tree) as the
    file's own blocks where a kernel reads their type (quant/ggml.py), None for the rest. Logs what
    it will keep."""
    projections = _projections(specs)
    kept = Counter(src.block_format(s) or f"{src.tensors[s.gguf].tensor_type.name} dequantized"
                   for s in projections if s.gguf in src.tensors)
    fmts = ", ".join(f"{n} {k}" for k, n in sorted(kept.items()))
    if not any(f in GGML_FORMATS for f in kept):
        log.warning("--weights gguf: no projection is kept (types with a kernel: %s): %s",
                    ", ".join(GGML_FORMATS), fmts)
    else:
        log.info("--weights gguf: projections %s", fmts)
    targets = {id(s) for s in projections}
    return lambda s: src.blocks(s) if id(s) in targets else None


def _load_gguf_blocks(path: Path, dtype, with_tokenizer: bool):
    """--weights gguf: the projections stay in the file's own quantized blocks; everything else is
    dequantized to dtype as usual."""
    cfg, src, tok, gen = gguf_block_source(path, with_tokenizer)
    specs = declare_params(cfg)
    params = materialize(specs, src.fetch, dtype, desc=f"loading {path.name} (GGUF blocks)",
                         keep=block_keeper(specs, src))
    return cfg, params, tok, gen


def planned_gguf_bytes(spec: str, dtype) -> int:
    """Device bytes of a GGUF model's weights under --weights gguf (for --plan): the projections
    kept at their repacked size (quant/formats.nominal_bits), the rest dequantized to dtype; for a
    checkpoint converted with --weights gguf, its manifest's arrays (floats at dtype)."""
    from .quant.formats import nominal_bits
    path = resolve(spec)
    if is_converted(path):
        m = read_manifest(path)
        if m.get("weights") != "gguf":
            raise ModelLoadError(f"{path} is a converted checkpoint without GGUF blocks: drop --weights gguf")
        return converted_bytes(m, dtype)
    cfg, src, _, _ = gguf_block_source(path, False)
    specs = declare_params(cfg)
    projections = {id(s) for s in _projections(specs)}
    total = 0
    for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, ParamSpec)):
        n = int(np.prod(s.shape))
        fmt = src.block_format(s) if id(s) in projections else ""
        total += int(n * nominal_bits(fmt) / 8) if fmt else n * jnp.dtype(dtype).itemsize
    return total


def load_model(spec: str, dtype: str = "float32", with_tokenizer: bool = True, weights: str | None = None,
               fuse: bool = True, parallel=None) -> LoadedModel:
    """Raises ModelLoadError / ConfigError / TokenizerError with a one-line, actionable message.
    weights: a quant format (quant/formats.py) to quantize the projections to after loading, bf16p
    (lossless packing) or gguf (a .gguf file's projections kept in their own blocks). fuse: q/k/v
    and gate/up in one matrix each where they fuse (models/fuse.py; the same output). parallel
    (sharding.Parallel): an HF or GGUF checkpoint's tensors go straight into their shards on that
    many devices (fuse is then off: tensor parallelism splits the parts apart); converted
    checkpoints and GGUF blocks load on the first device and are split by the engine."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    _check_weights(weights, dtype)
    path = resolve(spec)
    jdt = DTYPES[dtype]
    stored = ""                    # a converted checkpoint's own format: its projections come quantized
    if is_converted(path):
        cfg, params, tok, gen, stored = _load_converted(path, dtype, with_tokenizer, weights)
    elif weights == "gguf":
        cfg, params, tok, gen = _load_gguf_blocks(path, jdt, with_tokenizer)
        stored = "gguf"
    else:
        cfg, fetch, tok, gen = source_of(path, with_tokenizer)
        place = None
        if parallel:
            from .sharding import make_mesh, placer
            place = placer(make_mesh(parallel), cfg)
        params = materialize(declare_params(cfg), fetch, jdt, desc=f"loading {path.name}", place=place)
    if weights and not stored:
        from .quant.apply import quantize_params
        params = quantize_params(params, weights, in_place=True)
        if weights == "bf16p":
            plain, packed, esc = report(params)
            log.info("bf16p: projections %.2f GiB -> %.2f GiB packed (%d escapes), bit-identical output",
                     plain / 2**30, packed / 2**30, esc)
    if fuse and not parallel:       # after quantizing part by part, as infernix-convert stores them: the same model either way
        params = fuse_params(params, in_place=True)
    gen, source = _with_alias_defaults(spec, gen)
    return LoadedModel(name=spec if spec in ALIASES else path.name, path=path, cfg=cfg, params=params,
                       tokenizer=tok, dtype=jdt, generation_defaults=gen, generation_source=source,
                       weights_format=weights or stored)


def _with_alias_defaults(spec: str, gen: dict) -> tuple[dict, str]:
    """The model file's own sampling defaults; an alias whose file has none gets its card's."""
    if gen:
        return gen, "the model's own"
    alias = ALIASES.get(spec)
    if alias is not None and alias.sampling:
        return dict(alias.sampling), f"{alias.sampling_source}, for the {spec} alias"
    return {}, ""


def _check_weights(weights, dtype: str, stored: str = "", where: Path | None = None) -> None:
    """check_weights, raising the loader's error."""
    try:
        check_weights(weights, dtype, stored, str(where))
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def _looks_like_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
