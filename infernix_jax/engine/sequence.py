"""A request's life inside the engine: its tokens, its blocks, how far its prefill has got."""
from __future__ import annotations

import enum

from .request import Request
from .stops import TextTracker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, req: Request, tracker: TextTracker, stop_ids: set[int]):
        self.req = req
        self.id = req.id
        self.params = req.params
        self.prompt_ids = list(req.prompt_ids)
        self.out_ids: list[int] = []
        self.out_logprobs: list = []          # per token: (logprob, [(id, logprob)] top) when asked for
        self.prompt_lps: list = []            # params.prompt_logprobs: (id, logprob, alternatives) from the 2nd token
        self.tracker = tracker
        self.stop_ids = stop_ids
        self.status = Status.WAITING
        self.block_ids: list[int] = []
        self.block_keys: list[int] = []       # prefix keys of the leading full blocks (block_manager)
        self.num_sealed = 0                   # leading blocks whose key is recorded
        self.num_cached = 0                   # tokens taken from the prefix cache at the last admission
        self.state_dirty = False              # hybrids: the state slot holds more than num_computed tokens
        self.turn_start = 0.0                 # fair service: when its current turn began (admission)
        self.turn_out: float | None = None    # ... and when its first output token of the turn came
        self.admitted = False                 # started at least once (preemption and turns restart it)
        self.fetching = None                  # a Future of the SSD read started for its cache hit
        self.staged = None                    # {key: block read off the SSD, or None} for that hit
        self.num_computed = 0                 # tokens whose K/V are in the cache
        self.state_slot: int | None = None    # hybrids: the sequence's slot in the state pool
        self.finish_reason: str | None = None
        self.text_parts: list[str] = []
        self.seed_key = None                  # uint32[2], set on admission
        self.constraint = None                # constraints.Constraint when the output follows a grammar
        self.thinking = req.params.think_open   # inside a <think> block now
        self.think_from = 0                   # index in out_ids where the open thinking block began
        self.draft = None                     # spec.Draft: the tokens this step verifies after the known ones
        self.spec = None                      # spec.policy.SeqStats: its drafting statistics (speculation on)
        self.mtp_next = None                  # (length, tokens): the MTP head's drafts after its first `length` tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.out_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building the whole list (this runs every step)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.out_ids[start - n:end - n]
        return self.prompt_ids[start:end] + (self.out_ids[:end - n] if end > n else [])

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    @property
    def num_pending(self) -> int:
        """Known tokens without K/V yet: the prompt (or a chunk of it), or the last sampled token."""
        return len(self) - self.num_computed

    @property
    def decoding(self) -> bool:
        return bool(self.out_ids) and self.num_pending == 1

    def tokens_left(self, max_context: int) -> int:
        """Output tokens it may still emit: max_tokens and the context both end it."""
        return min(self.params.max_tokens - len(self.out_ids), max_context - len(self))
