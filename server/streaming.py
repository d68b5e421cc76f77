"""The one SSE driver every protocol uses. A renderer turns turn pieces into that protocol's events;
this module decides when the stream opens, when to send heartbeats, and when to give up on a client.

- The stream opens with its first real event (honest time to first token): headers go out with the
  first output, or with the first heartbeat when a long prefill delays it.
- A heartbeat (the protocol's own: an SSE comment or a ping event) every HEARTBEAT_S without output.
- A reader that stops reading for the server's paused_reader_s (60 s), or goes away, cancels its
  requests (their KV is freed by the engine at its next step)."""
from __future__ import annotations

import asyncio
from typing import Protocol

from .errors import APIError
from .turn import Turn

HEARTBEAT_S = 5.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ReaderPaused(Exception):
    """The client stopped taking data: its request was cancelled and the connection closed."""


class Renderer(Protocol):
    def start(self) -> list[str]: ...
    def heartbeat(self) -> str: ...
    def pieces(self, index: int, pieces: list) -> list[str]: ...
    def end(self) -> list[str]: ...


class PieceRenderer:
    """Adapts a one-choice renderer that takes one piece at a time (`piece(kind, v)`) to Renderer."""

    def __init__(self, r):
        self.r = r

    def start(self) -> list[str]:
        return self.r.start()

    def heartbeat(self) -> str:
        return self.r.heartbeat()

    @property
    def heartbeat_is_event(self) -> bool:
        return getattr(self.r, "heartbeat_is_event", False)

    def pieces(self, index: int, pieces: list) -> list[str]:
        return [s for kind, v in pieces for s in self.r.piece(kind, v)]

    def end(self) -> list[str]:
        return []


async def merged(turns: list[Turn], timeout: float | None):
    """Yields (turn index, pieces) as they come from any turn, or None after timeout of silence."""
    tasks: dict[asyncio.Future, int] = {}

    def arm(i):
        tasks[asyncio.ensure_future(turns[i].next())] = i
    for i in range(len(turns)):
        arm(i)
    try:
        while tasks:
            done, _ = await asyncio.wait(list(tasks), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield None
                continue
            for t in sorted(done, key=lambda t: tasks[t]):
                i = tasks.pop(t)
                yield i, t.result()
                if not turns[i].finished:
                    arm(i)
    finally:
        for t in tasks:
            t.cancel()


def first_error(pieces: list) -> str | None:
    for kind, v in pieces:
        if kind == "done" and v.finish_reason == "error":
            return v.error
    return None


async def stream(request, turns: list[Turn], renderer: Renderer, heartbeat_s: float = HEARTBEAT_S) -> None:
    response = None
    opening: list[str] | None = None     # the protocol's opening events, rendered before any piece
    opened = False                       # the opening events went out
    # SSE comments may precede the first event; a protocol whose heartbeat is an event (Anthropic's
    # ping) must send its opening event first
    beat_opens = getattr(renderer, "heartbeat_is_event", False)
    paused_s = request.app.ctx.limits.paused_reader_s

    async def send(parts: list[str], with_opening: bool = True):
        nonlocal response, opened
        if not parts:
            return
        if response is None:
            response = await request.respond(content_type="text/event-stream", headers=SSE_HEADERS)
        if with_opening and not opened:
            parts, opened = opening + parts, True
        try:
            await asyncio.wait_for(response.send("".join(parts)), paused_s)
        except asyncio.TimeoutError:
            request.transport.abort()      # unsent bytes are dropped; the socket is free at once
            raise ReaderPaused(f"the client read nothing for {paused_s:g} s") from None

    try:
        async for item in merged(turns, heartbeat_s):
            if opening is None:
                opening = renderer.start()
            if item is None:
                await send([renderer.heartbeat()], with_opening=beat_opens)
                continue
            i, pieces = item
            if response is None and (err := first_error(pieces)):
                raise APIError(err, 500, "server_error")     # nothing sent yet: a plain HTTP error
            await send(renderer.pieces(i, pieces))
        await send(renderer.end())
        request.ctx.stats.delivered = True
        if response is not None:
            await response.eof()
    finally:
        for t in turns:
            t.cancel()         # no-op for finished turns; frees the KV of the rest at once
