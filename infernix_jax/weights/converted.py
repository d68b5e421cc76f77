"""Converted checkpoints (infernix-convert): a model as Orbax checkpoints, one per part, so that a
model larger than RAM converts and loads one decoder layer at a time.

  DST/infernix.json          the manifest: format and version, where it came from, the compute dtype,
                             the weight format, the model config, and for every tensor its part,
                             shape, dtype, bytes and BLAKE2b digest (checked on load)
  DST/params/top/            embeddings, final norm, LM head, MTP: what is outside the layers
  DST/params/layer_000/ ...  one decoder layer each
  DST/tokenizer.json, tokenizer_config.json, generation_config.json (and the source's config.json)

A quantized matrix (QTensor) is stored as its arrays, `name.data`, `name.scale` (and `name.zero`,
`name.tensor_scale`; GGUF blocks' further arrays as `name.more0`, ...), a packed one (bf16p) as `name.lo`, `.codes`, `.base`, `.esc_idx`, `.esc_val`,
with its format and logical shape in the manifest."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ..config import ModelConfig
from ..models.params import ParamSpec, declare_params
from pallas_kernels.ggml_blocks import LAYOUT

from ..quant.formats import FORMATS, QTensor
from ..quant.ggml import GGML_FORMATS
from ..quant.packed import Packed12
from .common import ModelLoadError

MANIFEST = "infernix.json"
FORMAT, VERSION = "infernix-orbax", 1
QPARTS = ("data", "scale", "zero", "tensor_scale")
PPARTS = ("lo", "codes", "base", "esc_idx", "esc_val")
TENSOR_FORMATS = (*FORMATS, "bf16p", *GGML_FORMATS)     # what one stored matrix can be in
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
            "special_tokens_map.json")


def is_converted(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).exists()


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def parts_of(specs: dict) -> dict[str, list[tuple[str, ParamSpec]]]:
    """part -> [(tensor name, spec)]: "top" and one "layer_NNN" per decoder layer."""
    out: dict[str, list] = {}
    leaves, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    for path, spec in leaves:
        name = _name(path)
        first = name.split("/")
        part = f"layer_{int(first[1]):03d}" if first[0] == "layers" else "top"
        out.setdefault(part, []).append((name, spec))
    return out


def _digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).data, digest_size=16).hexdigest()


def _arrays(name: str, value) -> dict[str, np.ndarray]:
    if isinstance(value, (QTensor, Packed12)):
        fields = QPARTS if isinstance(value, QTensor) else PPARTS
        out = {f"{name}.{k}": np.asarray(getattr(value, k)) for k in fields if getattr(value, k) is not None}
        if isinstance(value, QTensor):             # GGUF blocks' further arrays: name.more0, ...
            out.update({f"{name}.more{i}": np.asarray(a) for i, a in enumerate(value.more)})
        return out
    return {name: np.asarray(value)}


def _ckpt():
    import orbax.checkpoint as ocp
    return ocp, ocp.PyTreeCheckpointer()


def write_part(ck, dst: Path, part: str, tensors: dict) -> dict:
    """Save {name: array, QTensor or Packed12} as params/<part> with checkpointer ck (dst absolute:
    Orbax's default layout takes no relative paths); returns the manifest entries. Empty arrays (a
    packed matrix without escapes) are not stored: their manifest entry says what they are."""
    flat, entries = {}, {}
    for name, value in tensors.items():
        arrays = _arrays(name, value)
        flat.update(arrays)
        if isinstance(value, (QTensor, Packed12)):
            fmt = value.fmt if isinstance(value, QTensor) else "bf16p"
            entries[name] = {"part": part, "fmt": fmt, "shape": list(value.shape),
                             "arrays": {k: _entry(a) for k, a in arrays.items()}}
        else:
            entries[name] = {"part": part, **_entry(arrays[name])}
    # orbax keys may not hold "/" or ".": store under escaped names, restore maps them back
    ck.save(str(dst / "params" / part), {_key(k): v for k, v in flat.items() if v.size})
    return entries


def _key(name: str) -> str:
    return name.replace("/", "__").replace(".", "_dot_")


def _entry(a: np.ndarray) -> dict:
    return {"shape": list(a.shape), "dtype": str(a.dtype), "bytes": int(a.nbytes), "blake2b": _digest(a)}


def _check(path: Path, name: str, a, e: dict) -> np.ndarray:
    if a is None and 0 in e["shape"]:
        a = np.zeros(e["shape"], jnp.dtype(e["dtype"]))
    if a is None:
        raise ModelLoadError(f"{path}: tensor {name} is missing from params/{e.get('part')}; the checkpoint "
                             f"is incomplete: convert it again")
    if list(a.shape) != e["shape"] or str(a.dtype) != e["dtype"]:
        raise ModelLoadError(f"{path}: tensor {name} is {a.dtype}{list(a.shape)}, the manifest says "
                             f"{e['dtype']}{e['shape']}: the checkpoint does not match its manifest")
    if _digest(a) != e["blake2b"]:
        raise ModelLoadError(f"{path}: tensor {name} fails its checksum: the checkpoint is damaged; convert it again")
    return a


def _config_digest(config: dict) -> str:
    return hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=16).hexdigest()


def read_manifest(path: Path) -> dict:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}/{MANIFEST} cannot be read ({e}); convert the model again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else (type(m).__name__, None)
        raise ModelLoadError(f"{path}: not an {FORMAT} v{VERSION} checkpoint (format {got[0]!r}, "
                             f"version {got[1]!r}); convert it again with this version")
    from ..quant import WEIGHT_FORMATS
    if not isinstance(m.get("config"), dict) or not isinstance(m.get("tensors"), dict) \
            or m.get("weights", "") not in ("", *WEIGHT_FORMATS):
        raise ModelLoadError(f"{path}/{MANIFEST} lacks a config, a tensor list or a known weight format: "
                             f"convert the model again")
    from ..models.kv_pool import KV_DTYPES
    if m.get("kv_dtype", "") not in ("", *KV_DTYPES):
        raise ModelLoadError(f"{path}/{MANIFEST}: unknown default KV dtype {m.get('kv_dtype')!r}; "
                             f"choose one of {', '.join(KV_DTYPES)} (or none)")
    if m.get("config_blake2b") != _config_digest(m["config"]):
        raise ModelLoadError(f"{path}/{MANIFEST}: the model config fails its checksum (edited or damaged); "
                             f"convert the model again")
    return m


def converted_bytes(m: dict, dtype) -> int:
    """Device bytes of a converted checkpoint's tensors: quantized arrays as stored, the other float
    tensors at dtype (load_params casts them)."""
    total = 0
    for e in m.get("tensors", {}).values():
        for a in e.get("arrays", {}).values() if "fmt" in e else [e]:
            n = int(np.prod(a["shape"]))
            floating = "fmt" not in e and jnp.issubdtype(jnp.dtype(a["dtype"]), jnp.floating)
            total += n * jnp.dtype(dtype).itemsize if floating else a["bytes"]
    return total


def config_from_manifest(path: Path, m: dict) -> ModelConfig:
    try:
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in m["config"].items()}
        return ModelConfig(**d)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: the manifest's model config is not usable ({e}); convert it again") from None


def load_params(path: Path, m: dict, cfg: ModelConfig, dtype, progress: bool = True) -> dict:
    """Restore every part onto the device, checking each tensor against the manifest. Unquantized
    float tensors are cast to dtype; quantized ones keep their stored dtypes."""
    path = path.absolute()
    ocp, ck = _ckpt()
    try:
        return _load_parts(ocp, ck, path, m, cfg, dtype, progress)
    finally:
        ck.close()


def _load_parts(ocp, ck, path: Path, m: dict, cfg: ModelConfig, dtype, progress: bool) -> dict:
    specs = declare_params(cfg)
    tensors = m.get("tensors", {})
    values = {}
    for part, items in tqdm(parts_of(specs).items(), desc=f"loading {path.name}", unit="part", leave=False,
                            disable=None if progress else True):
        d = path / "params" / part
        if not d.exists():
            raise ModelLoadError(f"{path}: params/{part} is missing; the checkpoint is incomplete: convert it again")
        try:
            meta = ck.metadata(str(d))
            tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), dict(tree))
            raw = ck.restore(str(d), restore_args=args)
        except Exception as e:  # orbax / tensorstore errors on damaged files come in many types
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ModelLoadError(f"{path}: params/{part} cannot be read ({first}); the checkpoint is damaged: "
                                 f"convert it again") from None
        for name, spec in items:
            e = tensors.get(name)
            if e is None:
                raise ModelLoadError(f"{path}: the manifest has no tensor {name}, which this model needs: the "
                                     f"checkpoint and its config do not match")
            if not isinstance(e, dict) or ("fmt" in e and (e["fmt"] not in TENSOR_FORMATS
                                                           or not isinstance(e.get("arrays"), dict))):
                raise ModelLoadError(f"{path}: the manifest's entry for {name} is not usable: convert it again")
            if "fmt" in e:
                arrs = {k.rsplit(".", 1)[1]: jnp.asarray(_check(path, k, raw.get(_key(k)), {**ae, "part": part}))
                        for k, ae in e["arrays"].items()}
                try:
                    if e["fmt"] == "bf16p":
                        values[name] = Packed12(**arrs, shape=tuple(e["shape"]))
                    else:
                        more = tuple(arrs[f"more{i}"] for i in range(sum(k.startswith("more") for k in arrs)))
                        values[name] = QTensor(arrs["data"], arrs["scale"], arrs.get("zero"),
                                               arrs.get("tensor_scale"), e["fmt"], tuple(e["shape"]), more=more)
                except (KeyError, TypeError) as err:
                    raise ModelLoadError(f"{path}: {name} lacks its {err} array: convert it again") from None
                if e["fmt"] in GGML_FORMATS and len(values[name].arrays) != len(LAYOUT[e["fmt"]]):
                    raise ModelLoadError(f"{path}: {name} holds {len(values[name].arrays)} of the "
                                         f"{len(LAYOUT[e['fmt']])} arrays of a {e['fmt']} matrix: convert it again")
            else:
                a = _check(path, name, raw.get(_key(name)), e)
                values[name] = jnp.asarray(a, dtype=dtype if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype)
            if tuple(e["shape"]) != spec.shape:          # (_check has held each array to its entry)
                raise ModelLoadError(f"{path}: tensor {name} is {e['shape']}, the config needs {list(spec.shape)}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return jax.tree_util.tree_unflatten(treedef, [values[_name(p)] for p, _ in leaves])


__all__ = ["MANIFEST", "is_converted", "load_params", "read_manifest", "write_part"]
