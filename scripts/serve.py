"""infernix-serve: an OpenAI- and Anthropic-compatible HTTP server for one model."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from scripts import serve_config
from scripts._common import (add_engine_args, add_model_args, apply_route, check_lossless, engine_config,
                             init_distributed, run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infernix-serve", description=__doc__)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback: %(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may ask for (the first is the id /v1/models reports; default: "
                        "the model's alias or directory name); '*' accepts any name, for clients that send their "
                        "own; a request naming another model gets 404")
    p.add_argument("--warmup", choices=["basic", "full", "none"], default="basic",
                   help="compile each step shape before /health says ready (requests sent meanwhile are served first): "
                        "basic = the shapes a first session meets (short and long prompts, every batch size, "
                        "follow-up turns, logprobs, constrained output), then, while idle, those earlier runs "
                        "met; full = every bucketed shape the limits allow (minutes for a big model). With "
                        "the compilation cache (--compile-cache) a later start reads them back in seconds")
    g = p.add_argument_group("limits")
    g.add_argument("--api-key", default=None,
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY); default: env "
                        "INFERNIX_API_KEY, else none")
    g.add_argument("--max-http-clients", type=int, default=64, help="open HTTP connections at once (an API request on a connection past them: 503, and the "
                        "connection is closed; default %(default)s)")
    g.add_argument("--max-pending-requests", type=int, default=256,
                   help="generations queued or running, 1-1024 (beyond: 429 with Retry-After)")
    g.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body (beyond: 413)")
    g.add_argument("--log-requests", default=None, metavar="PATH",
                   help="append one JSON line per request (timings, token counts, finish reasons) to PATH")
    p.add_argument("--end-in-thinking", choices=["refuse", "allow"], default="refuse",
                   help="refuse (default): while a reply's <think> block is open it can neither end nor open a "
                        "tool call (EOS and <tool_call> are masked); allow: the model's own behaviour")
    p.add_argument("--tolerant-tool-calls", action="store_true",
                   help="keep a tool call that max_tokens, the context or a cancellation cut off (parsed as far "
                        "as it goes) instead of returning its text")
    g = p.add_argument_group("sampling defaults (for the fields a request leaves out)")
    g.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto (default): the model's own defaults (generation_config.json, or a GGUF's "
                        "general.sampling.* keys), as vLLM does; where the file has none, an alias's from its "
                        "model card (the default model: temperature 0.2, top_p 0.9), else the protocols' "
                        "(temperature 1); none: the protocols' defaults. The start-up log prints those in force")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="defaults over the model's, e.g. '{\"temperature\": 0.6, \"top_k\": 20}'; fields: "
                        "temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, "
                        "frequency_penalty, max_new_tokens")
    g.add_argument("--max-new-tokens", "-n", type=int, default=None,
                   help="cap on the tokens of any one reply (like llama-server's -n; default: what fits the context)")
    p.add_argument("--plan", action="store_true",
                   help="print what a start would allocate (weights, KV pool, ...) without loading, and exit")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="options from a JSON file, by their long names without dashes (e.g. {\"model\": "
                        "\"qwen3-8b\", \"kv-cache-gib\": 8}); flags on the command line win. The /configure "
                        "page saves settings that need a restart there (default: ~/.cache/infernix/serve-config.json)")
    return p


def main(argv=None) -> int:
    p = build_parser()

    def go():
        args, config_file = serve_config.argv_with_config(p, argv)
        a = p.parse_args(args)
        started = serve_config.started(p, a)           # before apply_route settles derived values
        apply_route(a)
        _check_port(a)
        if a.plan:
            from infernix_jax.loader import DTYPES, load_config, planned_gguf_bytes
            cfg = load_config(a.model)
            ec = engine_config(a)
            from infernix_jax.quant import check_weights
            check_weights(a.weights, a.dtype, a.stored_weights, a.model)     # what loading would refuse
            fmt = a.weights or a.stored_weights
            plan = ec.plan(cfg, DTYPES[a.dtype], fmt,
                           planned_gguf_bytes(a.model, DTYPES[a.dtype]) if fmt == "gguf" else None)
            print(f"model:              {a.model} ({cfg.family}, {cfg.num_layers} layers, dtype {a.dtype}"
                  f"{', weights ' + fmt if fmt else ''})")
            print(plan.describe())
            if fmt == "gguf" and ec.parallel:
                print("(GGUF weights: the whole file's size, not one device's share)")
            print(ec.describe_prefix_cache())
            return 0
        from server.app import create_app
        limits = _limits(a)                  # checked before loading a model: a bad flag fails in a second
        override = _override(a.override_generation_config)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from infernix_jax.engine import Engine
        from infernix_jax.loader import load_model
        ec = engine_config(a)
        several = init_distributed(a)        # several hosts: every process joins before using a device
        if ec.parallel:                      # enough devices? (before loading: a wrong count fails at once)
            from infernix_jax.sharding import make_mesh
            make_mesh(ec.parallel)
        # tensor parallelism splits q/k/v and gate/up each by heads / units: kept apart (sharding.py)
        model = load_model(a.model, dtype=a.dtype, weights=a.weights, parallel=ec.parallel)
        from infernix_jax import distributed
        if several and not distributed.is_leader():        # a follower runs process 0's steps, serves nothing
            Engine(model, ec).follow()
            return 0
        if model.tokenizer is None:
            raise ValueError(f"{a.model} has no tokenizer (tokenizer.json, or a GGUF's tokenizer.ggml.* "
                             f"metadata); the server needs one")
        names = tuple(a.served_model_name or (model.name,))
        limits.model_names = names
        model.name = next((n for n in names if n != "*"), model.name)
        auto = a.generation_config == "auto"
        _apply_generation_config(limits, model.generation_defaults if auto else {}, override,
                                 model.generation_source if auto else "")
        engine = Engine(model, ec)
        print(engine.plan.describe(), file=sys.stderr)
        print(ec.describe_prefix_cache(), file=sys.stderr)
        print(f"route:              {'lossless (f32 everywhere, reference kernels)' if a.lossless else 'default'}"
              + (f", weights {model.weights_format}" if model.weights_format else ""), file=sys.stderr)
        if a.warmup != "none":
            where = f"a later start reads them from {a.compile_cache_dir}" if a.compile_cache_dir else \
                "every start compiles them: --compile-cache is off"
            keys = engine.warm_keys(a.warmup)
            more = len(set(engine.earlier_shapes) - set(keys))
            earlier = f"; then, while idle, {more} more that earlier runs met" if more else ""
            print(f"infernix-serve: warming up {len(keys)} step shapes before /health says "
                  f"ready, serving any request first ({where}){earlier}", file=sys.stderr)
        app = create_app(engine, warmup=a.warmup, limits=limits,
                         admin_info=_admin_info(p, started, config_file))
        print(f"infernix-serve: serving {model.name} on http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)
        try:
            app.run(host=a.host, port=a.port, single_process=True, motd=False, access_log=False)
        except OSError as e:
            raise ValueError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None

    return run("infernix-serve", go)


def _check_port(a) -> None:
    if not 0 < a.port < 65536:
        raise ValueError(f"--port must be between 1 and 65535, got {a.port}")


def _limits(a):
    """The server's limits from the command line, checked."""
    from server.app import ServerLimits
    limits = ServerLimits(api_key=a.api_key or os.environ.get("INFERNIX_API_KEY") or None,
                          max_http_clients=a.max_http_clients, max_pending_requests=a.max_pending_requests,
                          max_body_mb=a.max_body_mb, log_requests=a.log_requests,
                          tolerant_tool_calls=a.tolerant_tool_calls, end_in_thinking=a.end_in_thinking,
                          max_new_tokens=a.max_new_tokens)
    limits.check()
    return limits


def _admin_info(p, started: dict, config_file: str | None):
    """What the /configure page may show and change of this command's options. A key given on the
    command line (not in the config file) is not written back: the restart command asks for it."""
    from server.admin import LIVE, AdminInfo
    in_file = serve_config.canonical(p, serve_config.read(config_file)) if config_file else {}
    if "api-key" not in in_file:
        started = {k: v for k, v in started.items() if k != "api-key"}

    def validate(settings: dict) -> dict:            # the checks a start makes before loading
        ns = serve_config.parse_checked(p, settings)
        engine_config(ns)
        _check_port(ns)
        check_lossless(ns)
        _limits(ns)
        return settings
    live = (*LIVE, "override-generation-config")
    return AdminInfo(config_file=config_file or serve_config.default_path(),
                     options=serve_config.describe(p, skip=live), started=started, validate=validate,
                     canonical=lambda d: serve_config.canonical(p, d))


def _override(text: str | None) -> dict:
    from infernix_jax import generation_config
    if text is None:
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    return generation_config.check(d, "--override-generation-config")


def _apply_generation_config(limits, model_defaults: dict, override: dict, source: str = "") -> None:
    """The model's defaults, then the override; max_new_tokens joins --max-new-tokens (the lower wins).
    source: where the model's defaults come from (said in the start-up line)."""
    from infernix_jax import generation_config
    d = {**model_defaults, **override}
    cap = d.pop("max_new_tokens", None)
    if cap is not None:
        limits.max_new_tokens = min(cap, limits.max_new_tokens or cap)
    limits.sampling_defaults = d
    whence = "; ".join(w for w in ((source if model_defaults else ""),
                                   ("--override-generation-config" if override else "")) if w)
    print(f"infernix-serve: sampling defaults {generation_config.describe(d)}"
          f"{f' ({whence})' if whence else ' (the protocols: temperature 1)'}; max new tokens "
          f"{limits.max_new_tokens or 'as the context allows'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
