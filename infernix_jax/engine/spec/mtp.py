"""Drafting with the checkpoint's MTP head (`--speculative mtp`; models/qwen3_5/mtp.py has the head).

The head runs inside every step of an engine that drafts with it, right after the target: a row
for each token the step keeps (its known tokens and the draft nodes the target accepted: the
head's K/V must cover the whole sequence), then a chain of `depth` greedy drafts from each row's
last emitted token. The drafts come back with the step's tokens (no dispatch of their own) and are
the next round's proposal (Speculator.propose). They are only proposals: the verify step keeps
what the target's own draws agree with, so the output is the same with any head, even a wrong one.

`use_mtp` decides at engine start whether the head runs at all: it costs a K/V layer in the pool
and a layer per token, so an engine that will not draft with it (`ngram`, `off`, a checkpoint
without one) drops it from its copy of the weights and config."""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import struct

from ...models.qwen3_5.mtp import mtp_chain, mtp_context

log = logging.getLogger("infernix.engine")


@struct.dataclass
class MtpRows:
    """Where the head's rows are in a mixed step of N tokens and B rows. node [N]: -1 a known token,
    j >= 0 its row's draft node j, -2 padding; row [N] each token's batch row (B: padding); last [B]
    the flat index of each row's last known token (N: a padding row); after [B] the token that
    follows it when the host knows it (a prompt chunk that does not end the prompt), else -1 (the
    step's own draw); cap [B] the row's slots (its blocks' tokens: the chain stops there)."""
    node: jax.Array
    row: jax.Array
    last: jax.Array
    after: jax.Array
    cap: jax.Array


def use_mtp(model, mode: str, kv_dtype: str = ""):
    """-> (the model the engine runs, whether it drafts with the MTP head). mode: --speculative.
    Not with --kv-dtype bf16p: the chain's K/V past a sequence's end could overflow a block's
    escapes and fail a request that is fine (auto then drafts with n-grams only)."""
    cfg = model.cfg
    has = cfg.mtp_layers > 0 and "mtp" in model.params
    if mode == "mtp":
        if not has:
            raise ValueError(f"--speculative mtp: {model.name} has no multi-token prediction head (mtp.* weights; "
                             "Qwen3-Next and Qwen3.5 checkpoints carry one): use --speculative ngram or auto")
        if cfg.mtp_layers != 1:
            raise ValueError(f"--speculative mtp drafts with one MTP layer; {model.name} has {cfg.mtp_layers}")
        if kv_dtype == "bf16p":
            raise ValueError("--speculative mtp does not work with --kv-dtype bf16p (the head's drafted K/V could "
                             "overflow a block's escapes): use another --kv-dtype, or --speculative ngram")
    if has and mode in ("mtp", "auto") and cfg.mtp_layers == 1 and kv_dtype != "bf16p":
        return model, True
    if not has and not cfg.mtp_layers:
        return model, False
    params = {k: v for k, v in model.params.items() if k != "mtp"}
    return dataclasses.replace(model, cfg=dataclasses.replace(cfg, mtp_layers=0), params=params), False


def step_drafts(params, cfg, kv, h, tokens, positions, slots, block_tables, kv_lens, cu_q, route, multi_rows, tree,
                mtp: MtpRows, ids, accepted, path, logits_idx, depth: int):
    """The head beside a mixed step (steps.mixed_step): h [N, H] the target's hidden states; ids
    [B, K] the emitted tokens (the root's draw first; K = 1 without drafts), accepted [B] and path
    [B, K - 1] (None without drafts). -> (drafts [B, depth], pool)."""
    N = tokens.shape[0]
    B, K = ids.shape
    dropped = kv.num_blocks * kv.block_size
    last = jnp.clip(mtp.last, 0, N - 1)
    # the token after each: the next one in its row; after a row's last known token, the step's draw
    # (or the prompt's next token, for a chunk that does not end it)
    nxt = jnp.concatenate([tokens[1:], tokens[:1]])
    nxt = nxt.at[mtp.last].set(jnp.where(mtp.after >= 0, mtp.after, ids[:, 0]), mode="drop")
    keep = mtp.node == -1
    b = jnp.arange(B)
    start = last
    if K > 1:                       # the accepted nodes, whose next token is the next one emitted
        r = jnp.clip(mtp.row, 0, B - 1)
        depth_of = positions - positions[last][r]
        held = (jnp.arange(K - 1)[None] < accepted[:, None])                       # [B, K - 1]
        on = ((path[r] == mtp.node[:, None]) & held[r]).any(-1) & (mtp.node >= 0)
        nxt = jnp.where(on, ids[r, jnp.clip(depth_of, 0, K - 1)], nxt)
        keep = keep | on
        tip = logits_idx[b, 1 + path[b, jnp.maximum(accepted - 1, 0)]]           # the last accepted node
        start = jnp.where(accepted > 0, jnp.clip(tip, 0, N - 1), last)
    y, kv = mtp_context(params, cfg, kv, h, nxt, positions, jnp.where(keep, slots, dropped), block_tables, kv_lens,
                        cu_q, route, multi_rows, tree)
    return mtp_chain(params, cfg, kv, y[start], positions[start], block_tables, mtp.cap, depth, route)


def usable(drafts, position: int, cap: int) -> list[int]:
    """The host's cut of one row's chain: drafts [depth] from the head's row at `position`; chained
    step i ran at position + i and holds only where that slot exists (< cap)."""
    n = 1 + max(0, min(len(drafts) - 1, cap - position - 1))
    return [int(t) for t in drafts[:n]]
