"""The device side of the prefix cache, which only the engine's runner calls (engine/runner.py: it
replays each call on the other hosts of a multi-host run): whole-block moves in the paged KV pool
(read blocks out to keep them in host memory when the device evicts them, write blocks in to bring
them back, copy one block to another for copy-on-write reuse of a partly matching block), and
hybrids' state slots (a snapshot taken out of a sequence's slot, and written back into another).

Blocks move in pieces of a power-of-two number of blocks, at most CHUNK: a read of n blocks is
split by n's binary digits (300 = 256 + 32 + 8 + 4), so a piece kept in host memory holds no
padding, and a long-running server compiles a handful of shapes. A piece is block-major
[n, L, nKV, bs, hd], so one block is one contiguous row of it. Padding ids on writes point past
the pool and are dropped. A quantized pool's block (--kv-dtype) travels as bytes, [n, L, nKV, R]
uint8 with R = its codes' bytes and then its bs f32 scales': the tiers and the cache file keep
whatever arrays they are given, so the scale moves with its block without their knowing."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..models.kv_pool import PagedKV
from .host_memory import to_device, to_host
from .snapshots import StateSnapshot


CHUNK = 256


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def exact_pieces(n: int):
    """(lo, hi) covering range(n) with power-of-two lengths of at most CHUNK, largest first."""
    lo = 0
    while lo < n:
        size = min(CHUNK, 1 << ((n - lo).bit_length() - 1))
        yield lo, lo + size
        lo += size


def host_block_layout(cfg, block_size: int, dtype, kv_dtype: str = ""):
    """-> (k shape, v shape, dtype) of one block as read_blocks hands it to the host tiers:
    [L, nKV, bs, hd] in the model dtype, or quantized [L, nKV, R] uint8 (codes, then scales)."""
    from pallas_kernels import kv_quant
    from ..models.kv_pool import KV_DTYPES, num_kv_layers
    L, nKV = num_kv_layers(cfg), cfg.num_kv_heads
    if not kv_dtype:
        return (L, nKV, block_size, cfg.head_dim), (L, nKV, block_size, cfg.head_dim), np.dtype(dtype)
    if kv_dtype == "bf16p":                  # codes, row bases, the block's escapes
        from pallas_kernels import kv_bf16p
        R = block_size * (kv_bf16p.code_dims(cfg.head_dim) + 4) + 4 * kv_bf16p.ESCAPES
        return (L, nKV, R), (L, nKV, R), np.dtype(np.uint8)
    k, v = ((L, nKV, block_size * (kv_quant.code_dims(f, cfg.head_dim) * jnp.dtype(kv_quant.code_dtype(f)).itemsize + 4))
            for f in KV_DTYPES[kv_dtype])
    return k, v, np.dtype(np.uint8)


def _to_bytes(codes, scale, esc=None):
    """codes [nKV, n, bs, hd'], scale [nKV, n, bs] (bf16p: and escapes [nKV, n, E]) -> [nKV, n, R]
    uint8 (codes' bytes, then the scales', then the escapes')."""
    nKV, n, _ = scale.shape
    parts = [jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(nKV, n, -1),        # 1-byte codes
             jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(nKV, n, -1)]        # [nKV, n, bs * 4]
    if esc is not None:
        parts.append(jax.lax.bitcast_convert_type(esc, jnp.uint8).reshape(nKV, n, -1))
    return jnp.concatenate(parts, axis=-1)


def _from_bytes(b, like, escapes: int = 0):
    """[nKV, n, R] uint8 -> (codes [nKV, n, bs, hd'] in like's dtype, scale [nKV, n, bs] f32,
    escapes [nKV, n, E] int32 or None); like: the pool."""
    nKV, n, _ = b.shape
    bs = like.shape[2]
    nc = int(np.prod(like.shape[2:]))
    codes = jax.lax.bitcast_convert_type(b[..., :nc].reshape(nKV, n, *like.shape[2:]), like.dtype)
    scale = jax.lax.bitcast_convert_type(b[..., nc:nc + 4 * bs].reshape(nKV, n, bs, 4), jnp.float32)
    esc = None
    if escapes:
        esc = jax.lax.bitcast_convert_type(b[..., nc + 4 * bs:].reshape(nKV, n, escapes, 4), jnp.int32)
    return codes, scale, esc


@partial(jax.jit, static_argnames=("whole",))
def _gather(kv: PagedKV, ids, whole=None):
    # k[j] [nKV, P, bs, hd] -> [n, L, nKV, bs, hd]; quantized: [n, L, nKV, R] bytes. whole: a
    # sharding the result is gathered into (several hosts: every process holds all of it)
    if kv.k_scale:                 # a quantized pool (--kv-dtype): its blocks travel as bytes
        esc = lambda e, j: None if not e else e[j][:, ids]  # noqa: E731
        out = tuple(jnp.stack([_to_bytes(x[:, ids], s[:, ids], esc(e, j)) for j, (x, s) in enumerate(zip(a, sc))],
                              1).transpose(2, 1, 0, 3)
                    for a, sc, e in ((kv.k, kv.k_scale, kv.k_esc), (kv.v, kv.v_scale, kv.v_esc)))
    else:
        out = tuple(jnp.stack([x[:, ids] for x in a], 1).transpose(2, 1, 0, 3, 4) for a in (kv.k, kv.v))
    return out if whole is None else jax.lax.with_sharding_constraint(out, whole)


def whole(kv: PagedKV):
    """The replicated sharding of kv's mesh when it spans several processes (each then keeps a
    whole copy of what is read out: the leader's is the one the host tiers keep), else None."""
    x = kv.k[0]
    if x.is_fully_addressable:
        return None
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(x.sharding.mesh, PartitionSpec())


def read_blocks(kv: PagedKV, ids: list[int], keep: bool = True) -> list:
    """[(k, v, lo, hi)] per piece: blocks ids[lo:hi] as [hi - lo, L, nKV, bs, hd] arrays in host
    memory (quantized KV: [hi - lo, L, nKV, R] uint8, see host_block_layout). The copies are
    started here and overlap the device's next work. keep=False: left on the device (a follower
    of several hosts, which only joins the gather)."""
    out, w = [], whole(kv)
    for lo, hi in exact_pieces(len(ids)):
        k, v = _gather(kv, np.asarray(ids[lo:hi], np.int32), whole=w)
        if keep:
            k, v = to_host((k, v))
        out.append((k, v, lo, hi))
    return out


@partial(jax.jit, donate_argnames=("kv",))
def _scatter(kv: PagedKV, k, v, rows, dst):
    # rows of k, v [n, L, nKV, bs, hd] -> layer j's [nKV, P, bs, hd] at blocks dst (past P: dropped)
    if kv.k_scale:                 # a quantized pool (--kv-dtype): its blocks travel as bytes
        E = kv.k_esc[0].shape[-1] if kv.k_esc else 0

        def put_q(pool, scales, escs, new):
            out = [_from_bytes(new[rows][:, j].swapaxes(0, 1), x, E) for j, x in enumerate(pool)]
            put = lambda arrays, i: tuple(x.at[:, dst].set(o[i], mode="drop") for x, o in zip(arrays, out))  # noqa: E731
            return put(pool, 0), put(scales, 1), (put(escs, 2) if E else escs)
        (kk, ks, ke), (vv, vs, ve) = put_q(kv.k, kv.k_scale, kv.k_esc, k), put_q(kv.v, kv.v_scale, kv.v_esc, v)
        return kv.replace(k=kk, v=vv, k_scale=ks, v_scale=vs, k_esc=ke, v_esc=ve)

    def put(pool, new):
        new = new[rows]
        return tuple(x.at[:, dst].set(new[:, j].swapaxes(0, 1).astype(x.dtype), mode="drop")
                     for j, x in enumerate(pool))
    return kv.replace(k=put(kv.k, k), v=put(kv.v, v))


def write_rows(kv: PagedKV, k, v, rows: list[int], dst: list[int]) -> PagedKV:
    """Write rows of one piece (k, v [n, L, nKV, bs, hd] or quantized [n, L, nKV, R] uint8, n a
    power of two, in host memory or numpy) into blocks dst; the piece goes to the device in one transfer. kv is donated."""
    n, P = k.shape[0], kv.num_blocks
    assert n == _bucket(n) and len(rows) == len(dst) <= n, (n, len(rows))
    r, d = np.zeros((n,), np.int32), np.full((n,), P, np.int32)
    r[:len(rows)], d[:len(dst)] = rows, dst
    k, v = to_device((k, v), kv.k[0])
    return _scatter(kv, k, v, r, d)


def stack_pieces(blocks: list) -> list:
    """Group host blocks ((k, v) numpy [L, nKV, bs, hd] or quantized [L, nKV, R] each) into numpy
    pieces for write_rows:
    [(k, v, lo, hi)], each piece padded to a power of two rows."""
    out = []
    for lo in range(0, len(blocks), CHUNK):
        hi = min(len(blocks), lo + CHUNK)
        k0, v0 = blocks[lo]                   # (quantized K8V4 blocks: k and v rows of other sizes)
        n = _bucket(hi - lo)
        k, v = np.empty((n, *k0.shape), k0.dtype), np.empty((n, *v0.shape), v0.dtype)
        for i in range(lo, hi):
            k[i - lo], v[i - lo] = blocks[i]
        out.append((k, v, lo, hi))
    return out


@partial(jax.jit, donate_argnames=("kv",))
def _copy(kv: PagedKV, src, dst):
    move = lambda arrays: tuple(x.at[:, dst].set(x[:, src], mode="drop") for x in arrays)  # noqa: E731
    return kv.replace(k=move(kv.k), v=move(kv.v), k_scale=move(kv.k_scale), v_scale=move(kv.v_scale),
                      k_esc=move(kv.k_esc), v_esc=move(kv.v_esc))


def copy_blocks(kv: PagedKV, pairs: list[tuple[int, int]]) -> PagedKV:
    """Copy block src to block dst for each (src, dst); kv is donated. At least 16 pairs a call
    (padding copies nowhere): one compiled shape for what a step admits."""
    n, P = _bucket(max(len(pairs), 16)), kv.num_blocks
    src, dst = np.zeros((n,), np.int32), np.full((n,), P, np.int32)
    for i, (s, d) in enumerate(pairs):
        src[i], dst[i] = s, d
    return _copy(kv, src, dst)


# ---- hybrids' state slots --------------------------------------------------------------------------
@partial(jax.jit, static_argnames=("whole",))
def _gather_slot(conv, ssm, slot, whole=None):
    out = tuple(c[slot] for c in conv), tuple(s[slot] for s in ssm)
    return out if whole is None else jax.lax.with_sharding_constraint(out, whole)


@partial(jax.jit, donate_argnames=("kv",))
def _scatter_slot(kv: PagedKV, slot, conv, ssm):
    return kv.replace(conv=tuple(c.at[slot].set(x.astype(c.dtype)) for c, x in zip(kv.conv, conv)),
                      ssm=tuple(s.at[slot].set(x) for s, x in zip(kv.ssm, ssm)))


def take_snapshot(kv: PagedKV, slot: int, num_tokens: int, keep: bool = True) -> StateSnapshot:
    """A copy of the state in `slot`, which holds the first num_tokens tokens, on its way to host
    memory (the copy overlaps the device's next work; keep=False: left on the device, as
    read_blocks)."""
    conv, ssm = _gather_slot(kv.conv, kv.ssm, jnp.int32(slot), whole=whole(kv))
    if keep:
        conv, ssm = to_host((conv, ssm))
    return StateSnapshot(conv, ssm, num_tokens)


def restore_snapshot(kv: PagedKV, slot: int, snap: StateSnapshot) -> PagedKV:
    """Write a snapshot (host arrays or numpy) into `slot`; kv is donated: use the returned one."""
    if len(snap.conv) != len(kv.conv) or any(a.shape != c.shape[1:] for a, c in zip(snap.conv, kv.conv)) \
            or any(a.shape != s.shape[1:] for a, s in zip(snap.ssm, kv.ssm)):
        raise ValueError("the snapshot does not match this model's state shapes")
    conv, ssm = to_device((snap.conv, snap.ssm), kv.conv[0])
    return _scatter_slot(kv, jnp.int32(slot), conv, ssm)
