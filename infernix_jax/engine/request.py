"""What the server (or a script) hands the engine, and what the engine sends back."""
from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Callable

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings: built once (server/, scripts/), never changed afterwards
    (dataclasses.replace makes a changed copy)."""
    max_tokens: int = 256
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    min_p: float = 0.0            # 0 = off
    presence_penalty: float = 0.0     # OpenAI: minus this once for each token already generated
    frequency_penalty: float = 0.0    # OpenAI: minus this per earlier occurrence in the output
    repetition_penalty: float = 1.0   # HF/vLLM: divide (or multiply, if negative) logits of tokens
                                      # seen in the prompt or the output
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False        # return each sampled token's logprob
    top_logprobs: int = 0         # and this many alternatives (<= 20)
    prompt_logprobs: int | None = None   # the prompt's tokens' logprobs too (after the first), with this many
                                         # alternatives: every prompt token is computed (no prefix-cache hit)
    grammar: str | None = None    # an llguidance grammar the output must follow (engine/constraints.py)
    think_open: bool = False      # the prompt ends inside a <think> block
    think_guard: bool = False     # while thinking, neither end the reply nor open a tool call
    loop_guard: bool = True       # close a thinking block that repeats itself (injects </think>)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        """Raises ValueError with a message fit for an HTTP 400 body."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclasses.dataclass
class Event:
    """kind: "delta" (text, token_ids), "done" (finish_reason, usage) or "error" (message)."""
    kind: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple = ()          # per token: (id, logprob, ((alt id, logprob), ...))
    prompt_logprobs: tuple | None = None   # the first delta of a request asking for them: the prompt's, from its
                                           # second token on, as logprobs entries
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_sequence: str | None = None  # done: the stop string that ended the output, if one did
    cached_tokens: int = 0            # done: prompt tokens taken from the prefix cache
    speculative: tuple = ()           # done: (method, verify rounds, draft tokens, accepted) per drafting method
    message: str = ""


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None] | None = None   # called on the engine's thread
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None
    cached_tokens: int = 0          # prompt tokens taken from the prefix cache
    prompt_logprobs: list | None = None   # SamplingParams.prompt_logprobs: from the prompt's second token on
