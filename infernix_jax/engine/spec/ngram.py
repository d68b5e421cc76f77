"""Prompt lookup: the n-gram drafter. Agents copy (a file re-emitted with an edit, tool output
quoted back, code echoed from the prompt), so the text that followed the latest earlier
occurrence of a sequence's last few tokens is a good guess at what comes next.

`propose` finds the longest suffix of the sequence (up to max_n tokens, at least min_n) that
occurs earlier in its prompt and output, and proposes the k tokens that followed its latest
occurrence. With tree_nodes > 0 it gathers the continuations of the latest occurrences of that
suffix (up to tree_nodes of them: two versions of a file, the same line followed by different text)
into one tree, latest first, so that one round verifies them all. numpy over the token array: no
index to keep up to date.

`propose_device` and `propose_tree_device` are the same lookups in jnp, for the rounds that run on
the device one after another inside one dispatch (steps.spec_steps): the same drafts as `propose`
over a padded history."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .draft import MAX_NODES, Draft

LONG = 4            # a match of this many tokens or more counts as long (its own acceptance statistics)


def matches(ids: np.ndarray, min_n: int, max_n: int) -> tuple[int, np.ndarray]:
    """(n, ends): the longest suffix length n in [min_n, max_n] of ids that occurs earlier, and the
    indices just past each earlier occurrence (ascending); (0, []) when none does."""
    L = len(ids)
    if L < min_n + 1:
        return 0, np.zeros(0, np.int64)
    ends = np.flatnonzero(ids[:-1] == ids[-1]) + 1          # occurrences of the last token, ending before L
    best_n, best = 0, ends[:0]
    n = 1
    while len(ends) and n <= max_n:
        if n >= min_n:
            best_n, best = n, ends
        if n == max_n:
            break
        ok = ends - n - 1 >= 0
        ends = ends[ok]
        ends = ends[ids[ends - n - 1] == ids[L - n - 1]]
        n += 1
    return best_n, best


def propose(ids: np.ndarray, k: int, min_n: int = 2, max_n: int = 8, tree_nodes: int = 0) -> Draft | None:
    """A draft of up to k tokens deep (a chain, or with tree_nodes a tree of at most that many
    nodes) for the sequence ids [L]; None when no suffix of min_n tokens recurs."""
    n, ends = matches(ids, min_n, max_n)
    if not n:
        return None
    L = len(ids)
    kind = _kind("ngram", n, max_n)
    if not tree_nodes:
        e = int(ends[-1])
        toks = ids[e:min(e + k, L)]
        return Draft.chain(toks.tolist(), kind=kind) if len(toks) else None
    cap = min(tree_nodes, MAX_NODES)
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}       # (parent, token) -> node
    for e in ends[::-1][:cap]:          # the latest occurrence first: it is the main chain (the device
                                        # looks up as many occurrences as nodes: propose_tree_device)
        parent = -1
        for t in ids[int(e):min(int(e) + k, L)].tolist():
            node = children.get((parent, t))
            if node is None:
                if len(tokens) >= cap:
                    break
                node = children[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            parent = node
        if len(tokens) >= cap:
            break
    return Draft(tokens, parents, "tree", _kind("tree", n, max_n)) if tokens else None


def _runs(hist, hlen, min_n: int, max_n: int):
    """hist [B, L], hlen [B] -> (run [B, L - 1]: how many tokens before p + 1 match the row's suffix,
    up to max_n, for an occurrence ending at p, whose continuation starts at p + 1; n [B]: the longest
    match, 0 below min_n)."""
    B, L = hist.shape
    b = jnp.arange(B)[:, None]
    p = jnp.arange(L - 1)[None]
    run = jnp.zeros((B, L - 1), jnp.int32)
    live = p + 1 < hlen[:, None]                 # (the continuation starts inside the history)
    for i in range(max_n):
        tail = hist[b[:, 0], jnp.clip(hlen - 1 - i, 0, L - 1)][:, None]
        ok = (p - i >= 0) & (hlen[:, None] - 1 - i >= 0) & (hist[b, jnp.clip(p - i, 0, L - 1)] == tail)
        live = live & ok
        run = run + live
    n = run.max(axis=1)                          # (at most max_n)
    return run, jnp.where(n >= min_n, n, 0)


def propose_device(hist, hlen, k: int, min_n: int = 2, max_n: int = 8):
    """propose's chain on the device: hist [B, L] int32 (each row's prompt and output, padded),
    hlen [B] its length -> (draft [B, k] int32, padded with -1, a token no draw equals; n [B]: the
    length of the suffix match behind it, 0 for none). O(L * max_n) compares a row: a few
    microseconds against a decoder step."""
    B, L = hist.shape
    b = jnp.arange(B)[:, None]
    run, n = _runs(hist, hlen, min_n, max_n)
    p = jnp.arange(L - 1)[None]
    end = jnp.max(jnp.where((run >= n[:, None]) & (n[:, None] > 0), p, -1), axis=1)     # the latest
    at = end[:, None] + 1 + jnp.arange(k)[None]
    draft = jnp.where((end[:, None] >= 0) & (at < hlen[:, None]), hist[b, jnp.clip(at, 0, L - 1)], -1)
    return draft.astype(jnp.int32), n


def propose_tree_device(hist, hlen, k: int, nodes: int, min_n: int = 2, max_n: int = 8):
    """propose's tree on the device (tree_nodes = nodes <= MAX_NODES, depth k): hist [B, L], hlen
    [B] -> (tok [B, nodes] int32: the nodes in propose's order, -1 padding; par [B, nodes]: the
    parent node, -1 for the root's children, -2 padding; dep [B, nodes]: depth, 1 for the root's
    children, 0 padding; anc [B, nodes] int32 ancestor bits as Draft.ancestors). The `nodes` latest
    occurrences' continuations [T, k] are merged by shared prefix: a continuation's token at depth
    d is a node of its own unless an earlier (later-occurring) one has the same first d + 1 tokens."""
    B, L = hist.shape
    T = nodes
    b = jnp.arange(B)
    run, n = _runs(hist, hlen, min_n, max_n)
    p = jnp.arange(L - 1)[None]
    ends = jax.lax.top_k(jnp.where((run >= n[:, None]) & (n[:, None] > 0), p, -1), T)[0]   # [B, T], latest first
    at = ends[:, :, None] + 1 + jnp.arange(k)[None, None]                                   # [B, T, k]
    ok = (ends[:, :, None] >= 0) & (at < hlen[:, None, None])
    cand = jnp.where(ok, hist[b[:, None, None], jnp.clip(at, 0, L - 1)], -1)
    # same[b, t, u, d]: occurrences t and u agree on their first d + 1 tokens (both present)
    eq = (cand[:, :, None] == cand[:, None]) & ok[:, :, None] & ok[:, None]
    same = jnp.cumprod(eq.astype(jnp.int32), axis=-1) > 0                                    # [B, T, T, k]
    first = jnp.argmax(same, axis=2)                                                          # [B, T, k]
    new = ok & (first == jnp.arange(T)[None, :, None])
    idx = (jnp.cumsum(new.reshape(B, -1), axis=1) - 1).reshape(B, T, k)    # occurrence-major order
    keep = new & (idx < nodes)
    # every present token's node: its own, or that of the earlier occurrence it shares a prefix with
    node = jnp.take_along_axis(idx.reshape(B, -1), (first * k + jnp.arange(k)[None, None]).reshape(B, -1),
                               axis=1).reshape(B, T, k)
    par = jnp.concatenate([jnp.full((B, T, 1), -1, node.dtype), node[:, :, :-1]], axis=2)
    bits = jnp.where(ok & (node < nodes), jnp.left_shift(jnp.uint32(1), jnp.clip(node, 0, 31).astype(jnp.uint32)),
                     jnp.uint32(0))
    anc = jax.lax.bitcast_convert_type(jnp.cumsum(bits, axis=2, dtype=jnp.uint32), jnp.int32)  # (distinct bits)
    dest = jnp.where(keep, idx, nodes).reshape(B, -1)                                        # (nodes: dropped)
    rows = b[:, None]

    def put(fill, x):
        return jnp.full((B, nodes), fill, jnp.int32).at[rows, dest].set(x.reshape(B, -1).astype(jnp.int32),
                                                                          mode="drop")
    dep = jnp.broadcast_to(jnp.arange(1, k + 1)[None, None], (B, T, k))
    return put(-1, cand), put(-2, par), put(0, dep), put(0, anc)


def _kind(method: str, n: int, max_n: int) -> str:
    """The acceptance statistics' key of a draft from an n-token match: a match of the whole window
    is most likely a copy going on, a short one often chance."""
    return f"{method}-{'short' if n < LONG else 'full' if n >= max_n else 'mid'}"


__all__ = ["matches", "propose", "propose_device", "propose_tree_device"]
