"""Whole-block moves in the paged KV pool, for the prefix cache: read blocks out (to keep them in
host memory when the device evicts them), write blocks in (bring them back), and copy one block to
another (copy-on-write reuse of a partly matching block). Moves go in pieces of at most CHUNK
blocks, each padded to a power of two, so that a long-running server compiles a handful of shapes
and a long prefix wastes little on padding; padding ids point past the pool and are dropped on
writes."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .paged import PagedKV


CHUNK = 256


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pieces(n: int):
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


@jax.jit
def _gather(k, v, ids):
    # k[j] [nKV, P, bs, hd] -> [n, L, nKV, bs, hd]: block-major, so that each block is one
    # contiguous piece of host memory
    return tuple(jnp.stack([x[:, ids] for x in a], 1).transpose(2, 1, 0, 3, 4) for a in (k, v))


def read_blocks(kv: PagedKV, ids: list[int]) -> list:
    """[(k, v)] device arrays per piece of ids, each [n_padded, L, nKV, bs, hd]; row i of piece p
    is block ids[p * CHUNK + i]. The copies to the host start here and overlap the device's next work."""
    out = []
    for lo, hi in _pieces(len(ids)):
        idx = np.zeros((_bucket(hi - lo),), np.int32)
        idx[:hi - lo] = ids[lo:hi]
        k, v = _gather(kv.k, kv.v, idx)
        for a in (k, v):
            a.copy_to_host_async()
        out.append((k, v))
    return out


@partial(jax.jit, donate_argnames=("kv",))
def _scatter(kv: PagedKV, ids, k, v):
    # k, v [n, L, nKV, bs, hd] -> layer j's [nKV, n, bs, hd] at blocks ids
    def put(pool, new):
        return tuple(x.at[:, ids].set(new[:, j].swapaxes(0, 1).astype(x.dtype), mode="drop")
                     for j, x in enumerate(pool))
    return kv.replace(k=put(kv.k, k), v=put(kv.v, v))


def write_blocks(kv: PagedKV, ids: list[int], arrays) -> PagedKV:
    """Write host blocks into blocks ids; arrays(i) -> (k, v) [L, nKV, bs, hd] of block ids[i]. Each
    piece is gathered into one host buffer and sent in one transfer; kv is donated."""
    P = kv.num_blocks
    for lo, hi in _pieces(len(ids)):
        n = _bucket(hi - lo)
        idx = np.full((n,), P, np.int32)
        idx[:hi - lo] = ids[lo:hi]
        k0, _ = arrays(lo)
        k, v = np.empty((n, *k0.shape), k0.dtype), np.empty((n, *k0.shape), k0.dtype)   # padding rows: dropped
        for i in range(lo, hi):
            k[i - lo], v[i - lo] = arrays(i)
        kv = _scatter(kv, idx, k, v)
    return kv


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
