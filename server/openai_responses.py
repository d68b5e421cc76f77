"""POST /v1/responses (OpenAI Responses API, what Codex speaks).

input: a string or a list of items: messages (roles user / assistant / system / developer, with
input_text / output_text parts, an `id` or not), function_call and function_call_output items of
earlier turns, and reasoning items (their text goes back to the template as reasoning_content).
Nothing is stored (store: true is accepted and ignored; previous_response_id is refused: resend the
items). Function tools, also nested in `namespace` entries; hosted tools (web_search, ...) are not
offered to the model. Output: reasoning, message and function_call items, or their event stream
(response.created ... response.completed, each event with a sequence_number)."""
from __future__ import annotations

import json
import secrets
import time

from .errors import IMAGE_NOTE, invalid, vision_disabled
from .openai_chat import constraint, sampling, tool_choice
from .parsing import ToolCall
from .prompt import budget, render
from .turn import Done, features_for
from .validate import MAX_DEPTH, check_depth, get_bool, get_dict, get_int

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
HOSTED_TOOLS = {"web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "image_generation", "local_shell", "mcp", "custom", "apply_patch", "shell"}


def _text_parts(content, where: str, tool: bool = False) -> str:
    """Parts' text; images: IMAGE_NOTE in a function_call_output, else vision_disabled."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}.content[{j}] must be an object", "input")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}] needs a string 'text'", "input")
            out.append(part["text"])
        elif kind == "input_image":
            if not tool:
                raise vision_disabled(f"{where}.content[{j}]", "input")
            out.append(IMAGE_NOTE)
        elif kind in ("input_file", "input_audio"):
            raise invalid(f"{where}.content[{j}]: {kind} is not supported: this model reads text only", "input")
        elif kind == "refusal":
            out.append(part.get("refusal") or "")
        else:
            raise invalid(f"{where}.content[{j}]: unknown part type {kind!r}", "input")
    return "".join(out)


def parse_input(body) -> list[dict]:
    msgs: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string", "instructions")
        if instructions:
            msgs.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a non-empty string or list of items", "input")
    pending_reasoning = None
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise invalid(f"{where} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = ROLES.get(it.get("role")) if isinstance(it.get("role"), str) else None
            if role is None:
                raise invalid(f"{where}.role must be user, assistant, system or developer", "input")
            msg = {"role": role, "content": _text_parts(it.get("content"), where)}
            if role == "assistant" and pending_reasoning:
                msg["reasoning_content"], pending_reasoning = pending_reasoning, None
            _append(msgs, msg)
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            pending_reasoning = _text_parts(parts, where) if parts else pending_reasoning
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise invalid(f"{where}: a function_call needs string 'name' and 'call_id'", "input")
            args = it.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
            except (ValueError, RecursionError):
                raise invalid(f"{where}.arguments is not valid JSON of at most {MAX_DEPTH} levels", "input") from None
            check_depth(args, f"{where}.arguments", "input")
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": args}}
            last = msgs[-1] if msgs else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)          # parallel calls of one turn
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning:
                    msg["reasoning_content"], pending_reasoning = pending_reasoning, None
                msgs.append(msg)
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise invalid(f"{where}: a function_call_output needs a string 'call_id'", "input")
            out = it.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else _text_parts(out, where, tool=True)})
        elif kind == "item_reference":
            raise invalid(f"{where}: item references need stored responses, and this server stores none; "
                          "send the items themselves", "input")
        else:
            raise invalid(f"{where}: input items of type {kind!r} are not supported", "input")
    return msgs


def _append(msgs, msg):
    # consecutive system/developer items are one system message to the template
    if msgs and msg["role"] == "system" and msgs[-1]["role"] == "system" and len(msgs) == 1:
        msgs[-1]["content"] += "\n\n" + msg["content"]
    else:
        msgs.append(msg)


def parse_tools(body) -> tuple[list[dict] | None, dict]:
    """-> chat-form function tools, and {function name: namespace} for namespaced ones."""
    tools = body.get("tools")
    if tools is None:
        return None, {}
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    out, spaces = [], {}

    def add(t, i, space=None):
        if not isinstance(t.get("name"), str):
            raise invalid(f"tools[{i}]: a function tool needs a string 'name'", "tools")
        params = t.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].parameters must be an object", "tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                      "parameters": params}})
        if space:
            spaces[t["name"]] = space
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise invalid(f"tools[{i}] must be an object", "tools")
        kind = t.get("type")
        if kind == "function":
            add(t, i)
        elif kind == "namespace":
            if not isinstance(t.get("tools") or [], list):
                raise invalid(f"tools[{i}].tools must be a list", "tools")
            for sub in t.get("tools") or ():
                if isinstance(sub, dict) and sub.get("type", "function") == "function":
                    add(sub, i, t.get("name"))
        elif isinstance(kind, str) and kind in HOSTED_TOOLS:
            continue          # hosted tools are the provider's to run; this server offers none
        else:
            raise invalid(f"tools[{i}]: unknown tool type {kind!r}", "tools")
    return out or None, spaces


def build(body, engine, tolerant: bool = False):
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise invalid("'previous_response_id' needs stored responses, and this server stores none: send the "
                      "earlier items in 'input'", "previous_response_id")
    fmt = (get_dict(body, "text") or {}).get("format")
    messages = parse_input(body)
    tools, spaces = parse_tools(body)
    chat_tc = body.get("tool_choice")
    if isinstance(chat_tc, dict) and chat_tc.get("type") == "function" and "function" not in chat_tc:
        chat_tc = {"type": "function", "function": {"name": chat_tc.get("name")}}
    tools, forced = tool_choice({"tool_choice": chat_tc}, tools)
    reasoning = get_dict(body, "reasoning") or {}
    kwargs = {}
    if reasoning.get("effort") is not None:
        kwargs["enable_thinking"] = reasoning["effort"] not in ("none", "minimal")
    grammar = constraint(engine, fmt, "text", tools, forced, kwargs)
    ids, text = render(engine, messages, tools, kwargs, "input")
    max_out = get_int(body, "max_output_tokens", None, 1)
    sampling_body = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed", "stop") if k in body}
    params = sampling(sampling_body, budget(engine, len(ids), max_out, "max_output_tokens"), grammar)
    meta = {"id": "resp_" + secrets.token_hex(12), "created_at": int(time.time()),
            "model": body.get("model") if isinstance(body.get("model"), str) else engine.model_name,
            "stream": get_bool(body, "stream", False), "spaces": spaces, "forced_tool": forced,
            "summary": reasoning.get("summary") is not None,
            "echo": {"tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                     "parallel_tool_calls": body.get("parallel_tool_calls", True),
                     "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                     "max_output_tokens": max_out, "reasoning": reasoning or {"effort": None, "summary": None},
                     "store": body.get("store", False), "metadata": body.get("metadata") or {},
                     "instructions": body.get("instructions"),
                     "text": {"format": fmt if isinstance(fmt, dict) else {"type": "text"}}}}
    parallel = get_bool(body, "parallel_tool_calls", True)
    return ids, params, features_for(engine.tokenizer, text, tools, tolerant, parallel), meta


# ---- output ----------------------------------------------------------------------------------
def _usage(done: Done | None) -> dict | None:
    if done is None:
        return None
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def response_object(meta, output: list[dict], done: Done | None) -> dict:
    status = "in_progress" if done is None else {"length": "incomplete", "error": "failed"}.get(
        done.finish_reason, "completed")
    return {"id": meta["id"], "object": "response", "created_at": meta["created_at"], "status": status,
            "error": {"code": "server_error", "message": done.error} if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": meta["model"], "output": output, "previous_response_id": None,
            "truncation": "disabled", "user": None,
            "usage": _usage(done), **meta["echo"]}


def reasoning_item(meta, item_id: str, text: str) -> dict:
    parts = [{"type": "summary_text", "text": text}] if meta["summary"] else []
    return {"type": "reasoning", "id": item_id, "summary": parts,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """status: completed, in_progress (no content yet), or incomplete (cut by max_output_tokens)."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(meta, item_id: str, call: ToolCall, status: str = "completed") -> dict:
    item = {"type": "function_call", "id": item_id, "call_id": "call_" + secrets.token_hex(12), "name": call.name,
            "arguments": call.arguments, "status": status}
    if call.name in meta["spaces"]:
        item["namespace"] = meta["spaces"][call.name]
    return item


def body_of(meta, reasoning: str, text: str, calls: list[ToolCall], done: Done) -> dict:
    output = []
    if reasoning:
        output.append(reasoning_item(meta, "rs_" + secrets.token_hex(12), reasoning))
    if text or not calls:
        output.append(message_item("msg_" + secrets.token_hex(12), text, _item_status(done)))
    output += [call_item(meta, "fc_" + secrets.token_hex(12), c) for c in calls]
    return response_object(meta, output, done)


def _item_status(done: Done | None) -> str:
    """A message item cut by max_output_tokens is incomplete, as its response is."""
    return "incomplete" if done is not None and done.finish_reason == "length" else "completed"


class StreamRenderer:
    """Turn pieces -> Responses events: items open and close as the kind of output changes."""

    def __init__(self, meta: dict):
        self.meta = meta
        self.seq = 0
        self.output: list[dict] = []
        self.open: str | None = None
        self.item_id = ""
        self.buf: list[str] = []

    def _ev(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        r = response_object(self.meta, [], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    @staticmethod
    def heartbeat() -> str:
        return ": keep-alive\n\n"

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        idx, text, out = len(self.output), "".join(self.buf), []
        if self.open == "reasoning":
            item = reasoning_item(self.meta, self.item_id, text)
            if self.meta["summary"]:
                out.append(self._ev("response.reasoning_summary_text.done", item_id=self.item_id, output_index=idx,
                                    summary_index=0, text=text))
                out.append(self._ev("response.reasoning_summary_part.done", item_id=self.item_id, output_index=idx,
                                    summary_index=0, part={"type": "summary_text", "text": text}))
            out.append(self._ev("response.reasoning_text.done", item_id=self.item_id, output_index=idx,
                                content_index=0, text=text))
        else:
            item = message_item(self.item_id, text, status)
            out.append(self._ev("response.output_text.done", item_id=self.item_id, output_index=idx, content_index=0,
                                text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=self.item_id, output_index=idx,
                                content_index=0, part=item["content"][0]))
        out.append(self._ev("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        self.open, self.buf = None, []
        return out

    def _open(self, kind: str) -> list[str]:
        out = self._close()
        idx = len(self.output)
        self.open = kind
        if kind == "reasoning":
            self.item_id = "rs_" + secrets.token_hex(12)
            out.append(self._ev("response.output_item.added", output_index=idx,
                                item={"type": "reasoning", "id": self.item_id, "summary": []}))
            if self.meta["summary"]:
                out.append(self._ev("response.reasoning_summary_part.added", item_id=self.item_id, output_index=idx,
                                    summary_index=0, part={"type": "summary_text", "text": ""}))
        else:
            self.item_id = "msg_" + secrets.token_hex(12)
            out.append(self._ev("response.output_item.added", output_index=idx,
                                item=message_item(self.item_id, "", "in_progress")))
            out.append(self._ev("response.content_part.added", item_id=self.item_id, output_index=idx,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def piece(self, kind: str, v) -> list[str]:
        out: list[str] = []
        if kind in ("reasoning", "text"):
            want = "reasoning" if kind == "reasoning" else "message"
            if self.open != want:
                out += self._open(want)
            self.buf.append(v)
            idx = len(self.output)
            if kind == "text":
                out.append(self._ev("response.output_text.delta", item_id=self.item_id, output_index=idx,
                                    content_index=0, delta=v, logprobs=[]))
            else:
                if self.meta["summary"]:
                    out.append(self._ev("response.reasoning_summary_text.delta", item_id=self.item_id,
                                        output_index=idx, summary_index=0, delta=v))
                out.append(self._ev("response.reasoning_text.delta", item_id=self.item_id, output_index=idx,
                                    content_index=0, delta=v))
        elif kind == "tool_call":
            out += self._close()
            idx = len(self.output)
            item = call_item(self.meta, "fc_" + secrets.token_hex(12), v)
            out.append(self._ev("response.output_item.added", output_index=idx,
                                item={**item, "arguments": "", "status": "in_progress"}))
            out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                delta=item["arguments"]))
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                arguments=item["arguments"]))
            out.append(self._ev("response.output_item.done", output_index=idx, item=item))
            self.output.append(item)
        elif kind == "done":
            if v.finish_reason != "error" and not self.output and self.open is None:
                out += self._open("message")      # an empty reply is still one (empty) message
            out += self._close(_item_status(v))
            r = response_object(self.meta, self.output, v)
            name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                r["status"], "response.failed")
            out.append(self._ev(name, response=r))
        return out
