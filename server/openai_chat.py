"""POST /v1/chat/completions: body -> engine Request; results -> a completion or an SSE stream."""
from __future__ import annotations

import json
import time
import uuid

import jinja2

from infernix_jax.engine import Request, SamplingParams
from infernix_jax.tokenizer import TokenizerError

from .errors import APIError, invalid
from .validate import get_bool, get_dict, get_int, get_number, get_stop

ROLES = {"system", "developer", "user", "assistant", "tool"}
# Fields we accept and do not act on (they change nothing about the answer we give).
UNSUPPORTED_IF_SET = {
    "logit_bias": lambda v: bool(v),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") not in (None, "text"),
    "n": lambda v: v not in (None, 1),
}


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise invalid(f"{where}: each content part must be an object with a 'type'", "messages")
            if part["type"] in ("text", "input_text", "output_text"):
                if not isinstance(part.get("text"), str):
                    raise invalid(f"{where}: a text part needs a string 'text'", "messages")
                out.append(part["text"])
            else:
                raise invalid(f"{where}: content parts of type {part['type']!r} are not supported by this "
                              f"text-only model", "messages")
        return "".join(out)
    raise invalid(f"{where}: 'content' must be a string or a list of content parts", "messages")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"{where}: 'tool_calls' must be a list", "messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}: each tool call needs a function with a name", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # templates expect a mapping, as transformers passes it
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        out.append({**c, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}: unknown role {role!r}; expected one of {sorted(ROLES)}", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": _text_of(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        for k in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out


def parse_tools(body) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) \
                or not isinstance(t["function"].get("name"), str):
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    return tools or None


def build_request(body, engine) -> tuple[Request, dict]:
    """Validate a chat completion body; returns the engine request and response metadata."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name, is_set in UNSUPPORTED_IF_SET.items():
        if name in body and is_set(body[name]):
            raise invalid(f"'{name}' is not supported yet by this server", name)
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body)
    if body.get("tool_choice") == "none":
        tools = None
    kwargs = get_dict(body, "chat_template_kwargs") or {}
    tok = engine.tokenizer
    try:
        prompt = tok.encode_chat(messages, tools=tools, add_generation_prompt=True, **kwargs)
    except (jinja2.TemplateError, TokenizerError) as e:
        raise invalid(f"the chat template rejected these messages: {e}", "messages") from None
    room = engine.max_context - len(prompt)
    if room < 1:
        raise invalid(f"the prompt has {len(prompt)} tokens, which fills this model's context of "
                      f"{engine.max_context} tokens; shorten the conversation", "messages")
    max_tokens = get_int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise invalid(f"this model's context is {engine.max_context} tokens; the prompt has {len(prompt)} "
                      f"tokens and max_tokens is {max_tokens}: lower max_tokens to at most {room}", "max_tokens")
    seed = get_int(body, "seed", None, -(2**63), 2**63 - 1)
    top_k = get_int(body, "top_k", 0, -1)          # vLLM extension; -1 and 0 both mean off
    top_p = get_number(body, "top_p", 1.0, 0.0, 1.0)
    logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", 0, 0, 20)
    if top_logprobs and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=get_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=max(top_p, 1e-9),                    # 0 keeps only the most likely token
        top_k=max(top_k, 0),
        seed=None if seed is None else seed % (2**31),
        stop=get_stop(body),
        ignore_eos=get_bool(body, "ignore_eos", False),
        min_p=get_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=get_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=get_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    stream = get_bool(body, "stream", False)
    opts = get_dict(body, "stream_options") or {}
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.get("model") if isinstance(body.get("model"), str) else engine.model_name,
        "stream": stream,
        "include_usage": bool(opts.get("include_usage")),
        "logprobs": logprobs,
    }
    return Request(prompt_ids=prompt, params=params), meta


def logprobs_content(tokenizer, entries) -> list[dict]:
    """Engine (id, logprob, alternatives) triples -> OpenAI's logprobs.content items."""
    def item(tid, lp):
        tok = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
    return [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in alts]} for t, lp, alts in entries]


def completion_body(meta, text: str, finish: str, prompt_tokens: int, completion_tokens: int,
                    logprobs: list | None = None) -> dict:
    return {
        "id": meta["id"], "object": "chat.completion", "created": meta["created"], "model": meta["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None if logprobs is None else {"content": logprobs},
                     "finish_reason": finish}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chunk(meta, delta: dict | None, finish: str | None = None, usage_: dict | None = None,
          logprobs: list | None = None) -> dict:
    body = {"id": meta["id"], "object": "chat.completion.chunk", "created": meta["created"],
            "model": meta["model"],
            "choices": [] if delta is None else [{"index": 0, "delta": delta,
                                                  "logprobs": None if logprobs is None else {"content": logprobs},
                                                  "finish_reason": finish}]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def engine_error(message: str) -> APIError:
    return APIError(message, 500, "server_error")
