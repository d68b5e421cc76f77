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
from ..models.kv_pool import PagedKV, move_slots
from ..models.paged import forward_paged
from ..models.qwen3_5.mtp import mtp_chain, mtp_context
from ..models.qwen3_5 import StateRows
from ..route import REFERENCE, Route, use
from .sampler import TOP_LOGPROBS, Penalties, SamplingArrays, ThinkGuard, sample
from .spec.mtp import MtpRows, step_drafts
from .spec.ngram import propose_device, propose_tree_device
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
               mtp_depth: int = 0, score=None):
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
    drafts per row. score: None, or (idx [S] flat indices, nxt [S] the token after each): prompt
    logprobs, the log-probability of nxt after idx and the TOP_LOGPROBS best there.
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
    if score is not None:          # (last: prompt logprobs, [S], [S, TOP] x2)
        idx, nxt = score
        lp = jax.nn.log_softmax(logits_from_hidden(params, cfg, h[idx]).astype(jnp.float32), axis=-1)
        top_lps, top_ids = jax.lax.top_k(lp, TOP_LOGPROBS)
        extra = (*extra, jnp.take_along_axis(lp, nxt[:, None], axis=1)[:, 0], top_ids.astype(jnp.int32), top_lps)
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


@partial(jax.jit, static_argnames=("cfg", "num_rounds", "depth", "route", "want_top", "min_n", "max_n",
                                   "tree_nodes"), donate_argnames=("kv",))
def spec_steps(params, cfg: ModelConfig, kv: PagedKV, tokens, positions, block_tables, valid, steps,
               sampling: SamplingArrays, hist, caps, num_rounds: int, depth: int, route: Route = REFERENCE,
               want_top: bool = False, guard: ThinkGuard | None = None, stop_ids=None, remaining=None,
               multi_rows=None, min_n: int = 2, max_n: int = 8, tree_nodes: int = 0, state_slots=None,
               pending=None):
    """num_rounds rounds of n-gram speculation in one dispatch: each round
    drafts a chain of `depth` tokens on the device (ngram.propose_device over each row's history),
    or with tree_nodes > 0 a tree of that many nodes up to `depth` deep (ngram.propose_tree_device),
    verifies it beside the row's last token in one ragged forward and keeps the longest prefix (the
    tree's longest path) the target agrees with and its bonus token, so no host round trip separates
    the rounds. A tree's accepted nodes not written where their positions belong are moved there
    (kv_pool.move_slots). A round in which no row finds a draft runs a one-token decode instead.

    tokens, positions, steps, valid [B] as decode_steps'; hist [B, L] each row's tokens so far
    (prompt and output, padded; L >= its length + num_rounds * (depth + 1)); caps [B] the row's KV
    slots (writes past them are dropped); stop_ids, remaining: where a row ends (decode_steps).
    multi_rows [B] (the reference attention's layout: every row feeds several tokens) or None.

    Hybrids (Gated DeltaNet layers; state_slots [B] each row's state slot, pending [B] its known
    tokens not in the state yet, 1 .. depth + 1): a recurrent state cannot drop a rejected token, so
    as in the host's verify rows (runner._spec_rows) a round feeds the row's pending known tokens
    before the draft, keeps the state after the last known one, and the tokens the round emits are
    the next round's pending ones (fed again, at their positions: a tree's path needs no move).
    Every round verifies then (a plain decode could not feed them). After the dispatch a row's
    tokens of its last round are still pending (the host feeds them: runner._spec_decode).
    Returns per round [R, B, K] ids and logprobs (and top ids / logprobs; K = 1 + depth, or 1 +
    tree_nodes), then the tokens each row emitted per round [R, B] (0 once it ended) and the depth
    of the draft it verified [R, B]."""
    bs, K = kv.block_size, 1 + (tree_nodes or depth)
    dropped = kv.num_blocks * bs
    B, M = block_tables.shape
    L = hist.shape[1]
    ar = jnp.arange(K, dtype=jnp.int32)
    hybrid = state_slots is not None
    P = depth + 1 if hybrid else 1          # known tokens a row feeds each round (the last one, the root, at P - 1)
    K2 = P + K - 1                          # a row's queries: its known tokens, then the draft's nodes
    back = jnp.arange(1 - P, 1, dtype=jnp.int32)                  # [P] the known tokens' offsets from pos
    rep = jax.tree.map(lambda a: jnp.repeat(a, K, axis=0), sampling)

    def slot_of(at, alive):
        """The KV slots of positions at [B] or [B, K] of each row: dropped for ended rows and past
        the row's blocks."""
        at2 = at.reshape(B, -1)
        blk = jnp.take_along_axis(block_tables, jnp.clip(at2 // bs, 0, M - 1), axis=1)
        keep = alive[:, None] & (at2 < caps[:, None])
        return jnp.where(keep, blk * bs + at2 % bs, dropped).reshape(at.shape)

    def verify(kv, tok, pos, st, draft, guard, alive, pend):
        """One verify forward of each row's known tokens (its last one; hybrids: pending ones) and its
        draft's nodes after them, in consecutive slots: draft = (tok, par, dep [B, K - 1] as
        verify.DraftArrays and depths, anc: the ancestor bits of a tree, None for a chain: no masks,
        and every accepted node already sits at its position; known [B, P]: the row's last P tokens)."""
        dtok, dpar, ddep, danc, known = draft
        kpos = pos[:, None] + back[None]                                              # [B, P]
        fed = back[None] > -pend[:, None]          # the known tokens fed (the others' K/V are in place)
        toks = jnp.concatenate([jnp.where(fed, known, 0), jnp.maximum(dtok, 0)], axis=1)          # [B, K2]
        qpos = jnp.concatenate([jnp.maximum(kpos, 0), pos[:, None] + ddep], axis=1)
        slots = jnp.concatenate([jnp.where(fed, slot_of(kpos, alive), dropped),
                                 slot_of(pos[:, None] + 1 + ar[None, :-1], alive)], axis=1)
        tree = None if danc is None else \
            (pos + 1, jnp.concatenate([jnp.zeros((B, P), jnp.int32), danc], axis=1).reshape(-1))
        rows = None
        if hybrid:                 # the linear layers' verify layout (qwen3_5/paged.py StateRows)
            t = jnp.arange(K2, dtype=jnp.int32)[None]
            runs = jnp.concatenate([fed, dtok >= 0], axis=1)
            par = jnp.where(t < P, jnp.where(t - 1 >= P - pend[:, None], t - 1, -1),
                            jnp.concatenate([jnp.zeros((B, P), jnp.int32),
                                             jnp.where(dpar >= 0, P + dpar, P - 1)], axis=1))
            S = kv.conv[0].shape[0] if kv.conv else 0
            none = jnp.full((B,), B * K2, jnp.int32)
            rows = StateRows(none, jnp.full((B,), S, jnp.int32), jnp.zeros((B,), bool),
                             spec_tok=jnp.where(runs, jnp.arange(B, dtype=jnp.int32)[:, None] * K2 + t, B * K2),
                             spec_par=par, spec_commit=jnp.full((B,), P - 1, jnp.int32),
                             spec_slot=jnp.where(alive, state_slots, S), spec_fresh=jnp.zeros((B,), bool))
        # (every row's K2 queries see K2 keys at least: padding rows too, whose outputs nobody reads; a
        # real row is at least P tokens long: the engine's _loop_ok)
        h, kv = forward_paged(params, cfg, toks.reshape(-1), qpos.reshape(-1), slots.reshape(-1), kv,
                              block_tables, jnp.maximum(pos + K, K2), jnp.arange(B + 1, dtype=jnp.int32) * K2, route, rows, multi_rows,
                              tree)
        h = h.reshape(B, K2, -1)[:, P - 1:].reshape(B * K, -1)                       # the root's and the nodes'
        dz = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), ddep], axis=1)            # each query's depth
        nodes = DraftArrays(dtok, dpar)
        g = None
        if guard is not None:      # the guard's state at each node, along the draft
            g = node_states(guard.open, nodes, lambda o, t: guard.replace(open=o).after(t).open)
            g = guard.replace(open=g.reshape(-1), enabled=jnp.repeat(guard.enabled, K))
        out = sample(logits_from_hidden(params, cfg, h), (st[:, None] + dz).reshape(-1), rep, want_top, guard=g)
        out = tuple(o.reshape(B, K, *o.shape[1:]) for o in out)
        emitted, held, path = accept(out[0], nodes)
        if danc is None:           # (a chain's accepted path is its first nodes, in emission order)
            return kv, out, held
        out = tuple(jnp.take_along_axis(o, emitted.reshape(B, K, *(1,) * (o.ndim - 2)), axis=1) for o in out)
        if hybrid:                 # (the path is fed again next round, at its positions)
            return kv, out, held
        # the accepted path's K/V to the slots of its positions (a node at index j sits at pos + 1 + j)
        j = jnp.arange(K - 1, dtype=jnp.int32)[None]
        move = (path >= 0) & (path != j)
        src = slot_of(pos[:, None] + 1 + jnp.maximum(path, 0), alive)
        dst = jnp.where(move, slot_of(pos[:, None] + 1 + j, alive), dropped)
        kv = _when(jnp.any(move), lambda kv: move_slots(kv, src.reshape(-1), dst.reshape(-1)), kv)
        return kv, out, held

    def plain(kv, tok, pos, st, draft, guard, alive, pend):
        h, kv = forward_paged(params, cfg, tok, pos, slot_of(pos, alive), kv, block_tables,
                              jnp.where(valid, pos + 1, 1), None, route)
        out = sample(logits_from_hidden(params, cfg, h), st, sampling, want_top, guard=guard)
        # (as a round whose draft held nothing: the draw at the root, the rest padding)
        out = tuple(jnp.zeros((B, K, *o.shape[1:]), o.dtype).at[:, 0].set(o) for o in out)
        return kv, out, jnp.zeros((B,), jnp.int32)

    # a round's outputs: ids, logprobs (and top ids, top logprobs) [B, K, ...]
    out_zeros = (jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), jnp.float32))
    if want_top:
        out_zeros += (jnp.zeros((B, K, TOP_LOGPROBS), jnp.int32), jnp.zeros((B, K, TOP_LOGPROBS), jnp.float32))

    def one(kv, tok, pos, st, hist, hlen, emitted, guard, alive, pend):
        if tree_nodes:
            dtok, dpar, ddep, danc = propose_tree_device(hist, hlen, depth, tree_nodes, min_n, max_n)
            # a node whose slot lies past the row's blocks would have no K/V: never accepted
            ok = alive[:, None] & (pos[:, None] + 1 + ar[None, :-1] < caps[:, None])
            dtok, dpar = jnp.where(ok, dtok, -1), jnp.where(ok, dpar, -2)
        else:                      # a chain: node i's parent is node i - 1, its depth i + 1
            dtok, _ = propose_device(hist, hlen, depth, min_n, max_n)                 # [B, depth]
            dtok = jnp.where(alive[:, None], dtok, -1)
            dpar, ddep = (jnp.broadcast_to(ar[:-1] + d, dtok.shape) for d in (-1, 1))
            danc = None
        b = jnp.arange(B)
        known = tok[:, None] if P == 1 else hist[b[:, None], jnp.clip(pos[:, None] + back[None], 0, L - 1)]
        draft = (dtok, dpar, ddep, danc, known)
        if hybrid:                 # (pending tokens to feed: every round verifies)
            kv, out, held = verify(kv, tok, pos, st, draft, guard, alive, pend)
        else:
            kv, out, held = _either(jnp.any(dtok >= 0), verify, plain, kv, out_zeros, tok, pos, st, draft, guard,
                                    alive, pend)
        ids = out[0]
        n = held + 1                                                     # tokens this round emits
        if stop_ids is not None:   # a row ends at its first stop token or its last allowed token
            stop = ((ids[:, :, None] == stop_ids[:, None, :]).any(-1)
                    | (emitted[:, None] + ar[None] + 1 >= remaining[:, None])) & (ar[None] < n[:, None])
            n = jnp.where(stop.any(axis=1), jnp.argmax(stop, axis=1) + 1, n)
            alive_next = alive & ~stop.any(axis=1)
        else:
            alive_next = alive
        n = jnp.where(alive, n, 0).astype(jnp.int32)
        put = jnp.where(ar[None] < n[:, None], hlen[:, None] + ar[None], L)                 # (L: dropped)
        hist = hist.at[b[:, None], put].set(ids, mode="drop")
        if guard is not None:
            is_open = guard.open
            for j in range(K):         # the state after the tokens emitted, in order
                is_open = jnp.where(j < n, guard.replace(open=is_open).after(ids[:, j]).open, is_open)
            guard = guard.replace(open=is_open)
        tok = jnp.where(n > 0, ids[b, jnp.maximum(n - 1, 0)], tok)
        deep = jnp.max(jnp.where(dtok >= 0, ddep, 0), axis=1)                 # the draft's depth
        drafted = jnp.where(alive, deep, 0).astype(jnp.int32)
        pend = jnp.where(n > 0, n, pend)         # (hybrids: this round's tokens are the next one's to feed)
        return ((kv, tok, pos + n, st + n, hist, hlen + n, emitted + n, guard, alive_next, pend),
                (*out, n, drafted))

    # the rounds' outputs, filled in as they run; a dispatch whose rows have all ended stops early
    R = num_rounds
    outs0 = tuple(jnp.zeros((R, *o.shape), o.dtype) for o in out_zeros) + (jnp.zeros((R, B), jnp.int32),) * 2

    def body(c):
        r, carry, outs = c
        carry, out = one(*carry)
        return r + 1, carry, tuple(o.at[r].set(x) for o, x in zip(outs, out))

    with use(route):               # (a row's history is its tokens up to its position)
        pend = jnp.ones((B,), jnp.int32) if pending is None else pending
        carry = (kv, tokens, positions, steps, hist, positions + 1, jnp.zeros((B,), jnp.int32), guard, valid, pend)
        _, carry, outs = jax.lax.while_loop(lambda c: (c[0] < num_rounds) & jnp.any(c[1][-1]), body,
                                            (jnp.int32(0), carry, outs0))
    return replicated(outs), carry[0]


def _when(pred, f, kv):
    """f(kv) if pred else kv, as a loop run once or not at all (no copy of the pool: _either)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), f(c[1])), (pred, kv))[1]


def _either(pred, if_true, if_false, kv, out_zeros, *args):
    """lax.cond(pred, if_true, if_false, kv, *args) -> (kv, outputs like out_zeros, held [B]) without
    copying the pool: XLA copies a conditional's big in-place operands (the whole KV pool, each
    round), not a while loop's, so each branch is a loop that runs once or not at all."""
    def branch(f, run, state):
        def body(c):
            _, kv, _, _ = c
            kv, out, held = f(kv, *args)
            return jnp.bool_(False), kv, out, held
        return jax.lax.while_loop(lambda c: c[0], body, (run, *state))[1:]

    B = out_zeros[0].shape[0]
    kv, out_t, held_t = branch(if_true, pred, (kv, out_zeros, jnp.zeros((B,), jnp.int32)))
    kv, out_f, held_f = branch(if_false, ~pred, (kv, out_zeros, jnp.zeros((B,), jnp.int32)))
    pick = lambda a, b: jnp.where(pred, a, b)  # noqa: E731
    return kv, jax.tree.map(pick, out_t, out_f), pick(held_t, held_f)


@partial(jax.jit, static_argnames=("cfg", "route"))
def prefill_logprobs(params, cfg: ModelConfig, kv: PagedKV, tokens, block_tables, route: Route = REFERENCE,
                     start=0):
    """One sequence's tokens [T] at positions start .. start + T - 1 through the paged path, on top
    of the positions before start already in the pool (start = 0: a fresh pool; hybrids: state slot
    0, carried from the previous piece). block_tables [1, M] -> (log-probabilities [T, V] f32 of
    the next token, the pool): a text scored in pieces of a few rows runs the kernels decode runs."""
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
