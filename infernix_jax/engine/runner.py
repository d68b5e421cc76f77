"""The only caller of jitted code: packs a scheduled batch into bucketed int32 arrays, runs one
step (or several decode steps in one dispatch), and brings the sampled tokens back in one transfer;
and runs the prefix cache's device work (block reads, writes and copies, state snapshots: the cache
plans them, cache/device.py holds them). On several hosts every device call is replayed by the
other processes (follow)."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import device
from ..cache.snapshots import StateSnapshot
from ..models.qwen3_5 import StateRows
from ..models.kv_pool import PagedKV, init_paged_kv
from ..route import REFERENCE, Route
from .. import distributed, sharding
from . import shapes, steps
from .sampler import Penalties, SamplingArrays, ThinkGuard
from .sequence import Sequence
from .spec import DraftArrays
from .spec.mtp import MtpRows, usable


class StepOutput:
    """Per scheduled row: sampled ids [k], logprobs [k], and top ids/logprobs [k, TOP] if asked.
    A verify row (one with a draft): the k = accepted + 1 tokens to emit, and the accepted nodes
    (path, in order)."""

    def __init__(self, ids, lps, top_ids=None, top_lps=None, accepted: int = 0, path=(), mtp=None, rounds=(),
                 fed=None, prompt_lps=()):
        self.ids, self.lps, self.top_ids, self.top_lps = ids, lps, top_ids, top_lps
        self.accepted, self.path = accepted, path
        self.mtp = mtp          # the MTP head's drafts after the last emitted token (spec/mtp.py), or None
        self.rounds = rounds    # spec_steps: (drafted, accepted) of each round the row drafted in
        self.fed = fed          # hybrids' spec_steps: the emitted tokens in the state (the rest are pending)
        self.prompt_lps = prompt_lps    # (next token, logprob, top ids, top logprobs) per prompt position scored


log = logging.getLogger("infernix.engine")

STOP_WIDTH = 8        # stop token ids per row the device checks (a fixed width: no recompiles)
# Block tables are at least this many tokens wide: fewer shapes to compile (a chat's first 256 tokens
# share one), for little work (the kernels stop at each row's length; the CPU's reference reads the
# padding, a few MiB a step for a small model)
MIN_TABLE_TOKENS = 256


_any = jax.jit(jnp.any)


class Runner:
    def __init__(self, model, num_blocks: int, block_size: int, route: Route = REFERENCE, state_slots: int = 0,
                 max_context: int = 0, parallel: sharding.Parallel | None = None):
        # several devices: the weights and the KV pool split over a mesh (sharding.py), every step
        # traced and run on it; None or one device: nothing changes
        self.mesh = sharding.make_mesh(parallel) if parallel else None
        self.cfg = model.cfg
        self.params = model.params
        if self.mesh is not None:
            self.params = sharding.shard_params(self.params, self.mesh, self.cfg)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.route = route           # every step's (route.py): kernels, KV format
        self.dtype = model.dtype
        self.think_ids = None      # (<think>, </think>, banned ids) when the model has thinking tokens
        self.max_prefill_rows = None   # hybrids: the scheduler's cap on rows feeding several tokens
        self.hybrid = bool(self.cfg.layer_types)
        self.mtp_depth = 0           # > 0: every step runs the MTP head and drafts this many (spec/mtp.py)
        self.loop = None             # spec.policy.Loop: the settings of device-side n-gram rounds (spec_steps)
        self.state_slots = state_slots if self.hybrid else 0
        self.max_context = max_context or self.cfg.max_position_embeddings     # outputs end there (_ends)
        self._op_reset_kv()
        self.shapes = shapes.Seen()          # the step shapes run so far (warm-up replays them next start)
        self.compiled: set[tuple] = set()    # spec_steps shapes compiled in this process (auto waits for them)
        # several hosts (distributed.py): the leader's device calls go to every other process, which
        # replays them (follow); all built the same engine first
        self.channel = distributed.Channel() if distributed.several() else None
        if self.channel is not None:
            self.channel.agree((num_blocks, block_size, self.state_slots, route, parallel,
                                str(self.cfg)), "engine")

    # ---- device calls: each one runs here and, on several hosts, on every process ---------------
    def _device(self, op: str, *args, **kw):
        """Run device op `op` (method _op_<op>) with these host arguments; the leader of several
        hosts sends it to the followers first (they replay it in order)."""
        if self.channel is not None and distributed.is_leader():
            # (arrays in host memory travel as numpy: the followers put them on their own devices)
            self.channel.send(jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, (op, args, kw)))
        return getattr(self, "_op_" + op)(*args, **kw)

    def follow(self) -> None:
        """A follower's life: replay the leader's device calls until it releases us. A call that
        fails here is logged and the next one taken (the leader's recovery, a pool reset, follows)."""
        while (msg := self.channel.receive()) is not None:
            op, args, kw = msg
            try:
                getattr(self, "_op_" + op)(*args, **kw)
            except Exception as e:  # noqa: BLE001  (stay in step with the leader)
                log.error("replaying %s failed: %s", op, e)

    def release(self) -> None:
        """The leader's last word to the followers (their follow() returns). Idempotent."""
        if self.channel is not None and distributed.is_leader():
            self.channel.send(None)
            self.channel = None

    def _op_mixed(self, *args, compile_only: bool = False, **kw):
        return self._step(steps.mixed_step, args, kw, compile_only)

    def _op_decode(self, *args, compile_only: bool = False, **kw):
        return self._step(steps.decode_steps, args, kw, compile_only)

    def _op_spec(self, *args, compile_only: bool = False, **kw):
        return self._step(steps.spec_steps, args, kw, compile_only)

    def _step(self, fn, args, kw, compile_only: bool):
        """Run a jitted step on the pool; compile_only: compile it for these arguments (filling jit's
        cache, or reading the persistent compilation cache) without running it."""
        with sharding.use(self.mesh):
            if compile_only:
                fn.lower(self.params, self.cfg, self.kv, *args, **kw).compile()
                return None
            out, self.kv = fn(self.params, self.cfg, self.kv, *args, **kw)
        return out

    # ---- scoring (quality.py): one sequence through a pool of this runner's own ------------------
    def score(self, tokens, start: int):
        """Log-probabilities [T, V] f32 of the next token after each of one sequence's tokens [T]
        at positions start .. start + T - 1, in blocks 0, 1, ... of the pool, after the tokens
        before start (scored earlier, in pieces, or none)."""
        return self._device("score", tokens, start)

    def _op_score(self, tokens, start):
        tables = np.arange(self.num_blocks - 1, dtype=np.int32)[None]        # (the last block: spare)
        with sharding.use(self.mesh):
            lp, self.kv = steps.prefill_logprobs(self.params, self.cfg, self.kv, tokens, tables, self.route, start)
        return lp

    # ---- the prefix cache's device work (cache/device.py) ------------------------------------------
    def read_blocks(self, ids: list[int]) -> list:
        """[(k, v, lo, hi)]: blocks ids[lo:hi] on their way to host memory (device.read_blocks)."""
        return self._device("read_blocks", list(ids))

    def _op_read_blocks(self, ids):
        # (a follower joins the gather, a collective, but keeps nothing: no copy to its host memory)
        return device.read_blocks(self.kv, ids, keep=distributed.is_leader())

    def write_rows(self, k, v, rows: list[int], dst: list[int]) -> None:
        """Rows of a piece of host blocks into device blocks dst (device.write_rows)."""
        self._device("write_rows", k, v, list(rows), list(dst))

    def _op_write_rows(self, k, v, rows, dst):
        self.kv = device.write_rows(self.kv, k, v, rows, dst)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src to block dst for each (src, dst)."""
        self._device("copy_blocks", list(pairs))

    def _op_copy_blocks(self, pairs):
        self.kv = device.copy_blocks(self.kv, pairs)

    def take_snapshot(self, slot: int, num_tokens: int) -> StateSnapshot:
        """Hybrids: the state in `slot` (its first num_tokens tokens), on its way to host memory."""
        return self._device("take_snapshot", int(slot), int(num_tokens))

    def _op_take_snapshot(self, slot, num_tokens):
        return device.take_snapshot(self.kv, slot, num_tokens, keep=distributed.is_leader())

    def restore_snapshot(self, slot: int, snap: StateSnapshot) -> None:
        self._device("restore_snapshot", int(slot), snap)

    def _op_restore_snapshot(self, slot, snap):
        self.kv = device.restore_snapshot(self.kv, slot, snap)

    def reset_kv(self) -> None:
        self._device("reset_kv")

    def _op_reset_kv(self) -> None:
        self.kv: PagedKV = sharding.make_sharded(
            lambda: init_paged_kv(self.cfg, self.num_blocks, self.block_size, self.dtype, self.state_slots,
                                  self.route.kv_dtype), sharding.kv_specs, self.mesh)

    def take_lost(self) -> set[int]:
        """--kv-dtype bf16p: the blocks a step could not pack losslessly (kv_bf16p), cleared as they
        are read; empty for every other KV format (and then free: no transfer)."""
        if self.kv.lost is None or not bool(_any(self.kv.lost)):
            return set()
        ids = np.flatnonzero(np.asarray(self.kv.lost))
        self.kv = self.kv.replace(lost=jnp.zeros_like(self.kv.lost))
        return set(int(i) for i in ids)

    def _state_rows(self, plan, B: int, N: int) -> StateRows | None:
        """Hybrids: the layouts of the linear layers (one-token rows, several-token rows, and the
        rows ending in drafts: qwen3_5/paged.py)."""
        if not self.hybrid:
            return None
        S = self.state_slots
        dec_tok, dec_slot, dec_fresh = np.full((B,), N, np.int32), np.full((B,), S, np.int32), np.zeros((B,), bool)
        multi, spec, off = [], [], 0
        for i, (s, n) in enumerate(plan):
            if s.draft:
                spec.append((off, n, s))
            elif n == 1:
                dec_tok[i], dec_slot[i], dec_fresh[i] = off, s.state_slot, s.num_computed == 0
            else:
                multi.append((off, n, s))
            off += n
        extra = self._spec_rows(spec, N) if spec else {}
        if not multi:
            return StateRows(dec_tok, dec_slot, dec_fresh, **extra)
        Bp = self.multi_bucket(len(multi), B)
        pre_tok = np.full((Bp, N), N, np.int32)
        pre_len, pre_slot, pre_fresh = np.zeros((Bp,), np.int32), np.full((Bp,), S, np.int32), np.zeros((Bp,), bool)
        for r, (o, n, s) in enumerate(multi):
            pre_tok[r, :n] = np.arange(o, o + n)
            pre_len[r], pre_slot[r], pre_fresh[r] = n, s.state_slot, s.num_computed == 0
        return StateRows(dec_tok, dec_slot, dec_fresh, pre_tok, pre_len, pre_slot, pre_fresh, **extra)

    def _spec_rows(self, spec, N: int) -> dict:
        """StateRows' verify layout for the rows [(flat offset, tokens, seq)] that end in drafts:
        their known tokens in a chain, the draft's nodes after them; the state after the last known
        token is the one kept."""
        Bs, T = steps.bucket(len(spec), minimum=1), steps.bucket(max(n for _, n, _ in spec), minimum=1)
        tok, par = np.full((Bs, T), N, np.int32), np.full((Bs, T), -1, np.int32)
        commit, slot = np.zeros((Bs,), np.int32), np.full((Bs,), self.state_slots, np.int32)
        fresh = np.zeros((Bs,), bool)
        for r, (o, n, s) in enumerate(spec):
            known = n - len(s.draft)
            tok[r, :n] = np.arange(o, o + n)
            par[r, :known] = np.arange(-1, known - 1)
            par[r, known:n] = [known + p if p >= 0 else known - 1 for p in s.draft.parents]
            commit[r], slot[r], fresh[r] = known - 1, s.state_slot, s.num_computed == 0
        return dict(spec_tok=tok, spec_par=par, spec_commit=commit, spec_slot=slot, spec_fresh=fresh)

    def _sampling(self, seqs: list[Sequence], B: int) -> tuple[SamplingArrays, np.ndarray]:
        temp = np.zeros((B,), np.float32)
        top_p = np.ones((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        min_p = np.zeros((B,), np.float32)
        keys = np.zeros((B, 2), np.uint32)
        st = np.zeros((B,), np.int32)
        for i, s in enumerate(seqs):
            p = s.params
            temp[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
            keys[i] = s.seed_key
            st[i] = len(s.out_ids)
        return SamplingArrays(keys=keys, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p), st

    def _penalties(self, seqs: list[Sequence], B: int) -> Penalties | None:
        """Token histories of the rows that ask for penalties (None when none does: no extra work)."""
        if not any(s.params.penalized for s in seqs):
            return None
        V = self.cfg.vocab_size
        hist = [np.unique(np.asarray(s.out_ids, np.int32), return_counts=True) if s.params.penalized
                else (np.zeros(0, np.int32), np.zeros(0, np.int64)) for s in seqs]
        seen = [np.unique(np.asarray(s.all_ids, np.int32)) if s.params.repetition_penalty != 1 else
                np.zeros(0, np.int32) for s in seqs]
        L = steps.bucket(max(len(h[0]) for h in hist), minimum=16)
        Lp = steps.bucket(max(len(x) for x in seen), minimum=16)
        out_ids = np.full((B, L), V, np.int32)
        out_counts = np.zeros((B, L), np.int32)
        seen_ids = np.full((B, Lp), V, np.int32)
        pres, freq, rep = np.zeros((B,), np.float32), np.zeros((B,), np.float32), np.ones((B,), np.float32)
        for i, s in enumerate(seqs):
            ids, cnt = hist[i]
            out_ids[i, :len(ids)], out_counts[i, :len(ids)] = ids, cnt
            seen_ids[i, :len(seen[i])] = seen[i]
            p = s.params
            pres[i], freq[i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        return Penalties(out_ids, out_counts, seen_ids, pres, freq, rep)

    def _guard(self, seqs: list[Sequence], B: int) -> ThinkGuard | None:
        """The end-in-thinking guard (for every batch of a model with thinking tokens, enabled on the
        rows that ask for it: one compiled variant, whatever the mix)."""
        if self.think_ids is None:
            return None
        start, end, banned = self.think_ids
        enabled = np.zeros((B,), bool)
        is_open = np.zeros((B,), bool)
        for i, s in enumerate(seqs):
            enabled[i] = s.params.think_guard
            is_open[i] = s.params.think_guard and s.thinking
        return ThinkGuard(open=is_open, enabled=enabled, banned=np.asarray(banned, np.int32),
                          start=np.int32(start), end=np.int32(end))

    def _allowed(self, plan, B: int, K: int = 1) -> np.ndarray:
        """Token bitmasks of the draws, K per row (all ones but for constrained rows that sample:
        one compiled step whether or not a row is constrained). A draft node's mask is the
        grammar's after the tokens down to it (the matcher rolled back after each)."""
        mask = np.full((B * K, (self.cfg.vocab_size + 31) // 32), -1, np.int32)
        for i, (s, n) in enumerate(plan):
            d = s.draft
            if s.constraint is None or s.num_computed + n - (len(d) if d else 0) != len(s):
                continue                       # (not sampling this step: a prefill chunk)
            s.constraint.fill(mask, i * K)
            for j in range(len(d) if d else 0):
                path = d.path_tokens(j)
                took = s.constraint.try_consume(path)
                if took == len(path):          # (a node the grammar forbids is never accepted)
                    s.constraint.fill(mask, i * K + 1 + j)
                s.constraint.rollback(took)
        return mask

    def table_width(self, blocks: int) -> int:
        """The bucketed width M of a block table for rows of up to `blocks` blocks."""
        return steps.bucket(blocks, minimum=max(1, MIN_TABLE_TOKENS // self.block_size))

    def _block_table(self, seqs: list[Sequence], B: int) -> np.ndarray:
        M = self.table_width(max(len(s.block_ids) for s in seqs))
        bt = np.zeros((B, M), np.int32)
        for i, s in enumerate(seqs):
            bt[i, :len(s.block_ids)] = s.block_ids
        return bt

    def run(self, plan: list[tuple[Sequence, int]], num_steps: int, rounds: int = 0) -> list[StepOutput]:
        """One dispatch: a mixed step (num_steps 1), num_steps decode steps, or with rounds > 0 that
        many rounds of n-gram speculation on the device (spec_steps; the drafting's settings:
        self.loop)."""
        seqs = [s for s, _ in plan]
        if rounds:
            return self._spec_decode(seqs, rounds, any(s.params.logprobs for s in seqs))
        if num_steps > 1:
            return self._decode(seqs, num_steps, any(s.params.logprobs for s in seqs))
        return self._mixed(plan)

    def _mixed(self, plan) -> list[StepOutput]:
        """A ragged step; it always returns the top log-probabilities (one compiled form whether a
        row asks for them or not: mixed steps are prefill-sized, where they cost little). Rows
        with a draft (seq.draft, the last of their n tokens) are verified (steps.mixed_step)."""
        seqs = [s for s, _ in plan]
        n_real = sum(n for _, n in plan)
        drafted = max((len(s.draft) for s in seqs if s.draft), default=0)
        # (a verify step of one stream: 4 and 8 tokens are shapes of their own: the CPU pays per token)
        N = steps.bucket(n_real, minimum=4 if drafted else 16)
        B = steps.bucket(len(plan), minimum=1)
        K = 1 + steps.bucket(drafted, minimum=1) if drafted else 1     # draws per row
        bs = self.block_size
        tokens = np.zeros((N,), np.int32)
        positions = np.zeros((N,), np.int32)
        slots = np.full((N,), self.num_blocks * bs, np.int32)       # out of range: dropped
        kv_lens = np.zeros((B,), np.int32)
        cu_q = np.full((B + 1,), n_real, np.int32)
        logits_idx = np.zeros((B, K), np.int32)
        depth = np.zeros((B, K), np.int32)                           # each draw's output index offset
        d_tok, d_par = np.zeros((B, K - 1), np.int32), np.full((B, K - 1), -2, np.int32)
        tree = any(s.draft and not s.draft.is_chain for s in seqs)
        tree_lo, anc = np.full((B,), 2**30, np.int32), np.zeros((N,), np.int32)
        mtp = self._mtp_rows(N, B) if self.mtp_depth else None
        off = 0
        for i, (s, n) in enumerate(plan):
            d = s.draft
            nd = len(d) if d else 0
            known = n - nd
            at = np.arange(s.num_computed, s.num_computed + n)       # the row's KV slots, in order
            tokens[off:off + known] = s.tokens(s.num_computed, s.num_computed + known)
            positions[off:off + known] = at[:known]
            blocks = np.asarray(s.block_ids, np.int32)
            slots[off:off + n] = blocks[at // bs] * bs + at % bs
            cu_q[i] = off
            kv_lens[i] = s.num_computed + n
            logits_idx[i] = off + known - 1
            if d:                  # the nodes: positions by depth, drawn after each
                dep = np.asarray(d.depths(), np.int32)
                tokens[off + known:off + n] = d.tokens
                positions[off + known:off + n] = at[known - 1] + dep
                logits_idx[i, 1:1 + nd] = off + known + np.arange(nd)
                depth[i, 1:1 + nd] = dep
                d_tok[i, :nd], d_par[i, :nd] = d.tokens, d.parents
                tree_lo[i] = at[known - 1] + 1
                anc[off + known:off + n] = d.ancestors()
            if mtp is not None:
                mtp.node[off:off + known], mtp.row[off:off + n], mtp.last[i] = -1, i, off + known - 1
                mtp.node[off + known:off + n] = np.arange(nd)
                mtp.cap[i] = len(s.block_ids) * bs
                if s.num_computed + known < len(s):      # a chunk that does not end the known tokens (a prompt's,
                    mtp.after[i] = s.tokens(s.num_computed + known, s.num_computed + known + 1)[0]  # a recompute's)
            off += n
        sampling, st = self._sampling(seqs, B)
        bt, pen, allowed, rows = self._block_table(seqs, B), self._penalties(seqs, B), self._allowed(plan, B, K), \
            self._state_rows(plan, B, N)
        multi = self._multi_rows(plan, B)
        kw = {}
        if K > 1:                  # a verify step: every row's draws (K each) row-major
            sampling = jax.tree.map(lambda a: np.repeat(a, K, axis=0), sampling)
            st = np.repeat(st, K) + depth.reshape(-1)
            pen = None if pen is None else jax.tree.map(lambda a: np.repeat(a, K, axis=0), pen)
            kw = dict(drafts=DraftArrays(d_tok, d_par), tree=(tree_lo, anc) if tree else None)
            self.shapes.seen(shapes.verify(N, B, bt.shape[1], pen, 0 if multi is None else len(multi), K, tree,
                                           *self._layout_sizes(rows)))
        else:
            self.shapes.seen(shapes.mixed(N, B, bt.shape[1], pen, 0 if multi is None else len(multi)))
        if mtp is not None:
            kw.update(mtp=mtp, mtp_depth=self.mtp_depth)
        scored = self._scored(plan)
        if scored:                 # prompt logprobs: the flat index of each scored position, the token after it
            S = steps.bucket(len(scored), minimum=16)
            idx, nxt = np.zeros((S,), np.int32), np.zeros((S,), np.int32)
            idx[:len(scored)], nxt[:len(scored)] = [j for _, j, _ in scored], [t for _, _, t in scored]
            kw["score"] = (idx, nxt)
        out = self._device("mixed", tokens, positions, slots, bt, kv_lens, cu_q, logits_idx,
                           st, sampling, route=self.route, want_top=True,
                           penalties=pen, allowed=allowed, guard=self._guard(seqs, B), rows=rows, multi_rows=multi,
                           **kw)
        out = jax.device_get(out)
        nxt = prompt = None
        if scored:
            *out, s_lp, s_ids, s_lps = out
            prompt = {}
            for k, (i, _, t) in enumerate(scored):
                prompt.setdefault(i, []).append((t, float(s_lp[k]), s_ids[k], s_lps[k]))
        if mtp is not None:
            *out, nxt = out
        if K == 1:
            res = [StepOutput(*(a[i:i + 1] for a in out)) for i in range(len(plan))]
        else:
            *out, accepted, path = out
            res = []
            for i, s in enumerate(seqs):
                a = int(accepted[i]) if s.draft else 0
                res.append(StepOutput(*(x[i, :a + 1] for x in out), accepted=a,
                                      path=tuple(int(j) for j in path[i, :a])))
        for i, lps in (prompt or {}).items():
            res[i].prompt_lps = lps
        if nxt is not None:           # the head's row of each: its last known token, or its last accepted node
            for i, (s, n) in enumerate(plan):
                at = s.num_computed + n - (len(s.draft) if s.draft else 0) - 1 + res[i].accepted
                res[i].mtp = usable(nxt[i], at, int(mtp.cap[i]))
        return res

    @staticmethod
    def _scored(plan) -> list[tuple[int, int, int]]:
        """Prompt logprobs to compute this step: (row, flat index, next prompt token) for each prompt
        position of a row asking for them (SamplingParams.prompt_logprobs) that a chunk feeds and
        that no earlier step scored (a recompute after preemption scores nothing twice)."""
        out, off = [], 0
        for i, (s, n) in enumerate(plan):
            if s.params.prompt_logprobs is not None:
                P = len(s.prompt_ids)
                for p in range(max(s.num_computed, len(s.prompt_lps)), min(s.num_computed + n, P - 1)):
                    out.append((i, off + p - s.num_computed, s.prompt_ids[p + 1]))
            off += n
        return out

    def _mtp_rows(self, N: int, B: int) -> MtpRows:
        """MtpRows of padding, for _mixed to fill in (and warm to run)."""
        return MtpRows(node=np.full((N,), -2, np.int32), row=np.full((N,), B, np.int32),
                       last=np.full((B,), N, np.int32), after=np.full((B,), -1, np.int32),
                       cap=np.zeros((B,), np.int32))

    def multi_bucket(self, count: int, B: int) -> int:
        """Slots for `count` rows feeding several tokens in a step of B rows: 0, 1 (the common case:
        one prompt beside decodes) or all the step can hold (B; hybrids: the scheduler's cap), so
        that a step has at most three layouts."""
        if not self._row_layout:
            return 0
        if count <= 1:
            return count
        return steps.bucket(min(B, self.max_prefill_rows or B), minimum=1)

    @property
    def _row_layout(self) -> bool:
        """Whether steps lay out their multi-token rows: hybrids (their state rows) and the reference
        attention (its cost); the kernels take any layout, so they keep one compiled form."""
        return self.hybrid or not self.route.pallas

    def _multi_rows(self, plan, B: int) -> np.ndarray | None:
        """The rows feeding several tokens [Bp] (padded with B; empty when none): hybrids' StateRows
        lay out the same rows, in the same order. None where steps take any layout."""
        if not self._row_layout:
            return None
        multi = [i for i, (_, n) in enumerate(plan) if n > 1]
        drafted = any(s.draft for s, _ in plan)   # (verify rows come beside the capped prefill rows)
        out = np.full((steps.bucket(len(multi), minimum=1) if drafted else self.multi_bucket(len(multi), B),), B,
                      np.int32)
        out[:len(multi)] = multi
        return out

    def _decode(self, seqs: list[Sequence], k: int, want_top: bool) -> list[StepOutput]:
        B = steps.bucket(len(seqs), minimum=1)
        tokens = np.zeros((B,), np.int32)
        positions = np.zeros((B,), np.int32)
        valid = np.zeros((B,), bool)
        for i, s in enumerate(seqs):
            tokens[i] = s.out_ids[-1]
            positions[i] = len(s) - 1
            valid[i] = True
        sampling, st = self._sampling(seqs, B)
        bt, pen = self._block_table(seqs, B), self._penalties(seqs, B)
        self.shapes.seen(shapes.decode(B, bt.shape[1], k, want_top, pen))
        mtp = {}
        if self.mtp_depth:           # each row's slots: the head's chain stops there
            cap = np.zeros((B,), np.int32)
            cap[:len(seqs)] = [len(s.block_ids) * self.block_size for s in seqs]
            mtp = dict(mtp_cap=cap, mtp_depth=self.mtp_depth)
        out = self._device("decode", tokens, positions, bt, valid, st, sampling,
                           num_steps=k, route=self.route, want_top=want_top,
                           penalties=pen, guard=self._guard(seqs, B),
                           rows=self._state_rows([(s, 1) for s in seqs], B, B), **self._ends(seqs, B), **mtp)
        out = jax.device_get(out)                                   # each [k, B] (or [k, B, TOP])
        nxt = None
        if mtp:
            *out, nxt = out
        res = [StepOutput(*(a[:, i] for a in out)) for i in range(len(seqs))]
        if mtp:
            for i, r in enumerate(res):
                r.mtp = usable(nxt[i], int(positions[i]) + k - 1, int(cap[i]))
        return res

    def _spec_decode(self, seqs: list[Sequence], rounds: int, want_top: bool) -> list[StepOutput]:
        """`rounds` rounds of device-side n-gram speculation (steps.spec_steps): every emitted token,
        in order, per row, with the rounds' (drafted, accepted) counts."""
        B, lp = steps.bucket(len(seqs), minimum=1), self.loop
        bt = self._block_table(seqs, B)
        M = bt.shape[1]
        tokens, positions, caps = np.zeros((B,), np.int32), np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        valid, hist = np.zeros((B,), bool), np.full((B, self._history_width(M)), -1, np.int32)
        for i, s in enumerate(seqs):
            tokens[i], positions[i], valid[i] = s.out_ids[-1], len(s) - 1, True
            caps[i] = len(s.block_ids) * self.block_size
            hist[i, :len(s)] = s.all_ids
        sampling, st = self._sampling(seqs, B)
        state = self._loop_state(seqs, B)
        key = shapes.spec(B, M, rounds, lp.depth, want_top, lp.nodes)
        self.shapes.seen(key)
        self.compiled.add(key)
        out = self._device("spec", tokens, positions, bt, valid, st, sampling, hist, caps, num_rounds=rounds,
                           depth=lp.depth, route=self.route, want_top=want_top, guard=self._guard(seqs, B),
                           multi_rows=np.arange(B, dtype=np.int32) if self._row_layout else None,
                           min_n=lp.min_n, max_n=lp.max_n, tree_nodes=lp.nodes, **self._ends(seqs, B), **state)
        *out, emitted, drafted = jax.device_get(out)        # each [R, B, K] (top: [R, B, K, TOP]); [R, B]
        res = []
        for i in range(len(seqs)):
            n = emitted[:, i]
            last = n[np.flatnonzero(n)[-1]] if n.any() else 0       # (a hybrid's tokens still to feed)
            res.append(StepOutput(*(np.concatenate([a[r, i, :n[r]] for r in range(rounds)]) for a in out),
                                  rounds=tuple((int(drafted[r, i]), int(n[r]) - 1) for r in range(rounds)
                                               if drafted[r, i] > 0 and n[r] > 0),
                                  fed=int(n.sum() - last) if state else None))
        return res

    def _loop_state(self, seqs: list[Sequence], B: int) -> dict:
        """Hybrids' spec_steps arguments: each row's state slot and its known tokens not in the state
        yet (padding rows: the dropped slot, one token)."""
        if not self.hybrid:
            return {}
        slots, pending = np.full((B,), self.state_slots, np.int32), np.ones((B,), np.int32)
        for i, s in enumerate(seqs):
            slots[i], pending[i] = s.state_slot, s.num_pending
        return {"state_slots": slots, "pending": pending}

    def _history_width(self, M: int) -> int:
        """spec_steps' history width at block tables [B, M]: the rows' slots and one more round's
        tokens (room for every token the rounds may add; part of the compiled shape)."""
        return M * self.block_size + self.loop.depth + 1

    def _ends(self, seqs: list[Sequence], B: int) -> dict:
        """Where each row's output ends on the device (decode_steps writes no K/V past it and freezes
        a hybrid's state there): its stop token ids and the tokens it may still emit (max_tokens,
        the context). Stop strings are found on the host: their rows run to the dispatch's end."""
        stop_ids, remaining = np.full((B, STOP_WIDTH), -1, np.int32), np.zeros((B,), np.int32)
        for i, s in enumerate(seqs):
            ids = sorted(s.stop_ids)[:STOP_WIDTH]     # (more: the engine treats its state as dirty)
            stop_ids[i, :len(ids)] = ids
            remaining[i] = s.tokens_left(self.max_context)
        return {"stop_ids": stop_ids, "remaining": remaining}

    # ---- warm-up: run a step of each shape (key: engine/shapes.py) so that serving never compiles ------
    def warm(self, key: tuple, run: bool) -> None:
        """Compile the step of shape `key` (or read it back from the persistent compilation cache)
        and, with `run`, run it once on padding (every K/V and state write goes to the dropped slot),
        so that the first run's fixed cost does not fall on a request (shapes.worth_running)."""
        if key[0] == "copy":
            self.copy_blocks([])         # the prefix cache's copy-on-write
            return
        if key[0] == "spec" and (self.loop is None or len(key) != 7 or key[6] != self.loop.nodes):
            return             # (a record of a run with other device-side rounds, or none)
        op, args, kw = self.padding_call(key)
        # (the same keywords as run(): jit keys its cache on them)
        self._device(op, *args, compile_only=True, **kw)
        self.compiled.add(key)
        if run:
            self._device(op, *args, **kw)
            jax.block_until_ready(self.kv)

    def padding_call(self, key: tuple) -> tuple[str, tuple, dict]:
        """(op, args, keywords) of a step of shape `key` on padding rows (warm-up, benchmarks)."""
        if key[0] == "spec":
            _, B, M, R, D, want_top, nodes = key
            zeros_b = np.zeros((B,), np.int32)
            lp = self.loop
            return "spec", (zeros_b, zeros_b, np.zeros((B, M), np.int32), np.zeros((B,), bool), zeros_b,
                            SamplingArrays.greedy(B), np.full((B, self._history_width(M)), -1, np.int32),
                            zeros_b), \
                dict(num_rounds=R, depth=D, route=self.route, want_top=want_top, guard=self._guard([], B),
                     multi_rows=np.arange(B, dtype=np.int32) if self._row_layout else None,
                     min_n=lp.min_n, max_n=lp.max_n, tree_nodes=nodes, **self._ends([], B), **self._loop_state([], B))
        if key[0] == "decode":
            _, B, M, k, want_top, pen = key
            zeros_b = np.zeros((B,), np.int32)
            args = (zeros_b, zeros_b, np.zeros((B, M), np.int32), np.zeros((B,), bool), zeros_b,
                    SamplingArrays.greedy(B))
            kw = dict(num_steps=k, route=self.route, want_top=want_top,
                      penalties=shapes.dummy_penalties(B, pen, self.cfg.vocab_size), guard=self._guard([], B),
                      rows=self._padding_rows(B, B, 0), **self._ends([], B))
            if self.mtp_depth:
                kw.update(mtp_cap=np.zeros((B,), np.int32), mtp_depth=self.mtp_depth)
            return "decode", args, kw
        # "mixed", or "verify": a mixed step with K draws per row
        if key[0] == "verify":
            _, N, B, M, pen, Bp, K, tree, Bpre, Bs, Ts = key
        else:
            (_, N, B, M, pen, Bp), K, tree, Bpre, Bs, Ts = key, 1, False, key[5], 0, 0
        R = B * K
        dropped = np.full((N,), self.num_blocks * self.block_size, np.int32)
        args = (np.zeros((N,), np.int32), np.zeros((N,), np.int32), dropped,
                np.zeros((B, M), np.int32), np.ones((B,), np.int32), np.arange(B + 1, dtype=np.int32),
                np.zeros((B, K), np.int32), np.zeros((R,), np.int32), SamplingArrays.greedy(R))
        kw = dict(route=self.route, want_top=True, penalties=shapes.dummy_penalties(R, pen, self.cfg.vocab_size),
                  allowed=self._allowed([], B, K), guard=self._guard([], B),
                  rows=self._padding_rows(B, N, Bpre, Bs, Ts),
                  multi_rows=np.full((Bp,), B, np.int32) if self._row_layout else None)
        if K > 1:
            kw.update(drafts=DraftArrays(np.zeros((B, K - 1), np.int32), np.full((B, K - 1), -2, np.int32)),
                      tree=(np.full((B,), 2**30, np.int32), np.zeros((N,), np.int32)) if tree else None)
        if self.mtp_depth:
            kw.update(mtp=self._mtp_rows(N, B), mtp_depth=self.mtp_depth)
        return "mixed", args, kw

    def done_warming(self) -> None:
        jax.block_until_ready(self.kv.k[0])

    def _padding_rows(self, B: int, N: int, Bp: int, Bs: int = 0, Ts: int = 0) -> StateRows | None:
        """Hybrids: StateRows of B rows over N tokens, Bp of them feeding several (0: none), Bs x Ts
        verify rows (0: none); all padding."""
        if not self.hybrid:
            return None
        S = self.state_slots
        dec = (np.full((B,), N, np.int32), np.full((B,), S, np.int32), np.zeros((B,), bool))
        spec = {}
        if Bs:
            spec = dict(spec_tok=np.full((Bs, Ts), N, np.int32), spec_par=np.full((Bs, Ts), -1, np.int32),
                        spec_commit=np.zeros((Bs,), np.int32), spec_slot=np.full((Bs,), S, np.int32),
                        spec_fresh=np.zeros((Bs,), bool))
        if not Bp:
            return StateRows(*dec, **spec)
        return StateRows(*dec, np.full((Bp, N), N, np.int32), np.zeros((Bp,), np.int32),
                         np.full((Bp,), S, np.int32), np.zeros((Bp,), bool), **spec)

    @staticmethod
    def _layout_sizes(rows: StateRows | None) -> tuple[int, int, int]:
        """(prefill rows, verify rows, verify tokens) of hybrids' state layouts (zeros otherwise)."""
        if rows is None:
            return 0, 0, 0
        Bpre = 0 if rows.pre_tok is None else rows.pre_tok.shape[0]
        return (Bpre, *((0, 0) if rows.spec_tok is None else rows.spec_tok.shape))

    def spec_keys(self) -> list[tuple]:
        """One stream's device-side rounds at the first session's table widths (spec_steps), for
        the engine to warm while idle once ready."""
        if self.loop is None:
            return []
        W = self.table_width(1)
        lp = self.loop
        return [shapes.spec(1, M, lp.rounds, lp.depth, False, lp.nodes) for M in (W, 2 * W, 4 * W)]

    def verify_keys(self, depth: int) -> list[tuple]:
        """The verify steps one stream meets most (chains of 3 and of `depth` tokens, a short context):
        the engine warms them while idle once ready."""
        out = []
        for d in sorted({min(3, depth), depth}):   # (a short draft and a full one, as _mixed pads them;
                                                   # hybrids: one known token)
            N = steps.bucket(1 + d, minimum=4)
            sizes = (0, 1, steps.bucket(1 + d, minimum=1)) if self.hybrid else (0, 0, 0)
            out.append(shapes.verify(N, 1, self.table_width(1), None, 1 if self._row_layout else 0,
                                     1 + steps.bucket(d, minimum=1), False, *sizes))
        return list(dict.fromkeys(out))

