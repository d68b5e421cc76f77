from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ..models.params import ParamSpec


from ..errors import ModelLoadError  # noqa: F401  (re-exported: where the loaders raise it)


def materialize(specs, fetch: Callable[[ParamSpec], np.ndarray], dtype, desc: str = "loading",
                keep: Callable[[ParamSpec], object] | None = None, place: Callable | None = None):
    """Fill the spec tree with device arrays: fetch(spec) returns a float numpy array of spec.shape.
    keep(spec), where given, may return a pytree of numpy arrays to hold as it is instead (a
    quantized matrix kept in its stored format) or None to fetch. place(name, array in dtype), where
    given, puts each fetched tensor on the devices (its shards straight from host memory: a model
    split over several devices never sits whole on one); name: its key in the params tree."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    out = []
    for path, spec in tqdm(paths, desc=desc, unit="tensor", leave=False, disable=None):
        kept = keep(spec) if keep else None
        if kept is not None:
            out.append(jax.tree.map(jnp.asarray, kept))
            continue
        arr = fetch(spec)
        if tuple(arr.shape) != spec.shape:
            raise ModelLoadError(f"tensor {spec.hf} has shape {tuple(arr.shape)}, expected {spec.shape} "
                                 f"from the config; the checkpoint and its config do not match")
        if place is not None:
            name = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)), "")
            out.append(place(name, np.asarray(arr).astype(dtype)))
        else:
            out.append(jnp.asarray(arr, dtype=dtype))
    return jax.tree.unflatten(treedef, out)
