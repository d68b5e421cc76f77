"""Which sequences run this step, and on how many tokens.

Running sequences go first (decodes and unfinished prefill chunks, oldest first), then waiting ones
are admitted FIFO while the token budget, the sequence limit and the free blocks allow. With chunked
prefill a long prompt is fed in budget-sized pieces, so it never stalls running decodes. When the
pool runs out, the youngest running sequence is preempted: its blocks are freed and it is recomputed
later (its prompt and outputs so far are prefilled again, mostly out of the prefix cache: its
blocks stay cached when it is freed).

Speculative decoding: a running sequence may carry a draft (seq.draft, spec/); its tokens ride
after its known ones in the same row, within the budget and the free blocks (else the draft is
dropped, never the sequence's own tokens), and a step with drafts runs one dispatch.

With a prefix cache, a sequence admitted with no blocks first takes over the longest cached prefix
of its tokens (prefix_cache.lookup), so only the rest is fed.

Fair service under KV pressure: while the head of the queue waits for KV blocks, running sequences
get bounded turns: `turn_s` of output once their first token of the turn came (prefill and
recovery are never cut short: a sequence rotated out mid-recompute could find its progress evicted
by the time it returns, and never emit a token); when one's turn is over it goes to the back of
the queue, its blocks left in the prefix cache, and the waiting head starts. So every request is served in rotation instead of the
oldest taking everything, and a paused one resumes from its cached prefix, recomputing only what
the cache lost.

Hybrid models (state_slots > 0) also give each running sequence a slot of the state pool, cap the
rows that feed several tokens in one step (max_prefill_rows: their padded layout is sized by it),
and with `align` end every prefill chunk that stops inside the prompt on a multiple of `align`
tokens, where the engine can snapshot the state."""
from __future__ import annotations

import time
from collections import deque

from ..cache.block_manager import BlockManager
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, bm: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, decode_steps: int = 1, state_slots: int = 0,
                 max_prefill_rows: int | None = None, align: int = 0, cache=None,
                 turn_s: float = 1.0):
        self.bm = bm
        self.turn_s = turn_s                  # fair service (0: off)
        self.clock = time.monotonic
        self.kv_starved = False               # the queue's head waited for KV blocks at the last schedule
        self.num_rotations = 0
        self.cache = cache                    # prefix_cache.PrefixCache or None
        self.on_release = None                # callback(seq) before a sequence's blocks and slot are freed
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.decode_steps = decode_steps
        self.lookahead = 0                    # slots kept ahead of a running sequence when free (the MTP head's chain)
        self.loop_pending = 1                 # known tokens a row may bring into a multi-step dispatch (hybrids' rounds)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_requeued = 0                 # preemptions and recomputes asked for by the engine
        self.state_slots = state_slots
        self.free_slots: list[int] = list(range(state_slots))[::-1]
        self.max_prefill_rows = max_prefill_rows
        self.align = align

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        seq.staged = None
        seq.draft = None
        if self.on_release is not None and seq.block_ids:
            self.bm.seal_full_blocks(seq)      # (a sequence can end on the step that fills a block)
            self.on_release(seq)
        self.bm.release(seq)
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.kv_starved = True
        self.requeue(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence, front: bool = True) -> None:
        """Free a running sequence's blocks and state slot and put it first (or last) in the queue:
        it is recomputed from its prompt and outputs so far (mostly out of the prefix cache)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.num_requeued += 1

    def _rotate(self) -> None:
        """Fair service: while the queue's head waits for KV, the running sequence whose turn has
        lasted longest, if over, yields to it (one per step)."""
        if not (self.turn_s and self.kv_starved and self.waiting and self.running):
            return
        head = self.waiting[0]
        if self.bm.blocks_for(len(head) + 1) <= self.bm.num_free:
            return                            # it fits now: no one needs to yield
        now = self.clock()
        done = [s for s in self.running if s.turn_out is not None and now - s.turn_out >= self.turn_s]
        if done:
            self.requeue(min(done, key=lambda s: s.turn_start), front=False)
            self.num_rotations += 1

    def _chunk(self, seq: Sequence, budget: int, done: int | None = None) -> int:
        """Tokens of seq to feed this step under the budget (0: none, it waits), when `done` of its
        tokens are computed (default: num_computed)."""
        done = seq.num_computed if done is None else done
        pending = len(seq) - done
        n = min(pending, budget)
        if n < pending and not self.chunked:
            return 0
        if self.align and done + n < len(seq.prompt_ids) and n < pending:
            end = (done + n) // self.align * self.align      # stop on a snapshot boundary
            n = end - done if end > done else n
        elif self.align and self.chunked and n > 1:     # the prompt's last boundary inside this chunk: stop there
            end = len(seq.prompt_ids) // self.align * self.align
            if done < end < done + n:
                n = end - done
        return n

    def _fits(self, seq: Sequence, plan, budget: int, hit) -> int:
        """Tokens to feed seq this step if it starts now with this cache hit (0: it cannot)."""
        done = hit.tokens if hit else seq.num_computed
        n = self._chunk(seq, budget, done)
        if n == 0 or self._prefill_rows_full(plan, n):
            return 0
        have = hit.device_blocks if hit else len(seq.block_ids)
        if self.bm.blocks_for(done + n) - have > self.bm.num_free - (hit.pinned_free if hit else 0):
            self.kv_starved = True
            return 0
        if self.state_slots and not self.free_slots:
            return 0                       # cannot happen while slots == max_num_seqs; never run slotless
        return n

    def _admit(self, seq: Sequence, plan, budget: int) -> int:
        """Tokens to feed a waiting sequence if it can start now (taking its cached prefix), else 0."""
        if seq.fetching is not None:        # its SSD read runs in the background; the others step on
            if not seq.fetching.done() and (plan or self.running):
                return 0
            self.cache.take_fetched(seq)     # (waits for it when nothing else could run meanwhile)
        # (prompt logprobs need every prompt token computed: no hit)
        hit = self.cache.lookup(seq) if self.cache is not None and not seq.block_ids \
            and seq.params.prompt_logprobs is None else None
        n, skipped = self._fits(seq, plan, budget, hit), 0
        if n and hit is not None and hit.on_disk:           # read the SSD only when about to admit
            rest = self.cache.drop_disk(seq, hit)
            if self.cache.start_fetch(seq, hit, rest):
                return self._admit(seq, plan, budget)      # once: after the read nothing is on disk
            skipped, hit = hit.tokens - (rest.tokens if rest else 0), rest      # computing is faster
            n = self._fits(seq, plan, budget, hit)
        if n == 0:
            return 0
        if self.cache is not None and not seq.block_ids:
            self.cache.count_query(seq)
            self.cache.stats["ssd_skipped"] += skipped
            if hit:
                self.cache.commit(seq, hit)
        seq.staged = None                    # what an SSD read brought is taken (or not needed)
        seq.state_dirty = False
        seq.turn_start, seq.turn_out = self.clock(), None
        seq.admitted = True
        return n

    def _prefill_rows_full(self, plan, n: int) -> bool:
        return n > 1 and self.max_prefill_rows is not None and \
            sum(m > 1 for _, m in plan) >= self.max_prefill_rows

    def _grow_lookahead(self, plan, steps: int) -> None:
        """The MTP head's chain's slots past what each planned sequence feeds, once the plan is made and
        only from blocks it leaves free (never preempting or holding back another sequence for them:
        the chain stops where its slots do, spec/mtp.py)."""
        for seq, n in plan:
            want = seq.num_computed + max(n, steps) + self.lookahead
            if self.bm.can_grow(seq, want):
                self.bm.grow(seq, want)

    def multi_step_ok(self, seqs, pending: int = 1) -> bool:
        """Whether these rows may run several decode steps in one dispatch: all decoding (pending > 1:
        with at most that many known tokens to feed, as a hybrid's device-side rounds take them), no
        grammar and no draft among them, and nothing waiting that could be admitted meanwhile."""
        return not self.waiting and all(s.out_ids and 1 <= s.num_pending <= pending and s.constraint is None
                                        and not s.draft for s in seqs)

    def grow_ahead(self, plan, tokens) -> bool:
        """Blocks for `tokens` more slots of every row of the plan (an int, or seq -> int), if the
        pool has them all."""
        ahead = tokens if callable(tokens) else (lambda s: tokens)
        if sum(max(0, self.bm.blocks_for(s.num_computed + ahead(s)) - len(s.block_ids)) for s, _ in plan) \
                > self.bm.num_free:
            return False
        for s, _ in plan:
            self.bm.grow(s, s.num_computed + ahead(s))
        return True

    def schedule(self) -> tuple[list[tuple[Sequence, int]], int]:
        """Returns [(seq, tokens to feed)] and the number of decode steps to run (> 1 only when every
        scheduled sequence is decoding and nothing is waiting that could be admitted)."""
        self._rotate()
        self.kv_starved = False
        budget = self.budget
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            if seq.draft is not None:             # speculation: the draft rides after the known tokens
                seq.draft = seq.draft.truncated(budget - n) if n == seq.num_pending else None
                n += len(seq.draft) if seq.draft else 0
            if n == 0 or (not seq.draft and self._prefill_rows_full(plan, n)):
                seq.draft = None
                continue
            if not self.bm.can_grow(seq, seq.num_computed + n) and seq.draft:
                n -= len(seq.draft)               # (no blocks for the draft: verify nothing this step)
                seq.draft = None
                if self._prefill_rows_full(plan, n):
                    continue
            while not self.bm.can_grow(seq, seq.num_computed + n):
                victims = [s for s in self.running if s is not seq and all(s is not p for p, _ in plan)]
                if not victims:
                    break
                self._preempt(victims[-1])
            if not self.bm.can_grow(seq, seq.num_computed + n):
                self._preempt(seq)
                continue
            self.bm.grow(seq, seq.num_computed + n)
            plan.append((seq, n))
            budget -= n
            if seq.turn_out is None and seq.decoding:
                seq.turn_out = self.clock()      # its turn of output starts
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, plan, budget)
            if n == 0:
                break
            self.waiting.popleft()
            if self.state_slots:
                seq.state_slot = self.free_slots.pop()
            self.bm.grow(seq, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        steps = 1
        if self.decode_steps > 1 and plan and self.multi_step_ok([s for s, _ in plan], self.loop_pending):
            steps = self.decode_steps if self.grow_ahead(plan, self.decode_steps) else 1
        if self.lookahead:
            self._grow_lookahead(plan, steps)
        return plan, steps
