"""Quantizing a loaded model's weights (`--weights FMT`): the projections every token multiplies by
(attention, MLP, Gated DeltaNet, shared experts) become QTensors; so do the routed MoE experts
([E, O, I] stacks, multiplied by the grouped expert kernel on the Pallas route, else dequantized by
XLA after the gather in models/moe.py; bf16p leaves them as they are). Embeddings, the LM head,
norms, routers and the small per-head vectors stay as they are."""
from __future__ import annotations

import jax
import numpy as np
from tqdm import tqdm

from .formats import QTensor, nominal_bits, quantize
from .packed import Packed12, pack

_quantize = jax.jit(quantize, static_argnums=1)


def quantized_names(p: dict, fmt: str) -> set:
    """The weights of one layer's params that format fmt quantizes (their roles: models/roles.py)."""
    from ..models.roles import EXPERTS, QUANTIZABLE      # (here: the models package imports this module)
    return (QUANTIZABLE | (EXPERTS if fmt != "bf16p" else frozenset())) & p.keys()


def quantize_layer(p: dict, fmt: str) -> dict:
    """A copy of one layer's params with its quantizable matrices (and routed experts) in format
    fmt (bf16p: the matrices packed)."""
    q = dict(p)
    for name in quantized_names(q, fmt):
        if not isinstance(q[name], (QTensor, Packed12)):
            q[name] = pack(q[name]) if fmt == "bf16p" else _quantize(q[name], fmt)
    return q


def map_layers(params: dict, fn, in_place: bool, progress=lambda it: it) -> dict:
    """params with each layer p replaced by fn(p), one at a time (in_place: in params' own list, so
    no layer's old form outlives its replacement; a tuple of layers is copied to a list first)."""
    layers = params["layers"] if in_place and isinstance(params["layers"], list) else list(params["layers"])
    for i in progress(range(len(layers))):
        layers[i] = fn(layers[i])
    if in_place:
        params["layers"] = layers
        return params
    return {**params, "layers": layers}


def quantize_params(params: dict, fmt: str, progress: bool = True, in_place: bool = False) -> dict:
    """params with each layer's quantizable matrices in format fmt, one layer at a time. in_place
    (the loader's): each layer replaced as it is quantized, so the peak is one layer's worth of
    both forms; else a copy beside the original."""
    what = "packing weights to 12 bits (bf16p)" if fmt == "bf16p" else f"quantizing weights to {fmt}"
    bar = lambda it: tqdm(it, desc=what, unit="layer", disable=not progress)  # noqa: E731
    return map_layers(params, lambda p: quantize_layer(p, fmt), in_place, bar)


def planned_bytes(abstract: dict, itemsize: int, fmt: str = "", sizes: dict | None = None,
                  units: dict | None = None) -> int:
    """Device bytes of a model's weights (abstract shapes) with its projections in format fmt; with
    sizes (a mesh's axis sizes, sharding.Parallel.sizes; units: sharding.units_of(cfg)): one
    device's share."""
    from ..sharding import split_factor

    def walk(tree, name: str = "", quant: frozenset = frozenset()) -> int:
        if isinstance(tree, dict):
            return sum(walk(v, k, quant) for k, v in tree.items())
        if isinstance(tree, (list, tuple)):
            return sum(walk(v, name, quant) for v in tree)
        n = int(np.prod(tree.shape))
        b = int(n * nominal_bits(fmt) / 8) if name in quant else n * itemsize
        return b // split_factor(name, tuple(tree.shape), sizes, units)
    layers = sum(walk(p, quant=quantized_names(p, fmt) if fmt else frozenset()) for p in abstract["layers"])
    return layers + walk({k: v for k, v in abstract.items() if k != "layers"})
