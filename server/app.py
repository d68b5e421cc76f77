"""The Sanic application. One process; the engine (and its device thread) lives on app.ctx."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from sanic import Sanic
from sanic.exceptions import SanicException
from sanic.response import json as json_response

from infernix_jax.engine import Event

from . import openai_chat
from .errors import APIError

log = logging.getLogger("infernix.server")
HEARTBEAT_S = 5.0


class EventStream:
    """Engine events (delivered on the device thread) -> an asyncio queue on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def __call__(self, ev: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)


def create_app(engine, name: str = "infernix", warmup: bool = True) -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = 64 * 1024 * 1024
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.ctx.engine = engine

    @app.before_server_start
    async def start_engine(app):
        app.ctx.engine.start(warmup=warmup)

    @app.after_server_stop
    async def stop_engine(app):
        app.ctx.engine.stop()

    @app.exception(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception(SanicException)
    async def sanic_error(request, exc: SanicException):
        status = getattr(exc, "status_code", 500)
        kind = "not_found_error" if status == 404 else "invalid_request_error" if status < 500 else "server_error"
        return APIError(str(exc) or kind, status, kind).response()

    @app.exception(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(f"internal error: {type(exc).__name__}", 500, "server_error").response()

    @app.get("/health")
    async def health(request):
        return json_response({"status": "ok"})

    @app.get("/v1/models")
    async def models(request):
        e = request.app.ctx.engine
        return json_response({"object": "list", "data": [{
            "id": e.model_name, "object": "model", "created": int(time.time()), "owned_by": "infernix",
            "max_model_len": e.max_context}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request):
        body = _json_body(request)
        engine = request.app.ctx.engine
        req, meta = openai_chat.build_request(body, engine)
        events = EventStream(asyncio.get_running_loop())
        req.on_event = events
        engine.submit(req)
        try:
            if meta["stream"]:
                await _stream_chat(request, events, meta, engine.tokenizer)
                return None
            text, lps, done = [], [], None
            while done is None:
                ev = await events.queue.get()
                if ev.kind == "delta":
                    text.append(ev.text)
                    lps.extend(ev.logprobs)
                elif ev.kind == "done":
                    done = ev
                else:
                    raise openai_chat.engine_error(ev.message)
            content = openai_chat.logprobs_content(engine.tokenizer, lps) if meta["logprobs"] else None
            return json_response(openai_chat.completion_body(meta, "".join(text), done.finish_reason,
                                                             done.prompt_tokens, done.completion_tokens, content))
        finally:
            req.cancel()  # no-op when finished; frees the slot when the client went away

    return app


def _json_body(request):
    try:
        return json.loads(request.body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream_chat(request, events: EventStream, meta: dict, tokenizer) -> None:
    response = await request.respond(content_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await response.send(_sse(openai_chat.chunk(meta, {"role": "assistant", "content": ""})))
    while True:
        try:
            ev = await asyncio.wait_for(events.queue.get(), timeout=HEARTBEAT_S)
        except asyncio.TimeoutError:
            await response.send(": keep-alive\n\n")  # also how a vanished client is noticed
            continue
        if ev.kind == "delta":
            lps = openai_chat.logprobs_content(tokenizer, ev.logprobs) if meta["logprobs"] else None
            if ev.text or lps:
                await response.send(_sse(openai_chat.chunk(meta, {"content": ev.text}, logprobs=lps)))
        elif ev.kind == "done":
            await response.send(_sse(openai_chat.chunk(meta, {}, ev.finish_reason)))
            if meta["include_usage"]:
                await response.send(_sse(openai_chat.chunk(
                    meta, None, usage_=openai_chat.usage(ev.prompt_tokens, ev.completion_tokens))))
            break
        else:
            await response.send(_sse(openai_chat.engine_error(ev.message).body()))
            break
    await response.send("data: [DONE]\n\n")
    await response.eof()
