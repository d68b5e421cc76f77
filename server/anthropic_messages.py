"""POST /v1/messages and /v1/messages/count_tokens (Anthropic): body -> chat-template messages and
sampling parameters; turn pieces -> a message or its SSE event sequence
(message_start, content_block_start / _delta / _stop, message_delta, message_stop, ping)."""
from __future__ import annotations

import json
import secrets

from infernix_jax.engine import SamplingParams

from .errors import IMAGE_NOTE, APIError, vision_disabled
from .openai_chat import constraint
from .parsing import ToolCall
from .prompt import budget, render
from .turn import Done, Features, features_for
from .validate import get_bool, get_int, get_number, get_stop

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
BILLING_PREFIX = "x-anthropic-billing-header:"


def invalid(message: str) -> APIError:
    return APIError(message, 400, "invalid_request_error", protocol="anthropic")


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content blocks")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise invalid(f"{where}.content[{i}] must be an object with a 'type'")
    return content


def _text(b: dict, where: str) -> str:
    if not isinstance(b.get("text"), str):
        raise invalid(f"{where}: a text block needs a string 'text'")
    return b["text"]


def _strip_billing(text: str) -> str:
    """Claude Code starts its system prompt with a per-conversation attribution line; it changes
    nothing about the answer and would defeat prefix reuse, so it is dropped before templating."""
    if text.startswith(BILLING_PREFIX):
        return text.split("\n", 1)[1] if "\n" in text else ""
    return text


def _system_text(system) -> str:
    if system is None:
        return ""
    parts = [_text(b, f"system[{i}]") for i, b in enumerate(_blocks(system, "system"))
             if b["type"] == "text"] if not isinstance(system, str) else [system]
    parts = [p for p in (_strip_billing(p) for p in parts) if p]
    return "\n".join(parts)


def _tool_result_text(b: dict, where: str) -> str:
    c = b.get("content", "")
    if isinstance(c, str):
        text = c
    else:
        parts = []
        for blk in _blocks(c, where):
            if blk["type"] == "text":
                parts.append(_text(blk, where))
            elif blk["type"] == "image":         # (Claude Code reading an image file)
                parts.append(IMAGE_NOTE)
            else:
                raise invalid(f"{where}: tool_result content of type {blk['type']!r} is not supported by this "
                              "text-only model")
        text = "\n".join(parts)
    return f"Error: {text}" if b.get("is_error") else text


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages: must be a non-empty list")
    out: list[dict] = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where}: must be an object")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role: must be 'user' or 'assistant' (or 'system'), got {role!r}")
        blocks = _blocks(m.get("content"), where)
        if role == "system":
            text = _system_text(m.get("content"))
            if text:
                out.append({"role": "system", "content": text})
            continue
        if role == "assistant":
            out.append(_assistant(blocks, where))
            continue
        texts = []
        for j, b in enumerate(blocks):
            w = f"{where}.content[{j}]"
            if b["type"] == "text":
                texts.append(_text(b, w))
            elif b["type"] == "tool_result":
                if not isinstance(b.get("tool_use_id"), str):
                    raise invalid(f"{w}: a tool_result needs a string 'tool_use_id'")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b, w)})
            elif b["type"] == "image":
                raise vision_disabled(w)
            elif b["type"] == "document":
                raise invalid(f"{w}: document blocks are not supported: this model reads text only")
            else:
                raise invalid(f"{w}: unknown content block type {b['type']!r} in a user message")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[dict], where: str) -> dict:
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        if b["type"] == "text":
            text.append(_text(b, w))
        elif b["type"] == "thinking":
            if isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])
        elif b["type"] == "redacted_thinking":
            continue
        elif b["type"] == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                raise invalid(f"{w}: a tool_use block needs a string 'id' and 'name'")
            inp = b.get("input", {})
            if not isinstance(inp, dict):
                raise invalid(f"{w}.input: must be an object")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": inp}})
        else:
            raise invalid(f"{w}: unknown content block type {b['type']!r} in an assistant message")
    msg = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def parse_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools: must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid(f"tools[{i}]: each tool needs a string 'name'")
        kind = t.get("type", "custom")
        if kind not in (None, "custom"):
            raise invalid(f"tools[{i}]: server tools of type {kind!r} are not available on this server")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):      # (Anthropic's API answers 400 too: a custom tool needs one)
            raise invalid(f"tools[{i}].input_schema: " + ("required: a custom tool needs a JSON schema object"
                                                          if schema is None else "must be an object"))
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": schema}})
    return out or None


def _tool_choice(body: dict, tools):
    tc = body.get("tool_choice")
    if tc is None:
        return tools, None
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    if tc["type"] == "none":
        return None, None
    if tc["type"] == "tool":
        names = {t["function"]["name"] for t in tools or ()}
        if not isinstance(tc.get("name"), str) or tc["name"] not in names:
            raise invalid(f"tool_choice.name: {tc.get('name')!r} is not one of the request's tools")
        return tools, tc["name"]
    return tools, ("any" if tc["type"] == "any" else None)


def build(body, engine, tolerant: bool = False) -> tuple[list[int], SamplingParams, Features, dict]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    messages = parse_messages(body)
    tools, forced = _tool_choice(body, parse_tools(body))
    kwargs, display = _thinking(body, messages)
    out_cfg = body.get("output_config") if isinstance(body.get("output_config"), dict) else {}
    if out_cfg.get("effort") is not None and out_cfg["effort"] not in EFFORTS:
        raise _field("output_config.effort", f"must be one of {', '.join(EFFORTS)}")
    try:
        grammar = constraint(engine, out_cfg.get("format") or body.get("output_format"), "output_config.format",
                             tools, None if forced is None else ("required" if forced == "any" else forced), kwargs)
    except APIError as e:
        raise invalid(e.message) from None
    ids, text = render(engine, messages, tools, kwargs)
    max_tokens = _get(get_int, body, "max_tokens", None, 1)
    if max_tokens is None:
        raise invalid("max_tokens: field required")
    stream = _get(get_bool, body, "stream", False)
    temperature = _get(get_number, body, "temperature", 1.0, 0.0, 1.0)
    top_p = _get(get_number, body, "top_p", 1.0, 0.0, 1.0)
    top_k = _get(get_int, body, "top_k", 0, 0)
    if "stop_sequences" in body and not isinstance(body["stop_sequences"], (list, type(None))):
        raise invalid("stop_sequences: must be a list of strings")
    stop = _get(get_stop, body, "stop_sequences")
    params = SamplingParams(max_tokens=budget(engine, len(ids), max_tokens), temperature=temperature,
                            top_p=max(top_p, 1e-9), top_k=top_k, stop=stop, grammar=grammar)
    meta = {"id": "msg_" + secrets.token_hex(12), "model": body.get("model") if isinstance(body.get("model"), str)
            else engine.model_name, "stream": stream, "display": display, "forced_tool": forced}
    tc = body.get("tool_choice")
    parallel = not (isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True)
    return ids, params, features_for(engine.tokenizer, text, tools, tolerant, parallel), meta


THINKING = ("enabled", "disabled", "adaptive", "between_tools")
DISPLAYS = ("summarized", "omitted", "full", "updates")
EFFORTS = ("low", "medium", "high", "xhigh", "max")     # (output_config.effort: taken, no effect on this server)


def _thinking(body: dict, messages: list[dict]) -> tuple[dict, str]:
    """The chat template's thinking switch and the thinking blocks' display from `thinking`:
    between_tools thinks only when the turn continues after tool results; "updates" shows the
    thinking as "summarized" does (here: the whole text)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}, "summarized"
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING:
        raise invalid("thinking: must be {\"type\": " + " | ".join(f'\"{t}\"' for t in THINKING) + "}")
    kind = thinking["type"]
    if kind == "enabled":
        _get(get_int, thinking, "budget_tokens", None, 1)
    on = kind != "disabled" and (kind != "between_tools" or (bool(messages) and messages[-1]["role"] == "tool"))
    display = thinking.get("display", "summarized")
    if display not in DISPLAYS:
        raise _field("thinking.display", "must be " + ", ".join(f"'{d}'" for d in DISPLAYS))
    return {"enable_thinking": on}, display


def _get(fn, body, name, *a):
    try:
        return fn(body, name, *a)
    except APIError as e:
        raise invalid(f"{name}: {e.message}") from None


def _field(name, msg):
    return invalid(f"{name}: {msg}")


def count_tokens(body, engine) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    messages = parse_messages(body)
    tools = parse_tools(body)
    ids, _ = render(engine, messages, tools, _thinking(body, messages)[0])
    return {"input_tokens": len(ids)}


# ---- responses -------------------------------------------------------------------------------
def _signature() -> str:
    return secrets.token_urlsafe(24)      # opaque; we need none to resume (the text is re-templated)


def tool_use_block(call: ToolCall) -> dict:
    try:
        inp = json.loads(call.arguments)
    except ValueError:
        inp = {}
    return {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": call.name, "input": inp}


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    """Anthropic counts cache reads apart from input_tokens (clients add them up for the context)."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_body(meta, reasoning: str, text: str, calls: list[ToolCall], done: Done) -> dict:
    content = []
    if reasoning:
        content.append({"type": "thinking", "thinking": "" if meta["display"] == "omitted" else reasoning,
                        "signature": _signature()})
    if text or not (calls or reasoning):
        content.append({"type": "text", "text": text})
    content += [tool_use_block(c) for c in calls]
    return {"id": meta["id"], "type": "message", "role": "assistant", "model": meta["model"], "content": content,
            "stop_reason": _stop_reason(done), "stop_sequence": done.stop_sequence,
            "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)}


def _stop_reason(done: Done) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASON.get(done.finish_reason, "end_turn")


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamRenderer:
    """Turn pieces -> Anthropic SSE events, opening and closing content blocks as the kind changes."""
    heartbeat_is_event = True        # ping is an event: message_start goes first

    def __init__(self, meta: dict, prompt_tokens: int):
        self.meta, self.prompt_tokens = meta, prompt_tokens
        self.index = -1
        self.open: str | None = None          # kind of the open block

    def start(self) -> list[str]:
        msg = {"id": self.meta["id"], "type": "message", "role": "assistant", "model": self.meta["model"],
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_tokens, 0)}
        return [sse("message_start", {"type": "message_start", "message": msg})]

    @staticmethod
    def heartbeat() -> str:
        return sse("ping", {"type": "ping"})

    def _close(self) -> list[str]:
        out = []
        if self.open == "thinking":
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "signature_delta", "signature": _signature()}}))
        if self.open is not None:
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _open(self, kind: str, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return out

    def piece(self, kind: str, v) -> list[str]:
        out: list[str] = []
        if kind == "reasoning":
            if self.open != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.meta["display"] != "omitted":
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                       "delta": {"type": "thinking_delta", "thinking": v}}))
        elif kind == "text":
            if self.open != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "text_delta", "text": v}}))
        elif kind == "tool_call":
            block = tool_use_block(v)
            out += self._open("tool_use", {**block, "input": {}})
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": json.dumps(block["input"])}}))
            out += self._close()
        elif kind == "done":
            if v.finish_reason == "error":
                return self._close() + [sse("error", {"type": "error", "error": {"type": "api_error",
                                                                                "message": v.error}})]
            if self.index < 0:                 # an empty reply still has one (empty) text block
                out += self._open("text", {"type": "text", "text": ""})
            out += self._close()
            out.append(sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": _stop_reason(v), "stop_sequence": v.stop_sequence},
                                             "usage": usage(v.prompt_tokens, v.completion_tokens,
                                                            v.cached_tokens)}))
            out.append(sse("message_stop", {"type": "message_stop"}))
        return out
