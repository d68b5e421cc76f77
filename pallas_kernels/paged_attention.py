"""Attention over a paged KV pool: references in pure jnp, plus the KV write.

Layouts (shared by the Pallas kernels in this package):
  k_pool, v_pool  [nKV, P, bs, hd]   P blocks of bs token slots, head-major so that one head's
                                     block is one contiguous [bs, hd] tile
  block_tables    [B, M] int32        block ids of each sequence, in order (unused entries: any id)
  kv_lens         [B] int32           tokens in each sequence's cache, including this step's
Ragged prefill: q [N, nH, hd] flat over the batch; cu_q [B + 1] int32 cumulative query counts.
Query t of sequence b sits at flat index cu_q[b] + t and at position kv_lens[b] - q_len[b] + t.
Decode: q [B, nH, hd], one query per sequence, at position kv_lens[b] - 1.
Draft trees (speculative decoding): tree_lo [B] int32, the slot index where row b's draft tree
begins (a large value: no tree), and anc [N] int32, each query's ancestors among its row's tree
nodes as bits (bit i: node i, its own bit set). A query then sees the slots before tree_lo and,
from tree_lo on, only its ancestors' (besides the causal limit): siblings written beside each
other in consecutive slots never see each other.
The references are jitted (inlined inside a model's step): called alone, each shape compiles once
rather than op by op."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import kv_bf16p, kv_quant


@jax.jit
def write_kv(k_pool, v_pool, k, v, slots):
    """k, v [N, nKV, hd] into the pools at flat slot ids [N] (block * bs + offset); ids out of range
    (padding tokens) are dropped. Scatter by (block, offset) without reshaping the pool: inside the
    multi-step decode loop XLA on the CPU copied the whole reshaped pool every step (14x slower)."""
    bs = k_pool.shape[2]
    blk, off = slots // bs, slots % bs
    kp = k_pool.at[:, blk, off].set(k.swapaxes(0, 1).astype(k_pool.dtype), mode="drop")
    vp = v_pool.at[:, blk, off].set(v.swapaxes(0, 1).astype(v_pool.dtype), mode="drop")
    return kp, vp


def _gather_seq(pool, block_tables, scale=None, fmt: str = "", dtype=None, esc=None):
    """pool [nKV, P, bs, hd], block_tables [B, M] -> ([B, M * bs, nKV, hd], None). A quantized pool
    (kv_quant: codes, scale [nKV, P, bs]) gives its codes' values in dtype and the rows' scales
    [B, M * bs, nKV]: the callers scale scores and probabilities, as the kernels do. A bf16p pool
    (kv_bf16p: codes, row bases in scale, escapes esc [nKV, P, E]) gives its exact bf16 values."""
    nKV, _, bs, _ = pool.shape
    B, M = block_tables.shape
    g = pool[:, block_tables]                                           # [nKV, B, M, bs, hd']
    rows = None
    if fmt == "bf16p":
        g = kv_bf16p.decode_rows(g, scale[:, block_tables], esc[:, block_tables])
    elif scale is not None:
        g = kv_quant.unscaled(g, fmt, dtype)
        rows = scale[:, block_tables].reshape(nKV, B, M * bs).transpose(1, 2, 0)
    return g.reshape(nKV, B, M * bs, g.shape[-1]).transpose(1, 2, 0, 3), rows


def _kv(k_pool, v_pool, block_tables, k_scale, v_scale, fmts, dtype, k_esc=None, v_esc=None):
    """Each sequence's keys and values [B, S, nKV, hd] and, for quantized pools, their row scales
    [B, S, nKV] (else None)."""
    fk, fv = fmts or ("", "")
    return (*_gather_seq(k_pool, block_tables, k_scale, fk, dtype, k_esc),
            *_gather_seq(v_pool, block_tables, v_scale, fv, dtype, v_esc))


def _by_key(x, rows):
    """x [B, nKV, ..., S] times rows [B, S, nKV] along S (None: x)."""
    if rows is None:
        return x
    r = rows.transpose(0, 2, 1)                                                    # [B, nKV, S]
    return x * r.reshape(r.shape[:2] + (1,) * (x.ndim - 3) + r.shape[2:])


@functools.partial(jax.jit, static_argnames=("scale", "fmts"))
def paged_decode_attention_reference(q, k_pool, v_pool, block_tables, kv_lens, scale=None, k_scale=None,
                                     v_scale=None, fmts=None, k_esc=None, v_esc=None):
    """q [B, nH, hd] -> [B, nH, hd]; each query sees its sequence's first kv_lens[b] slots.
    Quantized pools (kv_quant) come with k_scale, v_scale [nKV, P, bs] and their (key, value) formats;
    bf16p pools (kv_bf16p) with their row bases as k_scale, v_scale and escapes k_esc, v_esc."""
    B, nH, hd = q.shape
    nKV = k_pool.shape[0]
    scale = hd ** -0.5 if scale is None else scale
    K, ks, V, vs = _kv(k_pool, v_pool, block_tables, k_scale, v_scale, fmts, q.dtype, k_esc, v_esc)
    qg = q.reshape(B, nKV, nH // nKV, hd)
    s = _by_key(jnp.einsum("bkgd,bskd->bkgs", qg, K, preferred_element_type=jnp.float32), ks) * scale
    visible = jnp.arange(K.shape[1])[None, :] < kv_lens[:, None]                # [B, S]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    p = _by_key(jax.nn.softmax(s, axis=-1), vs)
    o = jnp.einsum("bkgs,bskd->bkgd", p.astype(V.dtype), V, preferred_element_type=jnp.float32)
    return o.reshape(B, nH, hd).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "fmts"))
def ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, kv_lens, cu_q, scale=None, k_scale=None,
                                     v_scale=None, fmts=None, k_esc=None, v_esc=None, multi_rows=None,
                                     tree_lo=None, anc=None):
    """q [N, nH, hd] -> [N, nH, hd], causal within each sequence. Rows past cu_q[B] are padding
    (their output is zero). Quantized pools: as paged_decode_attention_reference. tree_lo [B],
    anc [N]: draft trees (module doc; None: none).

    Costs B x N x S scores: every row is given all N query slots. multi_rows [Bp] int32 (ids of the
    rows that may hold several queries, padded with B; None: any row may) cuts that to Bp x N x S
    plus B x S: the other rows hold one query each and attend as decodes (a step of one prompt chunk
    beside seven decodes: 8x less work)."""
    kw = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, fmts=fmts, k_esc=k_esc, v_esc=v_esc)
    q_lens = cu_q[1:] - cu_q[:-1]                                                  # [B]
    if multi_rows is None:
        return _ragged_rows(q, k_pool, v_pool, block_tables, kv_lens, cu_q[:-1], q_lens, tree_lo=tree_lo, anc=anc,
                            **kw)
    N, B = q.shape[0], kv_lens.shape[0]
    last = jnp.clip(cu_q[1:] - 1, 0, N - 1)                                        # each row's last query
    one = paged_decode_attention_reference(q[last], k_pool, v_pool, block_tables, kv_lens, **kw)   # [B, nH, hd]
    out = jnp.zeros_like(q).at[jnp.where(q_lens == 1, last, N)].set(one, mode="drop")
    if multi_rows.shape[0]:
        sel, real = jnp.clip(multi_rows, 0, B - 1), multi_rows < B
        out = out + _ragged_rows(q, k_pool, v_pool, block_tables[sel], kv_lens[sel], cu_q[sel],
                                 jnp.where(real & (q_lens[sel] > 1), q_lens[sel], 0),
                                 tree_lo=None if tree_lo is None else tree_lo[sel], anc=anc, **kw)
    return out


def tree_visible(sidx, tree_lo, anc):
    """Which slots sidx [..., S] the queries of anc [...] (bits) see inside their row's tree from
    slot tree_lo [...] on (all slots before it). Shapes broadcast: [..., 1] against [..., S]."""
    rel = sidx - tree_lo
    bit = jax.lax.shift_right_logical(anc, jnp.clip(rel, 0, 31).astype(anc.dtype)) & 1
    return (rel < 0) | ((bit == 1) & (rel < 32))


SCORES_PER_TILE = 1 << 26      # the reference's scores per query tile (256 MiB of f32)
KEY_BLOCK = 4096               # ... and its keys per step when a pass goes in tiles


def _ragged_rows(q, k_pool, v_pool, block_tables, kv_lens, starts, q_lens, scale=None, k_scale=None,
                 v_scale=None, fmts=None, k_esc=None, v_esc=None, tree_lo=None, anc=None):
    """Rows b of q_lens[b] queries from flat index starts[b] (their K/V by block_tables [R, M],
    kv_lens [R]) -> [N, nH, hd] with their outputs (zero elsewhere). tree_lo [R], anc [N]: draft
    trees (module doc)."""
    N, nH, hd = q.shape
    B = kv_lens.shape[0]
    nKV = k_pool.shape[0]
    scale = hd ** -0.5 if scale is None else scale
    K, ks, V, vs = _kv(k_pool, v_pool, block_tables, k_scale, v_scale, fmts, q.dtype, k_esc, v_esc)
    S = K.shape[1]
    sidx = jnp.arange(S)

    def queries(t):
        """Queries t [T] of every row: (q [B, T, nKV, G, hd], positions [B, T], a function of key
        slots [Sk] -> the scores of those keys [B, nKV, G, T, Sk] from keys [B, Sk, nKV, hd] and
        their row scales, -inf where a query does not see the key)."""
        idx = starts[:, None] + t[None, :]                                         # [B, T]
        qp = q[jnp.clip(idx, 0, N - 1)].reshape(B, -1, nKV, nH // nKV, hd)          # [B, T, nKV, G, hd]
        pos = (kv_lens - q_lens)[:, None] + t[None, :]                             # [B, T]
        a = None if tree_lo is None else anc[jnp.clip(idx, 0, N - 1)]              # [B, T]

        def scores(sk, keys, key_scales):
            s = _by_key(jnp.einsum("btkgd,bskd->bkgts", qp, keys, preferred_element_type=jnp.float32),
                        key_scales) * scale
            visible = (sk[None, None, :] <= pos[:, :, None]) & (sk[None, None, :] < kv_lens[:, None, None])
            if a is not None:
                visible &= tree_visible(sk[None, None, :], tree_lo[:, None, None], a[:, :, None])
            return jnp.where(visible[:, None, None], s, -jnp.inf)
        return pos, scores

    def tile(t):
        """Queries t [T] of every row -> their outputs [B, T, nH, hd]."""
        _, scores = queries(t)
        s = scores(sidx, K, ks)
        p = jax.nn.softmax(s, axis=-1)
        p = _by_key(jnp.where(jnp.isnan(p), 0.0, p), vs)                           # (NaN: padded query rows)
        o = jnp.einsum("bkgts,bskd->btkgd", p.astype(V.dtype), V, preferred_element_type=jnp.float32)
        return o.reshape(B, -1, nH, hd).astype(q.dtype)

    KB = math.gcd(S, KEY_BLOCK)

    def tile_in_blocks(t):
        """tile(t), walking the keys KB at a time with an online softmax, and only as far as the
        tile's queries see (a tile of padding: no step at all)."""
        pos, scores = queries(t)
        seen = jnp.where(t[None, :] < q_lens[:, None], jnp.minimum(pos + 1, kv_lens[:, None]), 0)
        steps = (jnp.max(seen) + KB - 1) // KB

        def body(c):
            j, m, den, acc = c
            cut = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, j * KB, KB, axis=1)  # noqa: E731
            Kj, Vj, ksj, vsj = cut(K), cut(V), cut(ks), cut(vs)
            s = scores(j * KB + jnp.arange(KB), Kj, ksj)
            m_new = jnp.maximum(m, s.max(-1))                                      # [B, nKV, G, T]
            base = jnp.where(jnp.isinf(m_new), 0.0, m_new)
            p = jnp.exp(s - base[..., None])
            fade = jnp.exp(m - base)
            o = jnp.einsum("bkgts,bskd->bkgtd", _by_key(p, vsj).astype(V.dtype), Vj,
                           preferred_element_type=jnp.float32)
            return j + 1, m_new, den * fade + p.sum(-1), acc * fade[..., None] + o

        G = nH // nKV
        init = (jnp.int32(0), jnp.full((B, nKV, G, t.shape[0]), -jnp.inf, jnp.float32),
                jnp.zeros((B, nKV, G, t.shape[0]), jnp.float32), jnp.zeros((B, nKV, G, t.shape[0], hd), jnp.float32))
        _, _, den, acc = jax.lax.while_loop(lambda c: c[0] < steps, body, init)
        o = acc / jnp.where(den > 0, den, 1.0)[..., None]                          # [B, nKV, G, T, hd]
        return o.transpose(0, 3, 1, 2, 4).reshape(B, -1, nH, hd).astype(q.dtype)

    # the scores of T queries take B x nH x T x S floats: a wide pass (a long prompt's) goes T queries
    # at a time, so that memory stays bounded (T: a power of two dividing N, which the engine buckets),
    # each over the keys it sees only (a prompt's pass costs its causal half, not N x S)
    T = N
    while T > 1 and T % 2 == 0 and B * nH * T * S > SCORES_PER_TILE:
        T //= 2
    t = jnp.arange(N)
    if T == N:
        o = tile(t)
    else:
        o = jax.lax.map(tile_in_blocks, t.reshape(N // T, T))                      # [N / T, B, T, nH, hd]
        o = o.transpose(1, 0, 2, 3, 4).reshape(B, N, nH, hd)
    idx = starts[:, None] + t[None, :]                                             # [B, N]
    valid = t[None, :] < q_lens[:, None]
    dest = jnp.where(valid, idx, N)                                                # padding -> dropped
    return jnp.zeros_like(q).at[dest.reshape(-1)].set(o.reshape(B * N, nH, hd), mode="drop")
