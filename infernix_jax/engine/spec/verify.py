"""The device side of a verify step: which draft tokens the target model agrees with.

Every sampled position draws its token exactly as plain decoding would at that output index (the
request's key folded with the index, the Gumbel-max draw of sampler.py), so a draft token is
accepted when it equals the target's own draw there. For a drafter that proposes tokens (not
distributions) that is rejection sampling: a token d is kept with probability p(d), and on a
rejection the target's draw is distributed as p without d. The output is the very sequence plain
decoding gives: greedy or seeded, with or without speculation, token for token."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DraftArrays:
    """A verify step's drafts, D node slots per row: tok [B, D], par [B, D] (-1: a child of the
    row's last known token, -2: padding, else the parent node's index)."""
    tok: jax.Array
    par: jax.Array


def node_states(open0, drafts: DraftArrays, after):
    """A per-row state (the thinking guard's open flag, [B]) at the root and after each node's
    token, following the tree: -> [B, 1 + D], the root's first. after(state, tok) -> state."""
    B, D = drafts.tok.shape
    b = jnp.arange(B)
    states = jnp.zeros((B, D), open0.dtype)
    for i in range(D):                      # (topological order: a parent's state is set already)
        p = drafts.par[:, i]
        prev = jnp.where(p >= 0, states[b, jnp.clip(p, 0, D - 1)], open0)
        states = states.at[:, i].set(after(prev, drafts.tok[:, i]))
    return jnp.concatenate([open0[:, None], states], axis=1)


def accept(sampled, drafts: DraftArrays):
    """sampled [B, 1 + D]: the target's draw at the root (0) and after each node (1 + i).
    -> (emitted [B, 1 + D]: indices into sampled of the tokens to emit, in order (the root's, then
    one per accepted node; padded with 0), accepted [B]: how many nodes were accepted, path
    [B, D]: the accepted nodes in order (-1 after the last))."""
    B, D = drafts.tok.shape
    b = jnp.arange(B)
    cur = jnp.full((B,), -1, jnp.int32)
    want = sampled[:, 0]
    alive = jnp.ones((B,), bool)
    path = jnp.full((B, D), -1, jnp.int32)
    for d in range(D):
        match = (drafts.par == cur[:, None]) & (drafts.tok == want[:, None]) & alive[:, None]      # [B, D]
        nxt = jnp.argmax(match, axis=-1).astype(jnp.int32)
        alive = alive & match.any(-1)
        path = path.at[:, d].set(jnp.where(alive, nxt, -1))
        cur = jnp.where(alive, nxt, cur)
        want = jnp.where(alive, sampled[b, 1 + nxt], want)
    accepted = (path >= 0).sum(-1).astype(jnp.int32)
    emitted = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.where(path >= 0, path + 1, 0)], axis=1)
    return emitted, accepted, path


__all__ = ["DraftArrays", "accept", "node_states"]
