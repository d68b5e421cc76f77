"""Which sequences run this step, and on how many tokens.

Running sequences go first (decodes and unfinished prefill chunks, oldest first), then waiting ones
are admitted FIFO while the token budget, the sequence limit and the free blocks allow. With chunked
prefill a long prompt is fed in budget-sized pieces, so it never stalls running decodes. When the
pool runs out, the youngest running sequence is preempted: its blocks are freed and it is recomputed
later (its prompt and outputs so far are simply prefilled again)."""
from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, bm: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, decode_steps: int = 1):
        self.bm = bm
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.decode_steps = decode_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        self.bm.release(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> tuple[list[tuple[Sequence, int]], int]:
        """Returns [(seq, tokens to feed)] and the number of decode steps to run (> 1 only when every
        scheduled sequence is decoding and nothing is waiting that could be admitted)."""
        budget = self.budget
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_pending, budget)
            if n < seq.num_pending and not self.chunked:
                continue
            if n == 0:
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            if n < seq.num_pending and not self.chunked:
                break
            if not self.bm.can_grow(seq, seq.num_computed + n):
                break
            self.waiting.popleft()
            self.bm.grow(seq, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        steps = 1
        if self.decode_steps > 1 and plan and not self.waiting and all(s.decoding and s.constraint is None
                                                                          for s, _ in plan):
            steps = self.decode_steps
            if sum(max(0, self.bm.blocks_for(s.num_computed + steps) - len(s.block_ids))
                   for s, _ in plan) <= self.bm.num_free:
                for s, _ in plan:
                    self.bm.grow(s, s.num_computed + steps)
            else:
                steps = 1
        return plan, steps
