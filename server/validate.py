"""Small typed readers for JSON bodies: each raises a 400 naming the offending field."""
from __future__ import annotations

import re
from typing import Any

from .errors import invalid

_MISSING = object()
MAX_DEPTH = 256      # deeper JSON (bodies, tool-call arguments) is refused: nothing real nests that far


def check_depth(obj, what: str, param: str | None = None) -> None:
    """400 when obj nests lists/objects deeper than MAX_DEPTH (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            children = o.values()
        elif isinstance(o, list):
            children = o
        else:
            continue
        if d > MAX_DEPTH:
            raise invalid(f"{what} is nested deeper than {MAX_DEPTH} levels", param)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))


_SURROGATE = re.compile("[\ud800-\udfff]")


def mend_surrogates(obj):
    """obj with every lone UTF-16 surrogate in its strings (keys too) replaced by U+FFFD: JSON allows
    an unpaired "\\ud800" (a client cutting text between the halves of an emoji sends one), which no
    tokenizer can encode. Iterative: the body's depth is already bounded (check_depth)."""
    fix = lambda s: _SURROGATE.sub("\ufffd", s) if isinstance(s, str) else s  # noqa: E731
    root = [obj]
    stack = [root]
    while stack:
        o = stack.pop()
        items = list(o.items()) if isinstance(o, dict) else list(enumerate(o))
        if isinstance(o, dict) and any(isinstance(k, str) and _SURROGATE.search(k) for k in o):
            o.clear()
            o.update((fix(k), v) for k, v in items)
            items = list(o.items())
        for k, v in items:
            if isinstance(v, str):
                o[k] = fix(v)
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return root[0]


def get_number(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"'{name}' must be a number, got {type(v).__name__}", name)
    if not lo <= v <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return float(v)


def get_int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise invalid(f"'{name}' must be {bound}, got {v}", name)
    return v


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def get_stop(body: dict, name: str = "stop") -> tuple[str, ...]:
    v = body.get(name)
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"'{name}' must be a string or a list of strings", name)
    if len(items) > 16:
        raise invalid(f"'{name}' may hold at most 16 strings", name)
    if any(s == "" for s in items):
        raise invalid(f"'{name}' strings must be non-empty", name)
    return tuple(items)


def get_dict(body: dict, name: str) -> dict[str, Any] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object", name)
    return v
