"""The jitted entry points. Shapes reaching them are bucketed by the runner (see `bucket`), so the
number of compilations stays small; the KV pool is donated so XLA updates it in place. Each takes
the route (route.py: kernels, KV format) as one static argument and makes it current while it
traces."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..sharding import replicated
from ..models import forward
from ..models.llama import KVCache, logits_from_hidden
from ..models.kv_pool import PagedKV
from ..models.paged import forward_paged
from ..models.qwen3_5.mtp import mtp_chain, mtp_context
from ..route import REFERENCE, Route, use
from .sampler import Penalties, SamplingArrays, ThinkGuard, sample
from .spec.mtp import MtpRows, step_drafts
from .spec.verify import DraftArrays, accept, node_states


def bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n (at least `minimum`)."""
    b = minimum
    while b < n:
        b *= 2
    return b


@partial(jax.jit, static_argnames=("cfg", "route", "want_top", "mtp_depth"), donate_argnames=("kv",))
def mixed_step(params, cfg: ModelConfig, kv: PagedKV, tokens, positions, slots, block_tables, kv_lens, cu_q,
               logits_idx, steps, sampling: SamplingArrays, route: Route = REFERENCE, want_top: bool = False,
               penalties: Penalties | None = None, allowed=None, guard: ThinkGuard | None = None, rows=None,
               multi_rows=None, drafts: DraftArrays | None = None, tree=None, mtp: MtpRows | None = None,
               mtp_depth: int = 0):
    """A ragged batch of prefill chunks, decodes and (with drafts) verify rows.
    tokens/positions/slots [N]; block_tables [B, M]; kv_lens [B]; cu_q [B + 1].
    logits_idx [B, K]: the flat indices whose next token is drawn (a row's last known token, then
    its draft nodes; K = 1 without drafts); steps [B * K] each draw's output index, sampling,
    allowed (None or [B * K, ceil(V/32)] int32 token bitmasks) and penalties row-major likewise.
    guard: the thinking guard's state at each row's last known token ([B]; after each node it
    follows the draft). rows: hybrids' StateRows (None otherwise). multi_rows [Bp]: the rows
    feeding several tokens (padded with B; None: any may): the reference attention gives only
    those the ragged layout. drafts: spec.verify.DraftArrays [B, K - 1]; tree: None, or the
    ancestor masks (tree_lo [B], anc [N]) when a draft is not a chain.
    mtp: the MTP head's rows (spec/mtp.py; None: the engine does not draft with it), mtp_depth its
    drafts per row.
    Returns the sampled token of every row (and logprobs), and the pool; with drafts, every
    output is [B, K] in emission order (the root's draw, then one per accepted node) followed by
    accepted [B] and path [B, K - 1] (spec.verify.accept); with mtp, the head's drafts [B, mtp_depth] last."""
    B, K = logits_idx.shape
    with use(route):
        h, kv = forward_paged(params, cfg, tokens, positions, slots, kv, block_tables, kv_lens, cu_q, route, rows,
                              multi_rows, tree)
        logits = logits_from_hidden(params, cfg, h[logits_idx.reshape(-1)])     # [B * K, V]
    if drafts is not None and guard is not None:       # the guard's state at each node, along the draft
        is_open = node_states(guard.open, drafts, lambda o, t: guard.replace(open=o).after(t).open)
        guard = guard.replace(open=is_open.reshape(-1), enabled=jnp.repeat(guard.enabled, K))
    pen = None if penalties is None else (*penalties.dense(*logits.shape), penalties)
    out = sample(logits, steps, sampling, want_top, pen, allowed, guard)
    extra, ids, accepted, path = (), out[0][:, None], None, None
    if drafts is not None:
        out = [o.reshape(B, K, *o.shape[1:]) for o in out]
        emitted, accepted, path = accept(out[0], drafts)
        out = [jnp.take_along_axis(o, emitted.reshape(B, K, *(1,) * (o.ndim - 2)), axis=1) for o in out]
        extra, ids = (accepted, path), out[0]
    if mtp is not None:
        with use(route):
            nxt, kv = step_drafts(params, cfg, kv, h, tokens, positions, slots, block_tables, kv_lens, cu_q, route,
                                  multi_rows, tree, mtp, ids, accepted, path, logits_idx, mtp_depth)
        extra = (*extra, nxt)
    return replicated((*out, *extra)), kv


@partial(jax.jit, static_argnames=("cfg", "num_steps", "route", "want_top", "mtp_depth"), donate_argnames=("kv",))
def decode_steps(params, cfg: ModelConfig, kv: PagedKV, tokens, positions, block_tables, valid, steps,
                 sampling: SamplingArrays, num_steps: int, route: Route = REFERENCE, want_top: bool = False,
                 penalties: Penalties | None = None, guard: ThinkGuard | None = None, rows=None,
                 stop_ids=None, remaining=None, mtp_cap=None, mtp_depth: int = 0):
    """num_steps decode steps in one dispatch. tokens (each row's last sampled token), positions (its
    position), steps [B]; valid [B] bool marks real rows; rows: hybrids' StateRows (row i's token is
    flat index i at every step). Returns per-step outputs stacked [num_steps, B].

    stop_ids [B, W] (padded with -1) and remaining [B] (tokens the row may still emit) end a row on
    the step that draws a stop token or its last allowed token: its later steps write no K/V (the
    tokens drawn after its end are dropped by the host anyway; with --kv-dtype bf16p such a junk
    write could otherwise overflow a block's escapes and fail a finished request), and a hybrid's
    state stops there, so the state it leaves is exactly that of its output, which the prefix
    cache can snapshot when it finishes inside the dispatch.

    mtp_cap [B] (the rows' slots; None: no MTP head): the head's row at each step, and after the
    last one its drafts [B, mtp_depth], returned after the per-step outputs (spec/mtp.py)."""
    bs = kv.block_size
    dropped = kv.num_blocks * bs
    B = tokens.shape[0]
    dense = None if penalties is None else penalties.dense(B, params["embed"].shape[0])
    ends = stop_ids is not None
    freeze = rows is not None and ends and bool(kv.conv)      # (a hybrid of attention layers only: nothing to freeze)

    def one(carry, j):
        (kv, my), tok, pos, st, dense, guard, alive = carry
        blk = jnp.take_along_axis(block_tables, (pos // bs)[:, None], axis=1)[:, 0]
        slots = jnp.where(alive, blk * bs + pos % bs, dropped)          # (alive starts as valid)
        kv_lens = jnp.where(valid, pos + 1, 1)
        r = rows
        if freeze:                     # an ended row's state slot is out of range: its writes are dropped
            r = rows.replace(dec_slot=jnp.where(alive, rows.dec_slot, kv.conv[0].shape[0]))
        h, kv = forward_paged(params, cfg, tok, pos, slots, kv, block_tables, kv_lens, None, route, r)
        pen = None if dense is None else (*dense, penalties)
        out = sample(logits_from_hidden(params, cfg, h), st, sampling, want_top, pen, guard=guard)
        if guard is not None:
            guard = guard.after(out[0])
        if dense is not None:  # the drawn token joins the history of the next step
            counts, seen = dense
            ids = jnp.arange(B)
            dense = (counts.at[ids, out[0]].add(1), seen.at[ids, out[0]].set(True))
        if mtp_cap is not None:      # the head's row: this token's hidden state and the token drawn after it
            y, kv = mtp_context(params, cfg, kv, h, out[0], pos, slots, block_tables, kv_lens, None, route)
            my = jnp.where(alive[:, None], y, my)
        if ends:
            alive = alive & ~((out[0][:, None] == stop_ids).any(-1) | (j + 1 >= remaining))
        return ((kv, my), out[0], pos + 1, st + 1, dense, guard, alive), out

    my0 = jnp.zeros((B, params["embed"].shape[-1]), params["embed"].dtype) if mtp_cap is not None else None
    with use(route):               # (scan traces `one` here)
        ((kv, my), *_, alive), outs = jax.lax.scan(one, ((kv, my0), tokens, positions, steps, dense, guard, valid),
                                                   jnp.arange(num_steps))
        if mtp_cap is not None:      # (a row that ended inside the dispatch writes nothing more: cap 0)
            nxt, kv = mtp_chain(params, cfg, kv, my, positions + num_steps - 1, block_tables,
                                jnp.where(alive, mtp_cap, 0), mtp_depth, route)
            outs = (*outs, nxt)
    return replicated(outs), kv


@partial(jax.jit, static_argnames=("cfg", "route"))
def prefill_logprobs(params, cfg: ModelConfig, kv: PagedKV, tokens, block_tables, route: Route = REFERENCE,
                     start=0):
    """One sequence's tokens [T] at positions start .. start + T - 1 through the paged path, on top
    of the positions before start already in the pool (start = 0: a fresh pool; hybrids: state slot
    0, carried from the previous piece). block_tables [1, M] -> (log-probabilities [T, V] f32 of
    the next token, the pool): a text scored in pieces of a few rows runs the kernels decode runs."""
    from ..models.qwen3_5 import StateRows
    T, bs = tokens.shape[0], kv.block_size
    start = jnp.asarray(start, jnp.int32)
    pos = start + jnp.arange(T, dtype=jnp.int32)
    slots = block_tables[0, pos // bs] * bs + pos % bs
    one = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
    rows = StateRows(one(T), one(1), jnp.zeros((1,), bool), jnp.arange(T, dtype=jnp.int32)[None], one(T), one(0),
                     (start == 0)[None]) if cfg.layer_types else None
    with use(route):
        h, kv = forward_paged(params, cfg, tokens, pos, slots, kv, block_tables, (start + T)[None],
                              jnp.asarray([0, T], jnp.int32), route, rows)
        return jax.nn.log_softmax(logits_from_hidden(params, cfg, h), axis=-1), kv


@partial(jax.jit, static_argnames=("cfg",))
def full_logprobs(params, cfg: ModelConfig, tokens, cache: KVCache):
    """tokens [1, T] -> log-probabilities [1, T, V] f32 of the next token at every position."""
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    h, _ = forward(params, cfg, tokens, positions, cache)
    return jax.nn.log_softmax(logits_from_hidden(params, cfg, h), axis=-1)
