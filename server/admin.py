"""The running configuration, for the /configure page: `GET /admin/config` (model, dtypes, KV pool,
prefix-cache tiers, requests in flight, the settings) and `POST /admin/config` (change settings).

Settings the server reads per request (the caps on replies, queue and clients, the sampling
defaults, tool-call and thinking policies) change at once. The rest shape what is allocated and
compiled at start (model, dtypes, pool sizes, tiers, address): they are written, with the live ones,
to the config file that `infernix-serve --config FILE` reads, and the answer names the command that
restarts with them: the file holds the options this process started with plus every change made
here since (the whole file is rewritten). The API key is never sent back (only whether one is set),
and one given on the command line or in the environment is not written (the command says to pass
it again). Changes must come as JSON from the page's own origin: a page elsewhere cannot post here."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Callable
from urllib.parse import urlsplit

from .errors import APIError

# live settings: option name -> limits attribute
LIVE = {"max-new-tokens": "max_new_tokens", "max-http-clients": "max_http_clients",
        "max-pending-requests": "max_pending_requests", "end-in-thinking": "end_in_thinking",
        "tolerant-tool-calls": "tolerant_tool_calls"}
SECRET = ("api-key",)


@dataclasses.dataclass
class AdminInfo:
    """What infernix-serve tells the page about its own options (the server knows no CLI itself)."""
    config_file: str                      # where settings for the next start are written
    options: list                         # [{name, help, default, choices, kind}] needing a restart
    started: dict                         # option -> value this process started with (non-default ones;
                                          # a key from the command line left out)
    validate: Callable[[dict], dict]      # settings -> the same, checked (ValueError: why not)
    canonical: Callable[[dict], dict] = dict   # settings with each option under one name (no aliases)
    changed: dict = dataclasses.field(default_factory=dict)   # what the page changed since the start


def _prefix_cache(engine) -> dict | None:
    c = engine.cache
    if c is None:
        return None
    out = {"device_cached_blocks": engine.bm.num_cached, "stats": dict(c.stats), "ram": None, "ssd": None}
    if c.host is not None:
        out["ram"] = {"used_bytes": c.host.used, "limit_bytes": c.host.limit}
    if c.ssd is not None:
        s = c.ssd
        out["ssd"] = {"capacity_bytes": s.capacity, "written_bytes": s.written_bytes,
                      "write_budget_gib_per_hour": round(s.rate * 3600 / 2**30, 3),
                      "write_budget_left_bytes": int(s.budget_left())}
    return out


def _next(info: AdminInfo) -> dict:
    """The settings of the next start: this process's, with the page's changes."""
    return {**info.canonical(info.started), **info.changed}


def _command(info: AdminInfo, limits) -> str:
    cmd = f"infernix-serve --config {info.config_file}"
    return cmd + " --api-key …" if limits.api_key and "api-key" not in _next(info) else cmd


def _public(d: dict) -> dict:
    return {k: ("(set)" if k in SECRET and v else v) for k, v in d.items()}


def snapshot(app) -> dict:
    e, limits, info = app.ctx.engine, app.ctx.limits, app.ctx.admin
    m = e.model
    live = {name: getattr(limits, attr) for name, attr in LIVE.items()}
    live["sampling"] = dict(limits.sampling_defaults)
    out = {
        "model": {"name": e.model_name, "path": str(m.path), "family": e.cfg.family, "layers": e.cfg.num_layers,
                  "dtype": str(getattr(m.dtype, "__name__", m.dtype)), "weights": m.weights_format or "as loaded",
                  "kv_dtype": e.kv_dtype or "model", "max_context": e.max_context},
        "kv_pool": {"blocks": e.bm.num_blocks, "free_blocks": e.bm.num_free, "block_size": e.plan.block_size,
                    "block_bytes": e.plan.block_bytes, "used_ratio": round(1 - e.bm.num_free / max(1, e.bm.num_blocks), 4)},
        "prefix_cache": _prefix_cache(e),
        "requests": {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                     "http_in_flight": app.ctx.in_flight, "pending": app.ctx.pending},
        "api_key": bool(limits.api_key),
        "live": live,
    }
    if info is not None:
        out["restart"] = {"options": info.options, "started": _public(info.started), "saved": _public(_next(info)),
                          "config_file": info.config_file, "command": _command(info, limits)}
    return out


def _live_changes(limits, body) -> tuple[object, dict]:
    """-> (limits with body's live settings, those settings as config-file options)."""
    from infernix_jax import generation_config
    if not isinstance(body, dict):
        raise ValueError("live must be an object of live settings")
    changes, options = {}, {}
    for name, value in body.items():
        if name == "sampling":
            if not isinstance(value, dict):
                raise ValueError("sampling must be an object, e.g. {\"temperature\": 0.7}")
            d = generation_config.check({k: v for k, v in value.items() if v is not None}, "sampling")
            d.pop("max_new_tokens", None)
            changes["sampling_defaults"] = d
            options["override-generation-config"] = json.dumps(d)
        elif name in LIVE:
            changes[LIVE[name]] = value
            options[name] = value
        else:
            raise ValueError(f"{name!r} is not a live setting; live: {', '.join([*LIVE, 'sampling'])}")
    for attr in ("max_http_clients", "max_pending_requests"):
        if attr in changes and (not isinstance(changes[attr], int) or isinstance(changes[attr], bool)):
            raise ValueError(f"{attr.replace('_', '-')} must be an integer")
    mnt = changes.get("max_new_tokens")
    if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool)):
        raise ValueError("max-new-tokens must be an integer or null")
    if "tolerant_tool_calls" in changes and not isinstance(changes["tolerant_tool_calls"], bool):
        raise ValueError("tolerant-tool-calls must be true or false")
    new = dataclasses.replace(limits, **changes)
    new.check()
    return new, options


def _write(path: str, settings: dict) -> None:
    """The config file, replaced whole (a reader never sees half of it); 0600: it may hold the key."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".infernix-config-")
    with os.fdopen(fd, "w") as f:
        json.dump(settings, f, indent=2, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def same_origin(request) -> str | None:
    """Why a settings change is refused as cross-site (None: it is not). JSON only (a form or a
    plain-text post from another page needs no preflight), and an Origin, where the browser sends
    one, naming this server."""
    if not request.headers.get("content-type", "").lower().startswith("application/json"):
        return "settings changes must be sent as application/json"
    origin = request.headers.get("origin")
    if origin and urlsplit(origin).netloc != request.host:
        return f"a page from {origin} cannot change this server's settings"
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return "a page from another site cannot change this server's settings"
    return None


def update(app, body) -> dict:
    """body: {"live": {...}, "restart": {option: value or null to drop it}} -> what was done. The
    file is written before anything changes: a change that cannot be kept is not made."""
    info = app.ctx.admin
    if not isinstance(body, dict) or not set(body) <= {"live", "restart"}:
        raise APIError("the body must be a JSON object with 'live' and/or 'restart'", 400)
    live = {} if body.get("live") is None else body["live"]
    try:
        limits, live_opts = _live_changes(app.ctx.limits, live)
        restart = {} if body.get("restart") is None else body["restart"]
        if not isinstance(restart, dict):
            raise ValueError("restart must be an object of infernix-serve options")
        if restart and info is None:
            raise ValueError("this server was not started by infernix-serve: it has no config file to write")
        if info is not None:
            changed = {**info.changed, **live_opts}
            for k, v in info.canonical(restart).items():
                if k in LIVE or k == "override-generation-config":
                    raise ValueError(f"{k!r} is a live setting: send it under 'live'")
                changed[k] = v
            nxt = info.validate({k: v for k, v in {**info.canonical(info.started), **changed}.items() if v is not None})
    except (ValueError, TypeError, OverflowError) as e:
        raise APIError(str(e), 400) from None
    out = {"applied": live}
    if info is not None:
        try:
            _write(info.config_file, nxt)
        except OSError as e:
            raise APIError(f"cannot write {info.config_file}: {e.strerror or e}", 500, "server_error") from None
        info.changed = changed
        out.update(config_file=info.config_file, saved=_public(nxt), restart_needed=bool(restart),
                   command=_command(info, limits))
    app.ctx.limits = limits                    # handlers read the limits per request
    app.ctx.tolerant = limits.tolerant_tool_calls
    return out


__all__ = ["AdminInfo", "LIVE", "same_origin", "snapshot", "update"]
