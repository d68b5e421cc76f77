"""One generation as the protocols see it: the engine's token deltas, run through the reasoning and
tool-call parsers, become a stream of pieces that every protocol renders in its own words:

  ("reasoning", str)   thinking text
  ("text", str)        answer text
  ("tool_call", ToolCall)
  ("logprobs", tuple)  the engine's per-token logprob entries for the text just sent
  ("prompt_logprobs", tuple)  the prompt's (SamplingParams.prompt_logprobs), before the first token's
  ("done", Done)       always last (also after an engine error, with finish_reason "error")
"""
from __future__ import annotations

import asyncio
import dataclasses

from infernix_jax.engine import Event, Request, SamplingParams

from .parsing import ReasoningParser, ToolCallParser, tool_format_of


@dataclasses.dataclass
class Done:
    finish_reason: str        # stop | length | tool_calls | abort | error
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    stop_sequence: str | None = None
    cached_tokens: int = 0    # prompt tokens taken from the prefix cache


@dataclasses.dataclass
class Features:
    """What the chat template and the request turn on: how to parse the output."""
    reasoning: bool = False            # the model writes <think> blocks
    starts_in_reasoning: bool = False  # the prompt already opened one
    tool_format: str | None = None     # json | xml | None
    tools: list | None = None
    tolerant_tool_calls: bool = False
    refuse_end_in_thinking: bool = True   # --end-in-thinking refuse: no EOS / <tool_call> inside <think>
    parallel_tool_calls: bool = True   # False: the reply ends with its first complete call


def features_for(tokenizer, prompt_text: str, tools: list | None, tolerant: bool = False,
                 parallel: bool = True) -> Features:
    template = tokenizer.chat_template or ""
    reasoning = "<think>" in template or tokenizer.token_to_id("<think>") is not None
    tail = prompt_text[-200:]
    opened = reasoning and tail.rfind("<think>") > tail.rfind("</think>")
    # templates without a tool format still get the Hermes one: a forced call is written in it
    fmt = (tool_format_of(template) or "json") if tools else None
    return Features(reasoning, opened, fmt, tools, tolerant, parallel_tool_calls=parallel)


class Turn:
    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, features: Features, stats=None):
        self.engine = engine
        self.stats = stats                   # a metrics.RequestStats shared by the request's turns, or None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        # the prompt's own reasoning state goes with the request (a copy: params stay as built)
        params = dataclasses.replace(params, think_open=features.starts_in_reasoning,
                                     think_guard=features.reasoning and features.refuse_end_in_thinking)
        self.req = Request(prompt_ids=prompt_ids, params=params, on_event=self._deliver)
        self.reasoning = ReasoningParser(in_reasoning=features.starts_in_reasoning) if features.reasoning else None
        self.tools = ToolCallParser(features.tool_format, features.tools) if features.tool_format else None
        self.tolerant = features.tolerant_tool_calls
        self.single_call = not features.parallel_tool_calls
        self.cut = False                     # ended by us after its one call (parallel_tool_calls false)
        self.prompt_tokens = len(prompt_ids)
        self.calls = 0
        self.finished = False
        self.on_finish = None                # called once on the loop when the engine is done with it
        self._released = False

    def _deliver(self, ev: Event) -> None:          # on the engine's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        if ev.kind in ("done", "error"):
            self.loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            if self.on_finish is not None:
                self.on_finish()

    def start(self) -> Turn:
        self.engine.submit(self.req)
        return self

    def cancel(self) -> None:
        self.req.cancel()

    async def next(self, timeout: float | None = None) -> list[tuple[str, object]] | None:
        """The next pieces, or None when nothing came within timeout (time for a heartbeat)."""
        try:
            ev = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if ev.kind == "delta":
            if self.stats is not None:
                self.stats.on_tokens()
            if self.cut:
                return []                    # output after the one call, already on its way
            out = [("prompt_logprobs", ev.prompt_logprobs)] if ev.prompt_logprobs is not None else []
            out += self._parse(ev.text)
            if ev.logprobs:
                out.append(("logprobs", ev.logprobs))
            return out
        self.finished = True
        if ev.kind == "error":
            return [("done", Done("error", self.prompt_tokens, 0, ev.message))]
        out = [] if self.cut else self._finish(ev.finish_reason or "stop")
        reason = "tool_calls" if self.calls and (ev.finish_reason == "stop" or self.cut) else ev.finish_reason
        if self.stats is not None:
            self.stats.on_done(ev.prompt_tokens, ev.completion_tokens, reason, ev.cached_tokens, ev.speculative)
        out.append(("done", Done(reason, ev.prompt_tokens, ev.completion_tokens, stop_sequence=ev.stop_sequence,
                                 cached_tokens=ev.cached_tokens)))
        return out

    async def collect(self) -> tuple[str, str, list, list, Done]:
        """Run to the end: reasoning text, answer text, tool calls, logprob entries (the prompt's
        first, when asked for), Done."""
        reasoning, text, calls, lps = [], [], [], []
        while True:
            for kind, v in await self.next() or ():
                if kind == "reasoning":
                    reasoning.append(v)
                elif kind == "text":
                    text.append(v)
                elif kind == "tool_call":
                    calls.append(v)
                elif kind in ("logprobs", "prompt_logprobs"):
                    lps.extend(v)
                elif kind == "done":
                    return "".join(reasoning), "".join(text), calls, lps, v

    def _parse(self, text: str) -> list[tuple[str, object]]:
        pieces = self.reasoning.feed(text) if self.reasoning else [("text", text)]
        return self._tool_pass(pieces)

    def _finish(self, reason: str) -> list[tuple[str, object]]:
        out = self._tool_pass(self.reasoning.finish()) if self.reasoning else []
        if self.tools:
            keep = self.tolerant and reason in ("length", "abort")
            out += self.tools.finish(keep_partial=keep)
            self.calls = self.tools.calls
            out = self._one_call(out)
        return out

    def _tool_pass(self, pieces) -> list[tuple[str, object]]:
        if not self.tools:
            return [p for p in pieces if p[1]]
        out = []
        for kind, v in pieces:
            out.extend(self.tools.feed(v) if kind == "text" else [(kind, v)])
        self.calls = self.tools.calls
        return self._one_call(out)

    def _one_call(self, out):
        """parallel_tool_calls false: keep the pieces up to the first call, and stop generating."""
        if not (self.single_call and self.calls):
            return out
        first = next(i for i, (kind, _) in enumerate(out) if kind == "tool_call")
        self.cut, self.calls = True, 1
        self.req.cancel()                    # nothing after the call is wanted (no-op once finished)
        return out[:first + 1]
