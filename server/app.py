"""The Sanic application. One process; the engine (and its device thread) lives on app.ctx.

Routes: OpenAI Chat Completions, Completions, Responses; Anthropic Messages and count_tokens;
/v1/models, /health. Every protocol goes through the same path: build (validate the body; 4xx
before anything reaches the engine) -> Turns on the engine -> collect (one JSON body) or stream
(server/streaming.py with the protocol's renderer)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from sanic import Sanic
from sanic.exceptions import SanicException
from sanic.response import json as json_response

from . import anthropic_messages, openai_chat, openai_completions, openai_responses
from .errors import APIError, protocol_of
from .streaming import PieceRenderer, stream
from .turn import Turn

log = logging.getLogger("infernix.server")


def create_app(engine, name: str = "infernix", warmup: bool = True, tolerant_tool_calls: bool = False) -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = 64 * 1024 * 1024
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.ctx.engine = engine
    app.ctx.tolerant = tolerant_tool_calls

    @app.before_server_start
    async def start_engine(app):
        app.ctx.engine.start(warmup=warmup)

    @app.after_server_stop
    async def stop_engine(app):
        app.ctx.engine.stop()

    @app.exception(APIError)
    async def api_error(request, exc: APIError):
        return exc.response(protocol_of(request.path))

    @app.exception(SanicException)
    async def sanic_error(request, exc: SanicException):
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found_error", 413: "request_too_large"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        return APIError(str(exc) or kind, status, kind).response(protocol_of(request.path))

    @app.exception(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(f"internal error: {type(exc).__name__}", 500, "server_error").response(protocol_of(request.path))

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
        engine = request.app.ctx.engine
        ids, params, features, meta = openai_chat.build(_json_body(request), engine, request.app.ctx.tolerant)
        turns = [Turn(engine, ids, p, features).start() for p in params]
        if meta["stream"]:
            await stream(request, turns, openai_chat.StreamRenderer(meta, len(turns), engine.tokenizer))
            return None
        results = await _collect_all(turns)
        return json_response(openai_chat.completion_body(meta, results, engine.tokenizer))

    @app.post("/v1/completions")
    async def completions(request):
        engine = request.app.ctx.engine
        body = _json_body(request)
        jobs, meta = openai_completions.build(body, engine)
        n = len(jobs) // len(meta["prompts"])
        turns = [Turn(engine, ids, p, openai_completions.FEATURES).start() for ids, p in jobs]
        if meta["stream"]:
            await stream(request, turns, openai_completions.StreamRenderer(meta, len(turns), n, engine.tokenizer))
            return None
        return json_response(openai_completions.body_of(meta, await _collect_all(turns), engine.tokenizer, n))

    @app.post("/v1/messages")
    async def messages(request):
        engine = request.app.ctx.engine
        ids, params, features, meta = anthropic_messages.build(_json_body(request), engine, request.app.ctx.tolerant)
        turn = Turn(engine, ids, params, features).start()
        if meta["stream"]:
            renderer = anthropic_messages.StreamRenderer(meta, len(ids))
            await stream(request, [turn], PieceRenderer(renderer))
            return None
        reasoning, text, calls, _, done = (await _collect_all([turn]))[0]
        return json_response(anthropic_messages.message_body(meta, reasoning, text, calls, done))

    @app.post("/v1/responses")
    async def responses(request):
        engine = request.app.ctx.engine
        ids, params, features, meta = openai_responses.build(_json_body(request), engine, request.app.ctx.tolerant)
        turn = Turn(engine, ids, params, features).start()
        if meta["stream"]:
            await stream(request, [turn], PieceRenderer(openai_responses.StreamRenderer(meta)))
            return None
        reasoning, text, calls, _, done = (await _collect_all([turn]))[0]
        return json_response(openai_responses.body_of(meta, reasoning, text, calls, done))

    @app.get("/v1/responses")
    async def responses_websocket(request):
        # Codex tries a WebSocket first when configured to; 426 makes it fall back to HTTP at once
        if request.headers.get("upgrade", "").lower() == "websocket":
            raise APIError("WebSocket transport is not supported; use HTTP POST /v1/responses", 426,
                           "invalid_request_error", headers={"Upgrade": "HTTP/1.1"})
        raise APIError("use POST /v1/responses", 405, "invalid_request_error")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request):
        return json_response(anthropic_messages.count_tokens(_json_body(request), request.app.ctx.engine))

    return app


async def _collect_all(turns: list[Turn]):
    try:
        results = await asyncio.gather(*(t.collect() for t in turns))
    finally:
        for t in turns:
            t.cancel()          # no-op when finished; frees the KV when the client went away
    for *_, done in results:
        if done.finish_reason == "error":
            raise APIError(done.error, 500, "server_error")
    return results


def _json_body(request):
    try:
        return json.loads(request.body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
