"""Whether a sequence drafts this round, with which method, and how deep.

`--speculative ngram` drafts whenever the drafter finds something, as deep as allowed. `auto` (the
default) drafts only where a round should pay: it keeps, per engine, the measured time of plain
decode steps (per token, by batch size) and of mixed / verify steps (by token count), and per
sequence and method the chance that a draft token at each depth holds (SeqStats). A draft k deep
then emits E(k) tokens in one verify step; the depth with
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
from .draft import MAX_NODES, Draft

# what a draft token's chance to hold is taken to be before a sequence has drafted, by the n-gram
# match behind it (a match of the whole window is most likely a copy going on; measured on the
# bench's copy workloads: short matches held 0.5-1.2 tokens a round, mid and full ones 4-5 of 7)
PRIORS = {"short": 0.3, "mid": 0.7, "full": 0.8,
          "mtp": 0.6}       # (the MTP head: not measured here, no checkpoint with one can be had offline)
PRIOR_ALPHA, PRIOR_WEIGHT = 0.5, 0.5    # (other kinds' prior; how many rounds a prior is worth)
DECAY = 0.9                             # per round: recent rounds count most (a copy starts, then ends)
MARGIN = 1.05                           # auto drafts when it expects >= 5 % more tokens per second
PROBE_EVERY = 16                        # auto, while declining: a round every 16 tokens or so anyway,
MAX_PROBE_EVERY = 128                   # twice as far after each probe that held less than PROBE_PAYS
PROBE_PAYS = 2                          # draft tokens (a verify step costs ~3 plain ones on the CPU)
PROBE_DISPATCHES = 8                    # auto: the other of loop / plain decode 8 dispatches later,
MAX_PROBE_GAP = 256                     # then twice as long after each probe that did not change the
                                        # pick (a loop dispatch at batch 64 costs a few plain ones)


@dataclasses.dataclass(frozen=True)
class Loop:
    """Device-side n-gram speculation (steps.spec_steps): up to `rounds` rounds per dispatch, each
    verifying a chain of up to `depth` tokens found by prompt lookup (min_n..max_n-token matches),
    or with nodes > 0 a tree of that many nodes (--ngram-tree-nodes). A batch of decoding rows takes
    it instead of plain decode steps: the host leaves the rounds alone, so none waits on Python
    between them."""
    depth: int
    rounds: int
    min_n: int = 2
    max_n: int = 8
    nodes: int = 0

    @property
    def method(self) -> str:
        return "tree" if self.nodes else "ngram"

    @property
    def tree_extra(self) -> int:
        """The slots a round's tree takes past its deepest path."""
        return max(0, self.nodes - self.depth)

    def span(self) -> int:
        """The slots a dispatch may write past a row's last token: every round's tokens, and the
        last round's whole tree."""
        return self.rounds * (self.depth + 1) + self.tree_extra


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
    """One sequence's acceptance, per method and draft depth: of the (decayed) rounds that reached
    depth j (all nodes before it held), how many held at j too. Drafts are often all or nothing (a
    copy holds until the text departs from it), which one acceptance rate per token would miss:
    past the first tokens of a copy the next one is much more likely to hold."""

    def __init__(self):
        self.reach: dict[str, np.ndarray] = {}
        self.hold: dict[str, np.ndarray] = {}
        self.counts: dict[str, MethodStats] = {}
        self.probe_at = 0                  # auto: the output length at which a declined sequence probes again
        self.probe_gap = PROBE_EVERY       # (tokens after the next probe; doubles while probes fail)
        self.probing = False               # the round in flight is a probe

    def holds(self, method: str, k: int) -> np.ndarray:
        """[k]: the chance each depth 1..k holds, given those before it did."""
        reach = self.reach.get(method, np.zeros(MAX_NODES))[:k]
        hold = self.hold.get(method, np.zeros(MAX_NODES))[:k]
        prior = PRIORS.get(method.rpartition("-")[2], PRIOR_ALPHA)
        return (hold + prior * PRIOR_WEIGHT) / (reach + PRIOR_WEIGHT)

    def alpha(self, method: str) -> float:
        """The chance a first draft token holds."""
        return float(self.holds(method, 1)[0])

    def expected(self, method: str, k: int) -> float:
        """Tokens a verify round of a k-deep draft emits (the target's own token included)."""
        return 1.0 + float(np.cumprod(self.holds(method, k)).sum())

    def observe(self, method: str, depth: int, accepted: int) -> None:
        """A round drafted `depth` deep and `accepted` held: depths 1..accepted held, and the next
        one (if drafted) was reached and failed."""
        reach = self.reach.setdefault(method, np.zeros(MAX_NODES))
        hold = self.hold.setdefault(method, np.zeros(MAX_NODES))
        reach *= DECAY
        hold *= DECAY
        reach[:min(accepted + 1, depth)] += 1
        hold[:accepted] += 1


class Timings:
    """Measured step times (EMAs): plain decode per token by batch bucket, mixed steps by tokens."""

    def __init__(self):
        self.decode: dict[int, float] = {}
        self.mixed: dict[int, float] = {}
        self.per_token: dict[tuple[str, int], float] = {}    # ("loop" | "plain", B): seconds per token emitted

    @staticmethod
    def _ema(table: dict, key: int, value: float) -> None:
        table[key] = value if key not in table else 0.8 * table[key] + 0.2 * value

    def record(self, plan, num_steps: int, seconds: float, emitted: int = 0, rounds: int = 0) -> None:
        """A dispatch's time: emitted (its tokens, all rows) and rounds > 0 for a spec_steps one."""
        B = steps.bucket(len(plan), minimum=1)
        if rounds or num_steps > 1:
            self._ema(self.per_token, ("loop" if rounds else "plain", B), seconds / max(emitted, 1))
        if rounds:
            return
        if num_steps > 1:
            self._ema(self.decode, B, seconds / num_steps)
        else:
            self._ema(self.mixed, self.tokens_bucket(sum(n for _, n in plan), any(s.draft for s, _ in plan)), seconds)

    @staticmethod
    def tokens_bucket(tokens: int, drafted: bool = True) -> int:
        """A step's token count as the runner pads it (runner._mixed)."""
        return steps.bucket(tokens, minimum=4 if drafted else 16)

    def plain(self, B: int) -> float | None:
        """Seconds per token of plain decoding at batch B (a decode dispatch's, else a 1-token step's)."""
        B = steps.bucket(B, minimum=1)
        return self.decode.get(B) or self.mixed.get(self.tokens_bucket(B, False))

    def verify(self, tokens: int) -> float | None:
        """Seconds of a step of this many tokens: measured at its bucket, else scaled by tokens from
        the nearest bucket measured (optimistic below it, so that auto tries a smaller step once
        and measures it)."""
        N = self.tokens_bucket(tokens)
        if N in self.mixed:
            return self.mixed[N]
        if not self.mixed:
            return None
        near = min(self.mixed, key=lambda n: abs(n.bit_length() - N.bit_length()))
        return self.mixed[near] * N / near


class Speculator:
    """The engine's drafting: propose() before each schedule, observe() after each verify."""

    def __init__(self, mode: str, max_tokens: int, tree_nodes: int = 0, min_n: int = 2, max_n: int = 8,
                 mtp: bool = False):
        if mode not in SPECULATIVE:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE)} (got {mode!r})")
        self.mode, self.k, self.tree_nodes, self.min_n, self.max_n = mode, max_tokens, tree_nodes, min_n, max_n
        self.mtp = mtp                   # the steps run the MTP head (its drafts: seq.mtp_next)
        self.loop: Loop | None = None    # device-side rounds, where the engine can run them (Engine)
        self.dispatches = 0
        self._probe: dict[int, tuple[int, int, bool]] = {}   # auto, per batch bucket: (gap, next probe, pick)
        self.timings = Timings()
        self.stats: dict[str, MethodStats] = {}
        self._drafter = lambda seq, ids, k: ngram.propose(ids, k, self.min_n, self.max_n, self.tree_nodes)

    @property
    def drafter(self):
        """drafter(seq, ids [L] int32, k) -> Draft | None: the n-gram lookup (tests put others here;
        the device-side rounds can only look up n-grams, so another drafter turns them off)."""
        return self._drafter

    @drafter.setter
    def drafter(self, fn) -> None:
        self._drafter, self.loop = fn, None

    def propose(self, seq, batch: int, tokens_left: int) -> Draft | None:
        """A draft for seq at this batch size (None: decode plainly this round)."""
        st = seq.spec = seq.spec or SeqStats()
        k = min(self.k, tokens_left - 1)        # (a round emits at most k + 1 tokens)
        if k < 1:
            return None
        ids = np.asarray(seq.all_ids, np.int32)
        found = [] if self.mode == "mtp" else [self.drafter(seq, ids, k)]
        if self.mtp and seq.mtp_next is not None and seq.mtp_next[0] == len(ids):
            found.append(Draft.chain(seq.mtp_next[1][:k], "mtp"))
        found = [d for d in found if d]
        if self.mode != "auto" or not found:
            return found[0] if found else None
        # auto: each drafter's draft at its best depth; the one that should emit the most per second
        (depth, _), d = max(((self._depth(st, d.kind, len(d) if d.is_chain else max(d.depths()), len(d), batch), d)
                             for d in found), key=lambda x: x[0][1])
        if depth == 0:
            # not worth it by the estimate; now and then a round anyway, so that an estimate
            # from a stretch of free text does not stop a copy that starts later
            if len(seq.out_ids) < st.probe_at:
                return None
            st.probe_at, st.probing = len(seq.out_ids) + st.probe_gap, True
            return d
        return d.truncated(depth) if d.is_chain else d

    def _depth(self, st: SeqStats, method: str, depth: int, nodes: int, batch: int) -> tuple[int, float]:
        """auto: the draft depth worth verifying (0: none) for a sequence with these statistics,
        given a draft `depth` deep of `nodes` nodes (a tree is taken whole or not at all), and the
        tokens per second expected of it (inf: nothing measured yet, so draft and measure)."""
        plain = self.timings.plain(batch)
        best, best_rate = 0, 1.0 / plain if plain else None
        for k in (range(1, depth + 1) if nodes == depth else (depth,)):
            t = self.timings.verify(batch + (k if nodes == depth else nodes))
            if t is None or best_rate is None:
                return depth, st.expected(method, depth) * 1e9          # (ranks drafters by E(k) meanwhile)
            rate = st.expected(method, k) / t
            if rate > best_rate * (MARGIN if best == 0 else 1.0):
                best, best_rate = k, rate
        return best, best_rate

    def loop_settings(self, rounds: int) -> Loop | None:
        """The device-side rounds this mode drafts with (None: host rounds only): chains or trees
        (--ngram-tree-nodes) by prompt lookup, for ngram and auto."""
        if self.mode in ("auto", "ngram"):
            return Loop(self.k, rounds, self.min_n, self.max_n, self.tree_nodes)
        return None

    def use_loop(self, batch: int) -> bool:
        """Whether a dispatch of plain decode steps at this batch runs as device-side rounds: always
        under ngram; under auto, whichever of the two emitted tokens faster lately (measured, per
        batch bucket: plain first, then the rounds), the other now and then so that neither goes
        stale: PROBE_DISPATCHES dispatches on, twice as far after each probe that kept the pick."""
        if self.loop is None:
            return False
        if self.mode != "auto":
            return True
        self.dispatches += 1
        B = steps.bucket(batch, minimum=1)
        loop, plain = self.timings.per_token.get(("loop", B)), self.timings.per_token.get(("plain", B))
        if loop is None or plain is None:
            return plain is not None
        better = loop <= plain
        gap, due, last = self._probe.get(B, (PROBE_DISPATCHES, self.dispatches + PROBE_DISPATCHES, better))
        if better != last:              # the pick changed: probe soon again
            gap, due = PROBE_DISPATCHES, self.dispatches + PROBE_DISPATCHES
        probe = self.dispatches >= due
        if probe:
            gap, due = min(2 * gap, MAX_PROBE_GAP), self.dispatches + gap
        self._probe[B] = (gap, due, better)
        return better != probe

    def observe_rounds(self, seq, rounds) -> None:
        """The device-side rounds of one row: (drafted depth, accepted) each."""
        seq.spec = seq.spec or SeqStats()
        for drafted, accepted in rounds:
            self._count(seq, self.loop.method if self.loop else "ngram", drafted, accepted)

    def observe(self, seq, draft: Draft, accepted: int) -> None:
        depth = max(draft.depths())
        st = seq.spec
        if st is not None:
            st.observe(draft.kind, depth, accepted)
            if st.probing:             # free text: probes that fail come ever more rarely (each costs
                st.probing = False     # a verify step for about one token); one that holds resets it
                if accepted >= PROBE_PAYS:
                    st.probe_gap, st.probe_at = PROBE_EVERY, min(st.probe_at, len(seq.out_ids) + PROBE_EVERY)
                else:
                    st.probe_gap = min(2 * st.probe_gap, MAX_PROBE_EVERY)
        self._count(seq, draft.method, depth, accepted)

    def _count(self, seq, method: str, drafted: int, accepted: int) -> None:
        """One verified round in the engine's counts and the sequence's (the request log's)."""
        for table in (self.stats, (seq.spec.counts if seq.spec is not None else {})):
            m = table.setdefault(method, MethodStats())
            m.rounds += 1
            m.drafted += drafted
            m.accepted += accepted


__all__ = ["SPECULATIVE", "Loop", "MethodStats", "SeqStats", "Speculator", "Timings"]
