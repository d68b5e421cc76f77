"""Streaming parsers for model output: reasoning (<think> ... </think>) and tool calls, in the two
formats Qwen models write:

  json (Qwen3 / Hermes):       <tool_call>{"name": "f", "arguments": {...}}</tool_call>
  xml  (Qwen3-Coder / 3.5):    <tool_call><function=f><parameter=p>value</parameter></function></tool_call>

Both are fed text deltas as they are decoded and return what is now certain; a tail that might be
the start of a tag is held back until the next delta settles it, so a tag split across deltas (at any
byte) is still found, and prose never waits longer than the length of a tag. A `<tool_call>` that is
not followed by a call (a literal in prose) is released as text as soon as that is clear."""
from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str            # a JSON object, as text


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ReasoningParser:
    """Splits output into ("reasoning", text) and ("text", text) pieces. `in_reasoning`: the prompt
    already opened the thinking block (templates that end the generation prompt with <think>)."""

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self.buf = ""
        self.seen_text = False          # a <think> after real text is prose, not a thinking block
        self.strip_next = False         # the whitespace after </think> belongs to neither part

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.in_reasoning:
                i = self.buf.find(self.end)
                if i < 0:
                    keep = _held(self.buf, (self.end,))
                    self._emit(out, "reasoning", self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._emit(out, "reasoning", self.buf[:i])
                self.buf = self.buf[i + len(self.end):]
                self.in_reasoning, self.strip_next = False, True
                continue
            if self.strip_next:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.strip_next = False
            if not self.seen_text:
                head = self.buf.lstrip()
                if head.startswith(self.start):
                    self.buf = head[len(self.start):]
                    self.in_reasoning = True
                    continue
                if self.start.startswith(head):        # could still become <think>: wait
                    break
                self.seen_text = True
            self._emit(out, "text", self.buf)
            self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.buf:
            self._emit(out, "reasoning" if self.in_reasoning else "text", self.buf)
            self.buf = ""
        return out

    @staticmethod
    def _emit(out, kind, text):
        if text:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))


class ToolCallParser:
    """Splits text into ("text", str) and ("tool_call", ToolCall) pieces.
    tools: the request's tools in OpenAI form, used to type the xml format's parameters."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, fmt: str, tools: list[dict] | None = None):
        if fmt not in ("json", "xml"):
            raise ValueError(f"unknown tool call format {fmt!r}")
        self.fmt = fmt
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools or () if isinstance(t.get("function"), dict)}
        self.buf = ""
        self.in_call = False
        self.calls = 0

    def feed(self, delta: str) -> list[tuple[str, object]]:
        self.buf += delta
        out: list[tuple[str, object]] = []
        while self.buf:
            if not self.in_call:
                i = self.buf.find(self.OPEN)
                if i < 0:
                    keep = _held(self.buf, (self.OPEN,))
                    self._text(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._text(out, self.buf[:i])
                self.buf = self.buf[i + len(self.OPEN):]
                self.in_call = True
                continue
            body = self.buf.lstrip()
            if body and not body.startswith("{" if self.fmt == "json" else "<"):
                self._text(out, self.OPEN + self.buf)          # a literal <tool_call> in prose
                self.buf, self.in_call = "", False
                continue
            j = self.buf.find(self.CLOSE)
            if j < 0:
                break
            raw = self.buf[:j]
            self.buf = self.buf[j + len(self.CLOSE):]
            self.in_call = False
            calls = self._parse(raw)
            if calls is None:                                    # unparseable: the text stays text
                self._text(out, self.OPEN + raw + self.CLOSE)
            else:
                out.extend(("tool_call", c) for c in calls)
                self.calls += len(calls)
        return out

    def finish(self, keep_partial: bool = False) -> list[tuple[str, object]]:
        """End of output. An unclosed call is dropped back to text unless keep_partial (the caller's
        --tolerant-tool-calls, when max_tokens, the context or a cancellation cut the reply)."""
        out: list[tuple[str, object]] = []
        if self.in_call:
            calls = self._parse(self.buf, partial=True) if keep_partial else None
            if calls:
                out.extend(("tool_call", c) for c in calls)
                self.calls += len(calls)
            else:
                self._text(out, self.OPEN + self.buf)
        elif self.buf:
            self._text(out, self.buf)
        self.buf, self.in_call = "", False
        return out

    def _text(self, out, text: str) -> None:
        if self.calls and not text.strip():
            return                                               # whitespace between calls
        if text:
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + text)
            else:
                out.append(("text", text))

    # ---- formats -------------------------------------------------------------------------------
    def _parse(self, raw: str, partial: bool = False) -> list[ToolCall] | None:
        try:
            return self._parse_json(raw, partial) if self.fmt == "json" else self._parse_xml(raw, partial)
        except (ValueError, TypeError, KeyError, RecursionError):
            return None

    def _parse_json(self, raw: str, partial: bool) -> list[ToolCall] | None:
        obj = json.loads(raw) if not partial else _close_json(raw.strip())
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):                               # some models emit the arguments as a string
            args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            return None
        return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]

    _FUNC = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|$)", re.S)

    def _parse_xml(self, raw: str, partial: bool) -> list[ToolCall] | None:
        calls = []
        for fm in self._FUNC.finditer(raw):
            name, body = fm.group(1), fm.group(2)
            if not partial and "</function>" not in raw[fm.start():fm.end()]:
                return None
            props = param_schemas(self.schemas.get(name, {}))
            args = {}
            for pm in self._PARAM.finditer(body):
                if not partial and not pm.group(0).endswith("</parameter>"):
                    return None
                args[pm.group(1)] = typed_value(_strip_one_newline(pm.group(2)), props.get(pm.group(1)))
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls or raw[:raw.find("<function=")].strip():
            return None
        return calls


def _strip_one_newline(v: str) -> str:
    # the format puts values on their own lines: "<parameter=p>\nvalue\n</parameter>"
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


def param_schemas(schema) -> dict:
    """A tool's parameters {name: schema}: its properties, and those of each branch of a root
    anyOf/oneOf (a name in several branches with different schemas: their anyOf)."""
    if not isinstance(schema, dict):
        return {}
    found: dict[str, list] = {}
    branches = [b for k in ("anyOf", "oneOf") for b in (schema.get(k) if isinstance(schema.get(k), list) else ())]
    for part in (schema, *branches):
        props = part.get("properties") if isinstance(part, dict) else None
        for name, sub in (props.items() if isinstance(props, dict) else ()):
            if sub not in found.setdefault(name, []):
                found[name].append(sub)
    return {name: subs[0] if len(subs) == 1 else {"anyOf": subs} for name, subs in found.items()}


def typed_value(v: str, schema) -> object:
    """A parameter's text -> the JSON value its schema asks for (root anyOf/oneOf: the first that fits;
    no schema: JSON if it parses, else the text)."""
    if not isinstance(schema, dict):
        return _json_or_text(v)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            subs = sorted(schema[key], key=lambda s: isinstance(s, dict) and s.get("type") == "string")
            for sub in subs:
                try:
                    return _typed_strict(v, sub)
                except ValueError:
                    continue
            return v
    try:
        return _typed_strict(v, schema)
    except ValueError:
        return v


def _typed_strict(v: str, schema) -> object:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):
        for one in sorted(t, key=lambda x: x == "string"):
            try:
                return _typed_strict(v, {"type": one})
            except ValueError:
                continue
        raise ValueError(v)
    s = v.strip()
    if t == "string":
        return v
    if t == "integer":
        return int(s)
    if t == "number":
        f = float(s)
        return int(f) if f.is_integer() and re.fullmatch(r"-?\d+", s) else f
    if t == "boolean":
        if s.lower() in ("true", "false"):
            return s.lower() == "true"
        raise ValueError(v)
    if t == "null":
        if s.lower() in ("null", "none", ""):
            return None
        raise ValueError(v)
    if t in ("object", "array"):
        val = json.loads(s)
        if not isinstance(val, dict if t == "object" else list):
            raise ValueError(v)
        return val
    return _json_or_text(v)


def _json_or_text(v: str) -> object:
    try:
        return json.loads(v)
    except ValueError:
        return v


def _close_json(text: str):
    """Parse a JSON prefix cut off mid-way by closing its open strings, arrays and objects."""
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    tail = ('"' if in_str else "") + "".join(reversed(stack))
    for candidate in (text + tail, text.rstrip(",: \n") + tail):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    raise ValueError("cannot close this JSON prefix")


def tool_format_of(chat_template: str | None) -> str | None:
    """Which tool-call format a chat template teaches the model (None: the template has no tools)."""
    if not chat_template or "<tool_call>" not in chat_template:
        return None
    return "xml" if "<function=" in chat_template else "json"
