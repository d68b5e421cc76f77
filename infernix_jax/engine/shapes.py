"""The step shapes the runner compiles, as keys, and which of them a start warms up.

A key names everything a jitted step's compiled form depends on (all plain values, JSON-friendly):
  ("mixed", N, B, M, pen, Bp)            a ragged step of N tokens over B rows, block tables [B, M];
                                         pen: None or (L, Lp), the penalty histories' widths;
                                         Bp: the rows feeding several tokens, bucketed (0:
                                         none; hybrids lay their state rows out by it too)
  ("decode", B, M, k, want_top, pen)     k decode steps of B rows in one dispatch
  ("verify", N, B, M, pen, Bp, K, tree, Bpre, Bs, Ts)
                                         a mixed step with drafts (speculative decoding): K draws
                                         per row, tree masks or not; hybrids' state layouts: Bpre
                                         prefill rows, Bs x Ts verify rows (0 elsewhere)
  ("spec", B, M, R, D, want_top, T)     R rounds of device-side n-gram speculation, D-token drafts
                                         (chains; T > 0: trees of T nodes)
  ("copy",)                              the prefix cache's block copy
A mixed step always takes a token mask and returns the top log-probabilities (one compiled form
whether or not a row is constrained or asks for logprobs); decode keeps want_top apart (it is the
hot path on GPUs).

Warm-up (Engine.start): `first_session` before the server says it is ready (short and long prompts,
each batch size, follow-up turns, concurrent arrivals, logprobs), then the shapes earlier runs of the
same engine met (`Seen`, saved beside the compilation cache); requests that come meanwhile go first. With JAX's persistent
compilation cache a shape compiled once is read back by later starts in a fraction of a second."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np

from .sampler import Penalties
from .steps import bucket

log = logging.getLogger("infernix.engine")


def mixed(N: int, B: int, M: int, pen: Penalties | None, Bp: int) -> tuple:
    return ("mixed", N, B, M, _pen(pen), Bp)


def verify(N: int, B: int, M: int, pen: Penalties | None, Bp: int, K: int, tree: bool, Bpre: int = 0, Bs: int = 0,
           Ts: int = 0) -> tuple:
    return ("verify", N, B, M, _pen(pen), Bp, K, bool(tree), Bpre, Bs, Ts)


def decode(B: int, M: int, k: int, want_top: bool, pen: Penalties | None) -> tuple:
    return ("decode", B, M, k, bool(want_top), _pen(pen))


def spec(B: int, M: int, R: int, D: int, want_top: bool, nodes: int = 0) -> tuple:
    return ("spec", B, M, R, D, bool(want_top), nodes)


def _pen(p: Penalties | None):
    return None if p is None else (int(p.out_ids.shape[1]), int(p.seen_ids.shape[1]))


def dummy_penalties(B: int, pen, V: int) -> Penalties | None:
    """Neutral penalties of the widths a key names (None: none)."""
    if pen is None:
        return None
    L, Lp = pen
    return Penalties(np.full((B, L), V, np.int32), np.zeros((B, L), np.int32), np.full((B, Lp), V, np.int32),
                     np.zeros((B,), np.float32), np.zeros((B,), np.float32), np.ones((B,), np.float32))


def _pow2(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


class Limits:
    """What bounds the shapes: the scheduler's limits and the runner's bucketing."""

    def __init__(self, max_num_seqs: int, budget: int, block_size: int, max_context: int, decode_steps: int,
                 width, multi_bucket):
        self.max_num_seqs, self.budget, self.bs = max_num_seqs, budget, block_size
        self.max_context, self.k, self.width = max_context, decode_steps, width
        self.multi = multi_bucket          # (count, B) -> the Bp of a step (Runner.multi_bucket)

    def W(self, tokens: int) -> int:
        """The block-table width of rows of up to `tokens` tokens."""
        return self.width(-(-min(tokens, self.max_context) // self.bs))


def first_session(lim: Limits) -> list[tuple]:
    """The shapes a first session meets, most needed first: one short prompt and its reply (the
    README's curl), longer prompts and their chunks, replies at each batch size, a follow-up turn
    (a prefix-cache hit), requests joining running ones, logprobs, the prefix cache's copy."""
    N_max = bucket(lim.budget)
    Ns = _pow2(16, N_max)
    Bs = _pow2(1, bucket(lim.max_num_seqs, minimum=1))
    Wmin = lim.W(1)
    one = lim.multi(1, 1)          # the Bp of a step with one prompt (0 where steps take any layout)
    # first what one short chat turn needs (a prompt of up to 64 tokens, its reply, the next turn
    # resuming from the prefix cache), so that a request sent right after launch finds it warm
    out = [("mixed", min(64, N_max), 1, lim.W(64), None, one)]
    if lim.k > 1:
        out.append(("decode", 1, Wmin, lim.k, False, None))
    out += [("mixed", 16, 1, Wmin, None, one), ("copy",)]
    out += [("mixed", N, 1, lim.W(N), None, one) for N in Ns]               # one prompt
    if lim.k > 1:
        out += [("decode", B, Wmin, lim.k, False, None) for B in Bs]                    # replies
    out += [("mixed", N, 1, lim.W(4 * Wmin * lim.bs), None, one) for N in (16, 64)]   # turns
    if lim.k > 1:
        out += [("decode", 1, lim.W(t), lim.k, False, None) for t in (2 * Wmin * lim.bs, 4 * Wmin * lim.bs)]
        out.append(("decode", 1, Wmin, lim.k, True, None))                               # logprobs
    out.append(("mixed", 16, 1, Wmin, None, 0))                    # a constrained reply's tokens
    for B in Bs[1:]:              # one arrival beside running requests; several prompts at once
        for N in sorted({min(64, N_max), N_max}):
            Bps = sorted({lim.multi(1, B), lim.multi(B, B)})
            out += [("mixed", N, B, Wmin, None, Bp) for Bp in Bps if N >= 2 * Bp]
    out += [("mixed", N_max, 1, lim.W(t), None, one)       # a long prompt's chunks
            for t in _pow2(2 * N_max, 4096) if t <= lim.max_context]
    return list(dict.fromkeys(out))


def every(lim: Limits) -> list[tuple]:
    """Every shape the scheduler can produce without penalties (--warmup full)."""
    Ns = _pow2(16, bucket(lim.budget))
    Bs = _pow2(1, bucket(lim.max_num_seqs, minimum=1))
    Ms = _pow2(lim.W(1), lim.W(lim.max_context + lim.k))
    out = []
    for B in Bs:
        for M in Ms:
            for N in (N for N in Ns if N >= B):
                Bps = {lim.multi(c, B) for c in range(min(B, N // 2) + 1)}      # (rows of >= 2 tokens)
                out += [("mixed", N, B, M, None, Bp) for Bp in sorted(Bps)]
            if lim.k > 1:
                out += [("decode", B, M, lim.k, top, None) for top in (False, True)]
    return [("copy",), *out]


# Warm-up runs each shape once besides compiling it (the first run of an executable has a fixed
# cost: XLA:CPU packs the weights for its YNNPACK matmuls, ~0.5 s for SmolLM2), except the shapes of
# long contexts, whose steps take seconds on the CPU anyway: running those would only delay ready.
RUN_CONTEXT = 2048


def worth_running(key: tuple, block_size: int) -> bool:
    if key[0] == "copy":
        return True
    M = key[3] if key[0] in ("mixed", "verify") else key[2]       # (decode, spec: key[2])
    return M * block_size <= RUN_CONTEXT


class Seen:
    """The step shapes run so far and how often, loaded from and saved to a small JSON file beside
    the compilation cache (one per engine identity: model, pool and limits)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.path: Path | None = None
        self.dirty = False

    def seen(self, key: tuple) -> None:
        if key not in self.counts:
            self.dirty = True
        self.counts[key] += 1

    def attach(self, directory: str | None, identity: str) -> list[tuple]:
        """Keep the record in `directory` under this identity; returns what earlier runs saw, most
        often met first ([] without a directory, a file, or with a damaged one)."""
        if not directory:
            return []
        name = hashlib.blake2b(identity.encode(), digest_size=10).hexdigest()
        self.path = Path(directory) / f"infernix-shapes-{name}.json"
        try:
            d = json.loads(self.path.read_text())
            earlier = Counter({_key(k): int(n) for k, n in d["shapes"]})
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring %s (%s)", self.path, e)
            return []
        self.counts.update(earlier)
        return [k for k, _ in earlier.most_common()]

    def save(self) -> None:
        """Write the record (atomically) if it holds a shape the file does not."""
        if self.path is None or not self.dirty:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"shapes": [[list(k), n] for k, n in self.counts.most_common()]}))
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as e:
            log.warning("could not save %s: %s", self.path, e)


def _key(k: list) -> tuple:
    """A key back from JSON (lists -> tuples), checked for its kind."""
    if not isinstance(k, list) or not k or k[0] not in ("mixed", "decode", "verify", "spec", "copy"):
        raise ValueError(f"not a step shape: {k!r}")
    return tuple(tuple(x) if isinstance(x, list) else x for x in k)
