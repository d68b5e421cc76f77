"""Whole-block moves in the paged KV pool, for the prefix cache: read blocks out (to keep them in
host memory when the device evicts them), write blocks in (bring them back), and copy one block to
another (copy-on-write reuse of a partly matching block). Block counts are padded to powers of two
so that a long-running server compiles a handful of shapes; padding ids point past the pool and
are dropped on writes."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .paged import PagedKV


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@jax.jit
def _gather(k, v, ids):
    # k[j] [nKV, P, bs, hd] -> [L, nKV, n, bs, hd]
    return jnp.stack([x[:, ids] for x in k]), jnp.stack([x[:, ids] for x in v])


def read_blocks(kv: PagedKV, ids: list[int]):
    """Device arrays (k, v), each [L, nKV, n_padded, bs, hd]; column i is block ids[i]. The copy to
    the host is started here and overlaps whatever the device does next."""
    n = _bucket(len(ids))
    idx = np.zeros((n,), np.int32)
    idx[:len(ids)] = ids
    k, v = _gather(kv.k, kv.v, idx)
    for a in (k, v):
        a.copy_to_host_async()
    return k, v


@partial(jax.jit, donate_argnames=("kv",))
def _scatter(kv: PagedKV, ids, k, v):
    return kv.replace(k=tuple(x.at[:, ids].set(y.astype(x.dtype), mode="drop") for x, y in zip(kv.k, k)),
                      v=tuple(x.at[:, ids].set(y.astype(x.dtype), mode="drop") for x, y in zip(kv.v, v)))


def write_blocks(kv: PagedKV, ids: list[int], k: np.ndarray, v: np.ndarray) -> PagedKV:
    """Write host blocks k, v [L, nKV, n, bs, hd] into blocks ids (one transfer); kv is donated."""
    n, P = _bucket(len(ids)), kv.num_blocks
    idx = np.full((n,), P, np.int32)
    idx[:len(ids)] = ids
    if n > len(ids):
        pad = [(0, 0)] * k.ndim
        pad[2] = (0, n - len(ids))
        k, v = np.pad(k, pad), np.pad(v, pad)
    return _scatter(kv, idx, k, v)


@partial(jax.jit, donate_argnames=("kv",))
def _copy(kv: PagedKV, src, dst):
    return kv.replace(k=tuple(x.at[:, dst].set(x[:, src], mode="drop") for x in kv.k),
                      v=tuple(x.at[:, dst].set(x[:, src], mode="drop") for x in kv.v))


def copy_blocks(kv: PagedKV, pairs: list[tuple[int, int]]) -> PagedKV:
    """Copy block src to block dst for each (src, dst); kv is donated."""
    n, P = _bucket(len(pairs)), kv.num_blocks
    src, dst = np.zeros((n,), np.int32), np.full((n,), P, np.int32)
    for i, (s, d) in enumerate(pairs):
        src[i], dst[i] = s, d
    return _copy(kv, src, dst)
