"""Fusing the projections that read the same input into one matrix at load: q, k and v into `wqkv`
(their biases into `bqkv`), gate and up into `w_gate_up` (a MoE layer's shared expert: `s_gate_up`).

One product instead of three (or two) per layer: at decode every product is a kernel launch whose
tail leaves SMs idle and whose K-split partial sums are added by one more small kernel, and the
small k/v products (a quarter of q's rows) never fill the GPU alone. Their rows are concatenated
([out, in] layout: rows are outputs), so the model splits the one output by the parts' row counts.

Weights are fused as they are stored: plain arrays, QTensors of one format whose every array keeps
one row (or one row block) per output (concatenated array by array), or lossless 12-bit packed
matrices (each row keeps its part's exponent window). A bf16p model so has the plain BF16 model's
products, shape for shape, which keeps its output bit for bit the same. Where the parts cannot be fused (say a GGUF file that stores
v in another type than q and k, or nvfp4 parts with their own tensor scales) they stay apart and the
model multiplies them one by one: the output is the same either way. Tensor parallelism splits
heads and FFN columns per device, so sharded models will need the parts fused per shard instead."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..quant.apply import map_layers
from ..quant.formats import QTensor
from ..quant.packed import Packed12

from .roles import BIAS, FUSED        # the groups (declared with each weight's role)


def concat_rows(ws: list):
    """The parts' rows in one weight of the parts' kind, or None where that kind cannot hold them."""
    if all(isinstance(w, (jax.Array, np.ndarray)) for w in ws):
        same = len({(w.dtype, tuple(w.shape[1:])) for w in ws}) == 1
        return jnp.concatenate([jnp.asarray(w) for w in ws], axis=0) if same else None
    if all(isinstance(w, QTensor) for w in ws):
        return _concat_q(ws)
    if all(isinstance(w, Packed12) for w in ws):
        return _concat_packed(ws)
    return None


def _concat_q(ws: list[QTensor]) -> QTensor | None:
    w0 = ws[0]
    if len({(w.fmt, w.shape[1:], len(w.more)) for w in ws}) > 1 or len(w0.shape) != 2:
        return None
    if w0.tensor_scale is not None:       # nvfp4: one scale over each whole part
        return None
    if w0.fmt == "fp8b" and any(w.shape[0] % 128 for w in ws):    # scales per 128-row block
        return None
    cat = lambda arrs: None if arrs[0] is None else jnp.concatenate(arrs, axis=0)  # noqa: E731
    return w0.replace(data=cat([w.data for w in ws]), scale=cat([w.scale for w in ws]),
                      zero=cat([w.zero for w in ws]),
                      more=tuple(cat(list(a)) for a in zip(*(w.more for w in ws))),
                      shape=(sum(w.shape[0] for w in ws), w0.shape[1]))


def _concat_packed(ws: list[Packed12]) -> Packed12 | None:
    """Parts with one exponent window keep their scalar base; else each row gets its part's."""
    if len({w.shape[1:] for w in ws}) > 1 or len(ws[0].shape) != 2:
        return None
    I = ws[0].shape[1]
    starts = np.cumsum([0] + [w.shape[0] * I for w in ws[:-1]])    # flat index of each part's first weight
    bases = [jnp.broadcast_to(w.base.reshape(-1, 1), (w.shape[0], 1)) for w in ws]
    one = all(w.base.ndim == 0 for w in ws) and len({int(w.base) for w in ws}) == 1
    return Packed12(lo=jnp.concatenate([w.lo for w in ws]), codes=jnp.concatenate([w.codes for w in ws]),
                    base=ws[0].base if one else jnp.concatenate(bases).astype(jnp.int32),
                    esc_idx=jnp.concatenate([w.esc_idx + int(s) for w, s in zip(ws, starts)]).astype(jnp.int32),
                    esc_val=jnp.concatenate([w.esc_val for w in ws]),
                    shape=(sum(w.shape[0] for w in ws), I))


def fuse_layer(p: dict) -> dict:
    """One layer's params with each complete group of FUSED parts in one weight where they fuse
    (their biases too: a group whose biases do not fuse stays apart)."""
    p = dict(p)
    for name, parts in FUSED.items():
        if not all(n in p for n in parts):
            continue
        bname, bparts = BIAS.get(name, ("", ()))
        biased = bool(bparts) and all(b in p for b in bparts)
        w = concat_rows([p[n] for n in parts])
        b = concat_rows([p[n] for n in bparts]) if biased and w is not None else None
        if w is None or (biased and b is None):
            continue
        for n in parts + (bparts if biased else ()):
            del p[n]
        p[name] = w
        if biased:
            p[bname] = b
    return p


def fuse_params(params: dict, in_place: bool = False) -> dict:
    """params with every layer's projections fused where they can be. in_place (the loader's: no
    one else holds the params): each layer is replaced as it is fused, so its parts go at once and
    the peak is one layer's parts beside their fused copy; else a copy."""
    return map_layers(params, fuse_layer, in_place)


def split_rows(y, sizes: tuple):
    """y [..., sum(sizes)] -> the parts' outputs [..., size] for each size."""
    return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)


__all__ = ["concat_rows", "fuse_layer", "fuse_params", "split_rows"]
