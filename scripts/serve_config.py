"""infernix-serve's config file (`--config FILE`): a JSON object of its options by their long names
without the dashes, e.g. {"model": "qwen3-8b", "kv-cache-gib": 8, "lossless": true}. Options given on
the command line win over the file (but a flag the file turns on stays on). The /configure page
writes the file (server/admin.py)."""
from __future__ import annotations

import argparse
import json
import math
import os

NOT_IN_FILE = ("config", "plan", "help")       # what a file cannot hold


def options(p: argparse.ArgumentParser, aliases: bool = False) -> dict:
    """long option name (no dashes) -> its argparse action: each action once by its first long
    name, or (aliases) by every one of them (a file may say "max-batch" for "max-num-seqs")."""
    out = {}
    for a in p._actions:
        longs = [o[2:] for o in a.option_strings if o.startswith("--")]
        for name in (longs if aliases else longs[:1]):
            if name not in NOT_IN_FILE:
                out[name] = a
    return out


def canonical(p: argparse.ArgumentParser, settings: dict) -> dict:
    """settings with each option under its first long name ("max-batch" -> "max-num-seqs"); names
    p does not know are kept (tokens() refuses them)."""
    first = {a: name for name, a in options(p).items()}
    every = options(p, aliases=True)
    return {first.get(every.get(k), k): v for k, v in settings.items()}


def kind(a: argparse.Action) -> str:
    if isinstance(a, argparse._StoreTrueAction):
        return "flag"
    if a.nargs in ("+", "*"):
        return "list"
    return {int: "int", float: "float"}.get(a.type, "str")


def tokens(p: argparse.ArgumentParser, settings: dict, where: str) -> list[str]:
    """settings -> command-line tokens for p (ValueError, naming `where`, for an unknown option or a
    value of the wrong kind)."""
    opts, out = options(p, aliases=True), []
    for name, v in settings.items():
        a = opts.get(name)
        if a is None:
            raise ValueError(f"{where}: unknown option {name!r} (options are infernix-serve's long names "
                             f"without the dashes, e.g. \"kv-cache-gib\")")
        k = kind(a)
        if k == "flag":
            if not isinstance(v, bool):
                raise ValueError(f"{where}: {name} takes true or false, not {v!r}")
            out += [f"--{name}"] if v else []
        elif v is None:
            continue
        elif k == "list":
            vals = [str(x) for x in (v if isinstance(v, list) else [v])]
            if not vals or any(x.startswith("-") or isinstance(x, (dict, list)) for x in vals):
                raise ValueError(f"{where}: {name} takes a list of plain values, not {json.dumps(v)}")
            out += [f"--{name}", *vals]
        elif isinstance(v, (dict, list, bool)):
            raise ValueError(f"{where}: {name} takes one value, not {json.dumps(v)}")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{where}: {name} must be a finite number, not {v}")
        else:
            out.append(f"--{name}={v}")          # one token: a value may start with '-'
    return out


def read(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"--config {path} must hold a JSON object of options")
    return d


def argv_with_config(p: argparse.ArgumentParser, argv: list[str] | None) -> tuple[list[str], str | None]:
    """The command line with --config FILE's options put before it (so that flags win) -> (argv, FILE)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return argv, None
    import sys
    rest = list(sys.argv[1:] if argv is None else argv)
    return tokens(p, read(known.config), f"--config {known.config}") + rest, known.config


class _Refused(Exception):
    pass


def parse_checked(p: argparse.ArgumentParser, settings: dict) -> argparse.Namespace:
    """settings parsed as p would parse them from a file (ValueError with argparse's own message,
    which p.error would print before exiting the process)."""
    def refuse(message):
        raise _Refused(message)
    p.error = refuse                       # (on this parser object only; the server parsed its own long ago)
    try:
        return p.parse_args(tokens(p, settings, "setting"))
    except _Refused as e:
        raise ValueError(str(e)) from None
    finally:
        del p.error


def started(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """The options of a parsed command line that differ from their defaults (what to keep)."""
    out = {}
    for name, act in options(p).items():
        v = getattr(a, act.dest, None)
        if v != act.default:
            out[name] = v
    return out


def describe(p: argparse.ArgumentParser, skip: tuple) -> list[dict]:
    """Each option (but skip) for the /configure page: name, kind, default, choices, help."""
    out = []
    for name, a in options(p).items():
        if name in skip:
            continue
        out.append({"name": name, "kind": kind(a), "default": a.default, "choices": list(a.choices or []) or None,
                    "help": (a.help or "").replace("%(default)s", str(a.default))})
    return out


def default_path() -> str:
    from infernix_jax.hub import home
    return os.path.join(str(home()), "serve-config.json")
