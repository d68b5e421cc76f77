from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ..models.params import ParamSpec


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the problem and the fix."""


def materialize(specs, fetch: Callable[[ParamSpec], np.ndarray], dtype, desc: str = "loading",
                keep: Callable[[ParamSpec], object] | None = None):
    """Fill the spec tree with device arrays: fetch(spec) returns a float numpy array of spec.shape.
    keep(spec), where given, may return a pytree of numpy arrays to hold as it is instead (a
    quantized matrix kept in its stored format) or None to fetch."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    out = []
    for spec in tqdm(leaves, desc=desc, unit="tensor", leave=False, disable=None):
        kept = keep(spec) if keep else None
        if kept is not None:
            out.append(jax.tree.map(jnp.asarray, kept))
            continue
        arr = fetch(spec)
        if tuple(arr.shape) != spec.shape:
            raise ModelLoadError(f"tensor {spec.hf} has shape {tuple(arr.shape)}, expected {spec.shape} "
                                 f"from the config; the checkpoint and its config do not match")
        out.append(jnp.asarray(arr, dtype=dtype))
    return jax.tree.unflatten(treedef, out)
