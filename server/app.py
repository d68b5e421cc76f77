"""The Sanic application. One process; the engine (and its device thread) lives on app.ctx.

Routes: OpenAI Chat Completions, Completions, Responses; Anthropic Messages and count_tokens;
/v1/models, /health, /metrics; the web UI (/, /configure: server/webui.py) and its /admin/config
(server/admin.py). Every protocol goes through the same path: build (validate the body; 4xx
before anything reaches the engine) -> Turns on the engine -> collect (one JSON body) or stream
(server/streaming.py with the protocol's renderer)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import re
import time

from sanic import Sanic
from sanic.exceptions import SanicException
from sanic.response import json as json_response
from sanic.response import raw

from . import admin, anthropic_messages, openai_chat, openai_completions, openai_responses, webui
from .errors import APIError, protocol_of
from .metrics import Metrics, RequestStats
from .streaming import PieceRenderer, ReaderPaused, stream
from .turn import Turn
from .validate import MAX_DEPTH, check_depth, mend_surrogates

log = logging.getLogger("infernix.server")


@dataclasses.dataclass
class ServerLimits:
    api_key: str | None = None
    max_http_clients: int = 64            # open connections (an API request on one beyond: 503, then closed)
    max_pending_requests: int = 256       # generations submitted and not finished (beyond: 429)
    max_body_mb: float = 64.0
    keep_alive_s: float = 360.0
    log_requests: str | None = None       # JSON-lines request log
    tolerant_tool_calls: bool = False
    end_in_thinking: str = "refuse"       # refuse: no reply ends (or opens a tool call) inside <think>
    heartbeat_s: float = 5.0              # SSE heartbeat after this long without output
    paused_reader_s: float = 60.0         # a stream whose reader takes no data this long is cancelled
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # for sampling fields a body leaves out
    max_new_tokens: int | None = None     # cap on every reply's max_tokens
    model_names: tuple[str, ...] = ("*",)  # names a request's "model" may take ("*": any)

    def check(self) -> None:
        if self.end_in_thinking not in ("refuse", "allow"):
            raise ValueError("--end-in-thinking must be 'refuse' or 'allow'")
        if not 1 <= self.max_pending_requests <= 1024:
            raise ValueError(f"--max-pending-requests must be between 1 and 1024, got {self.max_pending_requests}")
        if self.max_http_clients < 1:
            raise ValueError("--max-http-clients must be >= 1")
        if self.max_body_mb <= 0:
            raise ValueError("--max-body-mb must be > 0")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")


OPEN_PATHS = {"/health", "/metrics"}       # no API key needed
KEEP_ALIVE_GRACE_S = 10.0


def create_app(engine, name: str = "infernix", warmup: str | bool = "basic", limits: ServerLimits | None = None,
               admin_info: admin.AdminInfo | None = None) -> Sanic:
    """warmup: the engine's warm-up level (Engine.start); /health answers 503 until it is done, and
    requests sent meanwhile wait for it."""
    limits = limits or ServerLimits()
    limits.check()
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = int(limits.max_body_mb * 1024 * 1024)
    app.config.RESPONSE_TIMEOUT = 3600
    # an idle connection is closed a little after the time advertised (Keep-Alive: timeout=...), so a
    # client that trusts the header never sends on a socket the server is closing
    app.config.KEEP_ALIVE_TIMEOUT = limits.keep_alive_s + KEEP_ALIVE_GRACE_S
    app.ctx.engine = engine
    app.ctx.limits = limits
    app.ctx.admin = admin_info         # infernix-serve's options and config file (/configure)
    app.ctx.tolerant = limits.tolerant_tool_calls
    app.ctx.metrics = Metrics(engine, limits.log_requests)
    app.ctx.in_flight = 0          # HTTP requests being served
    app.ctx.connections = 0        # HTTP connections open (--max-http-clients is their ceiling)

    @app.signal("http.lifecycle.begin")
    async def opened(conn_info):
        app.ctx.connections += 1
        conn_info.ctx.over = app.ctx.connections > limits.max_http_clients

    @app.signal("http.lifecycle.complete")
    async def closed(conn_info):
        app.ctx.connections -= 1
    app.ctx.pending = 0            # generation turns submitted and not finished

    @app.on_request
    async def gate(request):
        if request.path in OPEN_PATHS or webui.is_open(request.path):
            return None
        key = limits.api_key
        if key:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                raise APIError("invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)", 401,
                               "authentication_error")
        return None

    @app.on_response
    async def keep_alive_header(request, response):
        if response is not None and "keep-alive" not in response.headers:
            response.headers["Keep-Alive"] = f"timeout={int(limits.keep_alive_s)}"

    @app.before_server_start
    async def start_engine(app):
        app.ctx.engine.start(warmup=warmup)

    @app.after_server_stop
    async def stop_engine(app):
        app.ctx.engine.stop()
        app.ctx.metrics.close()

    @app.exception(APIError)
    async def api_error(request, exc: APIError):
        _refused(request, exc.status, exc.message)
        return exc.response(protocol_of(request.path))

    @app.exception(SanicException)
    async def sanic_error(request, exc: SanicException):
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found_error", 413: "request_too_large"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        _refused(request, status, str(exc) or kind)
        return APIError(str(exc) or kind, status, kind).response(protocol_of(request.path))

    @app.exception(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(f"internal error: {type(exc).__name__}", 500, "server_error").response(protocol_of(request.path))

    webui.add_routes(app)

    @app.get("/admin/config")
    async def admin_config(request):
        return json_response(admin.snapshot(request.app))

    @app.post("/admin/config")
    async def admin_update(request):
        why = admin.same_origin(request)
        if why:
            raise APIError(why, 403, "permission_error")
        return json_response(admin.update(request.app, _load_json(request)))

    @app.get("/health")
    async def health(request):
        e = request.app.ctx.engine
        ready = getattr(e, "ready", None)
        if ready is not None and not ready.is_set():           # warming up: not ready for traffic yet
            w = e.warm_state
            return json_response({"status": "loading", "warmup": f"{w['done']}/{w['total']} step shapes",
                                  "error": {"message": "warming up", "type": "unavailable_error"}}, status=503)
        return json_response({"status": "ok", "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                              "kv_free_blocks": e.bm.num_free, "kv_total_blocks": e.bm.num_blocks})

    @app.get("/metrics")
    async def metrics(request):
        return raw(request.app.ctx.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request):
        e = request.app.ctx.engine
        return json_response({"object": "list", "data": [{
            "id": e.model_name, "object": "model", "created": int(time.time()), "owned_by": "infernix",
            "max_model_len": e.max_context}]})

    @app.post("/v1/chat/completions")
    @served("chat.completions")
    async def chat_completions(request):
        engine = request.app.ctx.engine
        ids, params, features, meta = openai_chat.build(_json_body(request), engine, request.app.ctx.tolerant)
        turns = _start(request, [(ids, p, features) for p in params], meta)
        if meta["stream"]:
            await stream(request, turns, openai_chat.StreamRenderer(meta, len(turns), engine.tokenizer), _hb(request))
            return None
        results = await _collect_all(turns)
        return json_response(openai_chat.completion_body(meta, results, engine.tokenizer))

    @app.post("/v1/completions")
    @served("completions")
    async def completions(request):
        engine = request.app.ctx.engine
        jobs, meta = openai_completions.build(_json_body(request), engine)
        n = len(jobs) // len(meta["prompts"])
        turns = _start(request, [(ids, p, openai_completions.FEATURES) for ids, p in jobs], meta)
        if meta["stream"]:
            await stream(request, turns, openai_completions.StreamRenderer(meta, len(turns), n, engine.tokenizer),
                         _hb(request))
            return None
        return json_response(openai_completions.body_of(meta, await _collect_all(turns), engine.tokenizer, n))

    @app.post("/v1/messages")
    @served("messages")
    async def messages(request):
        return await _one_turn(request, anthropic_messages.build, anthropic_messages.message_body,
                               lambda meta, ids: anthropic_messages.StreamRenderer(meta, len(ids)))

    @app.post("/v1/responses")
    @served("responses")
    async def responses(request):
        return await _one_turn(request, openai_responses.build, openai_responses.body_of,
                               lambda meta, ids: openai_responses.StreamRenderer(meta))

    @app.get("/v1/responses")
    async def responses_websocket(request):
        # Codex tries a WebSocket first when configured to; 426 makes it fall back to HTTP at once
        if request.headers.get("upgrade", "").lower() == "websocket":
            raise APIError("WebSocket transport is not supported; use HTTP POST /v1/responses", 426,
                           "invalid_request_error", headers={"Upgrade": "HTTP/1.1"})
        raise APIError("use POST /v1/responses", 405, "invalid_request_error")

    @app.post("/v1/messages/count_tokens")
    @served("messages.count_tokens")
    async def count_tokens(request):
        return json_response(anthropic_messages.count_tokens(_json_body(request), request.app.ctx.engine))

    return app


def served(endpoint: str):
    """Wraps a protocol handler: the HTTP-client limit, request stats, metrics and the request log."""
    def wrap(handler):
        @functools.wraps(handler)
        async def run(request, *a, **kw):
            app = request.app
            st = request.ctx.stats = RequestStats(endpoint)
            limit = app.ctx.limits.max_http_clients
            if getattr(request.conn_info.ctx, "over", False) and app.ctx.connections > limit:
                # (a connection opened past the ceiling, while it is still passed: 503, and the
                # connection is closed; one opened within it is always served)
                app.ctx.metrics.finish(st, 503, request.headers.get("user-agent", ""), "too many clients")
                request.stream.keep_alive = False          # (sanic's http1: "connection: close", then closed)
                raise APIError(f"the server has {app.ctx.connections} connections open, its limit is {limit} "
                               "(--max-http-clients); retry shortly", 503, "overloaded_error",
                               headers={"Retry-After": "1"})
            request.conn_info.ctx.over = False
            app.ctx.in_flight += 1
            status, error = 200, ""
            try:
                return await handler(request, *a, **kw)
            except APIError as e:
                status, error = e.status, e.message
                raise
            except ReaderPaused as e:      # its turns are cancelled and the connection is closed
                status, error = 499, str(e)
                return None
            except asyncio.CancelledError:
                if not st.delivered:       # leaving after the last event is a served request
                    status, error = 499, "client went away"
                raise
            finally:
                app.ctx.in_flight -= 1
                app.ctx.metrics.finish(st, status, request.headers.get("user-agent", ""), error)
        return run
    return wrap


ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions",
             "/v1/responses": "responses", "/v1/messages": "messages", "/v1/messages/count_tokens": "messages.count_tokens"}


def _refused(request, status: int, message: str) -> None:
    """Metrics and the request log for a request refused before any endpoint ran (401, 404, 405, 413);
    the endpoint label is one of ours or "other", never the raw path (bounded label values)."""
    if request is None or getattr(request.ctx, "stats", None) is not None:
        return                                   # `served` records the requests that reached an endpoint
    request.ctx.stats = st = RequestStats(ENDPOINTS.get(request.path.rstrip("/"), "other"))
    request.app.ctx.metrics.finish(st, status, request.headers.get("user-agent", ""), message)


def _start(request, jobs, meta) -> list[Turn]:
    """Submit the request's turns, unless the engine already has --max-pending-requests."""
    app = request.app
    if app.ctx.pending + len(jobs) > app.ctx.limits.max_pending_requests:
        raise APIError(f"{app.ctx.pending} requests are pending, the server's limit (--max-pending-requests); "
                       "retry shortly", 429, "rate_limit_error", headers={"Retry-After": "2"})
    st = request.ctx.stats
    st.stream = bool(meta.get("stream"))
    st.prompt_tokens = max(len(ids) for ids, _, _ in jobs)    # known now, also for a request cut short
    refuse = app.ctx.limits.end_in_thinking == "refuse"
    turns = [Turn(app.ctx.engine, ids, _with_defaults(app.ctx.limits, request.ctx.body, p),
                  dataclasses.replace(f, refuse_end_in_thinking=refuse), stats=st)
             for ids, p, f in jobs]
    for t in turns:
        app.ctx.pending += 1
        t.on_finish = functools.partial(_release, app)
        t.start()
    return turns


def _with_defaults(limits: ServerLimits, body: dict, p):
    """The server's sampling defaults (the model's generation config, --override-generation-config)
    for each field the body leaves out (absent or null: every protocol names them alike), and the
    --max-new-tokens cap."""
    over = {k: v for k, v in limits.sampling_defaults.items() if body.get(k) is None}
    if limits.max_new_tokens is not None and p.max_tokens > limits.max_new_tokens:
        over["max_tokens"] = limits.max_new_tokens
    return dataclasses.replace(p, **over) if over else p


async def _one_turn(request, build, body_of, make_renderer):
    """The protocols with one reply per request (Messages, Responses): build -> one turn -> a streamed
    reply through the protocol's piece renderer, or one JSON body."""
    engine = request.app.ctx.engine
    ids, params, features, meta = build(_json_body(request), engine, request.app.ctx.tolerant)
    turn, = _start(request, [(ids, params, features)], meta)
    if meta["stream"]:
        await stream(request, [turn], PieceRenderer(make_renderer(meta, ids)), _hb(request))
        return None
    reasoning, text, calls, _, done = (await _collect_all([turn]))[0]
    return json_response(body_of(meta, reasoning, text, calls, done))


def _hb(request) -> float:
    return request.app.ctx.limits.heartbeat_s


def _release(app) -> None:
    app.ctx.pending -= 1


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


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _load_json(request):
    """The request body as JSON, no deeper than MAX_DEPTH (APIError 400 otherwise)."""
    try:
        body = json.loads(request.body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    check_depth(body, "the request body")
    # (an escaped lone surrogate: the only way one gets into a str from bytes; raw bytes of one are not UTF-8)
    return mend_surrogates(body) if _ESCAPED_SURROGATE.search(request.body or b"") else body


def _json_body(request):
    body = _load_json(request)
    request.ctx.body = body if isinstance(body, dict) else {}
    _check_model(request.app.ctx.limits.model_names, request.ctx.body.get("model"))
    return body


def _check_model(names: tuple[str, ...], model) -> None:
    """An absent model means the served one; a name the server does not serve is a 404 (vLLM's answer)."""
    if model is None or "*" in names:
        return
    if not isinstance(model, str):
        raise APIError(f"'model' must be a string, got {type(model).__name__}", 400, "invalid_request_error", "model")
    if model not in names:
        raise APIError(f"the model '{model[:200]}' does not exist on this server; it serves "
                       f"{', '.join(repr(n) for n in names)}", 404, "not_found_error", "model", "model_not_found")
