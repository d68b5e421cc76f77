"""POST /v1/chat/completions: body -> prompt, sampling parameters and parse features; turn pieces ->
a chat.completion or its chunk stream (role, content / reasoning_content / tool_calls deltas, one
finish chunk per choice, a usage chunk when asked, then [DONE])."""
from __future__ import annotations

import json
import time

import secrets

from infernix_jax.engine import SamplingParams

from .errors import IMAGE_NOTE, APIError, invalid, vision_disabled
from .parsing import ToolCall, tool_format_of
from .prompt import budget, render
from .structured import response_format_grammar, tool_call_grammar, validated
from .turn import Done, Features, features_for
from .validate import MAX_DEPTH, check_depth, get_bool, get_dict, get_int, get_number, get_stop

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 8
# Fields we cannot honour yet: refused when set, rather than silently ignored.
UNSUPPORTED_IF_SET = {
    "logit_bias": lambda v: bool(v),
}


def _text_of(content, where: str, tool: bool = False) -> str:
    """A message's text; images: IMAGE_NOTE in a tool message's content, else vision_disabled."""
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
            elif part["type"] in ("image_url", "input_image", "image"):
                if not tool:
                    raise vision_disabled(where, "messages")
                out.append(IMAGE_NOTE)
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
            except RecursionError:
                raise invalid(f"{where}: tool-call arguments are nested deeper than {MAX_DEPTH} levels",
                              "messages") from None
        check_depth(args, f"{where}: tool-call arguments", "messages")
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
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{where}: unknown role {role!r}; expected one of {sorted(ROLES)}", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": _text_of(m.get("content"), where,
                                                                                   role == "tool")}
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


def tool_choice(body, tools):
    """-> (tools to show the model, forced: None | "required" | a function name)."""
    tc = body.get("tool_choice")
    if tc is None or tc == "auto":
        return tools, None
    if tc == "none":
        return None, None
    if tc == "required":
        if not tools:
            raise invalid("tool_choice 'required' needs 'tools'", "tool_choice")
        return tools, "required"
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict):
        name = tc["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools or ()}:
            raise invalid(f"tool_choice names {name!r}, which is not one of the request's tools", "tool_choice")
        return tools, name
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}", "tool_choice")


def constraint(engine, fmt, fmt_param: str, tools, forced, template_kwargs: dict) -> str | None:
    """The grammar a response format or a forced tool call imposes (None: free text). A constrained
    reply starts at once, so thinking is switched off in the template for it."""
    if forced is not None:
        grammar = tool_call_grammar(tools, forced, tool_format_of(engine.tokenizer.chat_template or ""))
        param = "tool_choice"
    else:
        grammar, param = response_format_grammar(fmt, fmt_param), fmt_param
    if grammar is not None:
        template_kwargs["enable_thinking"] = False
    return validated(engine, grammar, param)


def sampling(body, max_tokens: int, grammar: str | None = None) -> SamplingParams:
    """The sampling fields Chat, Completions and Responses share; grammar: what the output must follow."""
    seed = get_int(body, "seed", None, -(2**63), 2**63 - 1)
    top_k = get_int(body, "top_k", 0, -1)          # vLLM extension; -1 and 0 both mean off
    top_p = get_number(body, "top_p", 1.0, 0.0, 1.0)
    logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", 0, 0, 20)
    if top_logprobs and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return SamplingParams(
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
        grammar=grammar,
    )


def requested_max_tokens(body) -> int | None:
    n = get_int(body, "max_completion_tokens", None, 1)
    return n if n is not None else get_int(body, "max_tokens", None, 1)


def seeds_for(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: each its own seed (seed, seed + 1, ...) so that a seeded request stays reproducible."""
    import dataclasses
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=None if params.seed is None else (params.seed + i) % (2**31))
            for i in range(n)]


def build(body, engine, tolerant: bool = False) -> tuple[list[int], list[SamplingParams], Features, dict]:
    """Validate a chat completion body -> prompt ids, one SamplingParams per choice, parse features, meta."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name, is_set in UNSUPPORTED_IF_SET.items():
        if name in body and is_set(body[name]):
            raise invalid(f"'{name}' is not supported yet by this server", name)
    messages = parse_messages(body.get("messages"))
    tools, forced = tool_choice(body, parse_tools(body))
    kwargs = dict(get_dict(body, "chat_template_kwargs") or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
            raise invalid("'reasoning_effort' must be none, minimal, low, medium, high or xhigh", "reasoning_effort")
        kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
    grammar = constraint(engine, body.get("response_format"), "response_format", tools, forced, kwargs)
    ids, text = render(engine, messages, tools, kwargs)
    n = get_int(body, "n", 1, 1, MAX_N)
    params = sampling(body, budget(engine, len(ids), requested_max_tokens(body)), grammar)
    stream = get_bool(body, "stream", False)
    opts = get_dict(body, "stream_options") or {}
    meta = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": body.get("model") if isinstance(body.get("model"), str) else engine.model_name,
        "stream": stream,
        "include_usage": bool(opts.get("include_usage")),
        "logprobs": params.logprobs,
        "forced_tool": forced,
    }
    parallel = get_bool(body, "parallel_tool_calls", True)
    return ids, seeds_for(params, n), features_for(engine.tokenizer, text, tools, tolerant, parallel), meta


def logprobs_content(tokenizer, entries) -> list[dict]:
    """Engine (id, logprob, alternatives) triples -> OpenAI's logprobs.content items."""
    def item(tid, lp):
        tok = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
    return [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in alts]} for t, lp, alts in entries]


def tool_call_item(call: ToolCall, index: int | None = None) -> dict:
    item = {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return item if index is None else {"index": index, **item}


def usage(p: int, c: int, cached: int = 0) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_body(meta, results: list[tuple[str, str, list, list, Done]], tokenizer) -> dict:
    choices = []
    for i, (reasoning, text, calls, lps, done) in enumerate(results):
        msg = {"role": "assistant", "content": text if (text or not calls) else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [tool_call_item(c) for c in calls]
        choices.append({"index": i, "message": msg, "finish_reason": done.finish_reason,
                        "logprobs": {"content": logprobs_content(tokenizer, lps)} if meta["logprobs"] else None})
    return {"id": meta["id"], "object": "chat.completion", "created": meta["created"], "model": meta["model"],
            "choices": choices, "usage": usage(results[0][4].prompt_tokens,
                                               sum(r[4].completion_tokens for r in results),
                                               min(r[4].cached_tokens for r in results))}


def stream_end(meta: dict, obj: str, done: list, prompt_tokens: int, n: int | None = None) -> list[str]:
    """The end of an OpenAI chunk stream: a usage chunk when stream_options.include_usage asked for
    one (once every choice is done), then [DONE]. With n, choices come n per prompt (Completions with
    several prompts): cached tokens are summed over prompts; else all choices share one prompt."""
    out = []
    if meta["include_usage"] and all(done):
        cached = sum(min(d.cached_tokens for d in done[i:i + n]) for i in range(0, len(done), n)) if n \
            else min(d.cached_tokens for d in done)
        body = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"], "choices": [],
                "usage": usage(prompt_tokens, sum(d.completion_tokens for d in done), cached)}
        out.append("data: " + json.dumps(body) + "\n\n")
    return out + ["data: [DONE]\n\n"]


class StreamRenderer:
    def __init__(self, meta: dict, n: int, tokenizer):
        self.meta, self.n, self.tokenizer = meta, n, tokenizer
        self.calls = [0] * n
        self.done: list[Done | None] = [None] * n

    def _chunk(self, i, delta, finish=None, logprobs=None) -> str:
        return "data: " + json.dumps({
            "id": self.meta["id"], "object": "chat.completion.chunk", "created": self.meta["created"],
            "model": self.meta["model"], "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                                      "logprobs": None if logprobs is None else {"content": logprobs}}]},
            ensure_ascii=False) + "\n\n"

    def start(self) -> list[str]:
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    @staticmethod
    def heartbeat() -> str:
        return ": keep-alive\n\n"

    def pieces(self, i: int, pieces: list) -> list[str]:
        out = []
        k = 0
        while k < len(pieces):
            kind, v = pieces[k]
            if kind == "text" or kind == "logprobs":
                lps = None
                if kind == "text" and k + 1 < len(pieces) and pieces[k + 1][0] == "logprobs":
                    lps, k = pieces[k + 1][1], k + 1
                elif kind == "logprobs":
                    lps, v = v, ""
                content = logprobs_content(self.tokenizer, lps) if (lps and self.meta["logprobs"]) else None
                if v or content:
                    out.append(self._chunk(i, {"content": v}, logprobs=content))
            elif kind == "reasoning":
                out.append(self._chunk(i, {"reasoning_content": v}))
            elif kind == "tool_call":
                out.append(self._chunk(i, {"tool_calls": [tool_call_item(v, self.calls[i])]}))
                self.calls[i] += 1
            elif kind == "done":
                self.done[i] = v
                if v.finish_reason == "error":
                    out.append("data: " + json.dumps(APIError(v.error, 500, "server_error").body()) + "\n\n")
                else:
                    out.append(self._chunk(i, {}, v.finish_reason))
            k += 1
        return out

    def end(self) -> list[str]:
        return stream_end(self.meta, "chat.completion.chunk", self.done,
                          self.done[0].prompt_tokens if all(self.done) else 0)
