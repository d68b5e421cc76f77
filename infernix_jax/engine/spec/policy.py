"""Whether a sequence drafts this round, with which method, and how deep.

`--speculative ngram` drafts whenever the drafter finds something, as deep as allowed. `auto` (the
default) drafts only where a round should pay: it keeps, per engine, the measured time of plain
decode steps (per token, by batch size) and of mixed / verify steps (by token count), and per
sequence and method an estimate of the chance a draft token is accepted, alpha. A chain of k
tokens then emits E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens in one verify step; the depth with
the best E(k) / t_verify is taken if that beats plain decoding's 1 / t_decode by a margin. Big
batches are compute-bound, so there the extra tokens cost real time and auto stops drafting; a
sequence whose drafts keep failing sees its alpha fall and stops too (a round now and then keeps
the estimate fresh)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ...choices import SPECULATIVE
from .. import steps
from . import ngram
from .draft import Draft

PRIOR_ALPHA, PRIOR_WEIGHT = 0.5, 2.0    # what a sequence's acceptance is taken to be before it drafts
DECAY = 0.8                             # per round: recent rounds count most (a copy starts, then ends)
MARGIN = 1.05                           # auto drafts when it expects >= 5 % more tokens per second
RETRY = 16                              # auto, after declining: tokens until it looks again anyway


@dataclasses.dataclass
class MethodStats:
    """Counts of one drafting method (an engine's, or one sequence's)."""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


class SeqStats:
    """One sequence's acceptance estimates (decayed successes and trials per method)."""

    def __init__(self):
        self.ok: dict[str, float] = {}
        self.trials: dict[str, float] = {}
        self.counts: dict[str, MethodStats] = {}
        self.wait = 0                      # auto: tokens to go before it considers drafting again

    def alpha(self, method: str) -> float:
        return (self.ok.get(method, 0.0) + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.trials.get(method, 0.0) + PRIOR_WEIGHT)

    def observe(self, method: str, depth: int, accepted: int) -> None:
        """A round drafted `depth` tokens deep and `accepted` of them held: accepted successes, and
        one failure unless all held."""
        self.ok[method] = self.ok.get(method, 0.0) * DECAY + accepted
        self.trials[method] = self.trials.get(method, 0.0) * DECAY + accepted + (accepted < depth)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify round of a k-token chain emits when each holds with chance alpha."""
    return float(sum(alpha ** i for i in range(k + 1)))


class Timings:
    """Measured step times (EMAs): plain decode per token by batch bucket, mixed steps by tokens."""

    def __init__(self):
        self.decode: dict[int, float] = {}
        self.mixed: dict[int, float] = {}

    @staticmethod
    def _ema(table: dict, key: int, value: float) -> None:
        table[key] = value if key not in table else 0.8 * table[key] + 0.2 * value

    def record(self, plan, num_steps: int, seconds: float) -> None:
        B = steps.bucket(len(plan), minimum=1)
        if num_steps > 1:
            self._ema(self.decode, B, seconds / num_steps)
        else:
            self._ema(self.mixed, steps.bucket(sum(n for _, n in plan)), seconds)

    def plain(self, B: int) -> float | None:
        """Seconds per token of plain decoding at batch B (a decode dispatch's, else a 1-token step's)."""
        B = steps.bucket(B, minimum=1)
        return self.decode.get(B) or self.mixed.get(steps.bucket(B))

    def verify(self, tokens: int) -> float | None:
        """Seconds of a step of this many tokens: measured at its bucket, else scaled from the
        nearest smaller bucket measured (by tokens: an upper bound while steps are overhead-bound)."""
        N = steps.bucket(tokens)
        if N in self.mixed:
            return self.mixed[N]
        below = [n for n in self.mixed if n < N]
        return self.mixed[max(below)] * N / max(below) if below else None


class Speculator:
    """The engine's drafting: propose() before each schedule, observe() after each verify."""

    def __init__(self, mode: str, max_tokens: int, tree_nodes: int = 0, min_n: int = 2, max_n: int = 8):
        if mode not in SPECULATIVE:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE)} (got {mode!r})")
        self.mode, self.k, self.tree_nodes, self.min_n, self.max_n = mode, max_tokens, tree_nodes, min_n, max_n
        self.timings = Timings()
        self.stats: dict[str, MethodStats] = {}
        # drafter(seq, ids [L] int32, k) -> Draft | None: the n-gram lookup (tests put others here)
        self.drafter = lambda seq, ids, k: ngram.propose(ids, k, self.min_n, self.max_n, self.tree_nodes)

    def propose(self, seq, batch: int, tokens_left: int) -> Draft | None:
        """A draft for seq at this batch size (None: decode plainly this round)."""
        st = seq.spec = seq.spec or SeqStats()
        k = min(self.k, tokens_left - 1)        # (a round emits at most k + 1 tokens)
        if k < 1:
            return None
        if self.mode == "auto" and st.wait > 0:
            st.wait -= 1
            return None
        ids = np.asarray(seq.all_ids, np.int32)
        d = self.drafter(seq, ids, k)
        if d is None or self.mode != "auto":
            return d
        depth = self._depth(st.alpha(d.method), len(d) if d.is_chain else max(d.depths()), len(d), batch)
        if depth == 0:
            st.wait = RETRY
            return None
        return d if not d.is_chain else d.truncated(depth)

    def _depth(self, alpha: float, depth: int, nodes: int, batch: int) -> int:
        """auto: the draft depth worth verifying (0: none) for a sequence with this alpha, given a
        draft `depth` deep of `nodes` nodes (a tree is taken whole or not at all)."""
        plain = self.timings.plain(batch)
        best, best_rate = 0, 1.0 / plain if plain else None
        for k in (range(1, depth + 1) if nodes == depth else (depth,)):
            t = self.timings.verify(batch + (k if nodes == depth else nodes))
            if t is None or best_rate is None:
                return depth              # nothing measured yet: draft, and measure
            rate = expected_tokens(alpha, k) / t
            if rate > best_rate * (MARGIN if best == 0 else 1.0):
                best, best_rate = k, rate
        return best

    def observe(self, seq, draft: Draft, accepted: int) -> None:
        depth = max(draft.depths())
        if seq.spec is not None:
            seq.spec.observe(draft.method, depth, accepted)
        for table in (self.stats, (seq.spec.counts if seq.spec is not None else {})):
            m = table.setdefault(draft.method, MethodStats())
            m.rounds += 1
            m.drafted += depth
            m.accepted += accepted


__all__ = ["SPECULATIVE", "MethodStats", "SeqStats", "Speculator", "Timings", "expected_tokens"]
