"""Input as clients send it, odd or wrong: bodies of every protocol with each field replaced by
values of the wrong type, empty, huge, nested, unicode (lone surrogates too) or left out get an
answer below 500 in good time, and the server serves normally afterwards; images while vision is
off (a note in a tool's result, 400 vision_disabled elsewhere); Anthropic's thinking variants.
Against the scripted server (tests/scripted_server.py): the real parsing, templates and tokenizer,
no model."""
import copy
import json
import random
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_server

SCRIPT_SERVER = str(Path(__file__).with_name("scripted_server.py"))
TOOL = {"type": "object", "properties": {"a": {"type": "integer"}}}
SEEDS = [
    ("/v1/chat/completions", {
        "model": "m", "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "stop": ["x"], "n": 1, "seed": 3,
        "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.1,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": TOOL}}],
        "tool_choice": "auto", "response_format": {"type": "json_object"}, "reasoning_effort": "low",
        "stream": False, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {
        "model": "m", "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"oneOf": [TOOL, {"type": "object"}]}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "object", "properties": {"k": {"type": "string", "enum": ["a", "b"]}}, "required": ["k"]}}}}),
    ("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 8, "echo": False, "logprobs": 2, "stop": "x",
                         "temperature": 0.3, "n": 1, "suffix": None, "best_of": 1, "stream": False}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "echo": True,
                         "logprobs": 1, "seed": 1}),
    ("/v1/responses", {
        "model": "m", "instructions": "be brief", "max_output_tokens": 16, "store": False, "stream": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "reasoning": {"effort": "low", "summary": "auto"}, "text": {"format": {"type": "text"}}}),
    ("/v1/responses", {
        "model": "m", "max_output_tokens": 8, "temperature": 0.2, "top_p": 0.5,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "x"}]},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
                  {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}]}],
        "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g", "parameters": TOOL}]}],
        "tool_choice": {"type": "function", "name": "g"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}}),
    ("/v1/messages", {
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}], "stop_sequences": ["x"],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                                  {"type": "text", "text": "go"}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": TOOL}], "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive"}, "temperature": 0.5, "stream": False, "metadata": {"user_id": "u"}}),
    ("/v1/messages", {
        "model": "m", "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "x"}]}],
        "tools": [{"name": "f", "input_schema": TOOL}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 100, "display": "omitted"},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}}),
    ("/v1/chat/completions", {      # images in tool results: a note in the prompt
        "model": "m", "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": [
                {"type": "text", "text": "shot:"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}),
    ("/v1/responses", {
        "model": "m", "input": [{"role": "user", "content": "look"},
                                {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c", "output": [
                                    {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"}]}]}),
    ("/v1/messages", {
        "model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {"p": "a.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s",
                                   "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
]
GONE = object()          # the field left out
VALUES = [GONE, None, True, 0, -1, 2 ** 31, 2 ** 64, -2 ** 63, 1e308, 0.5, "", "\ud800", "\udfff x", "x" * 5000,
          "😀", "\u0000", "<|im_end|>", "</think>", [], {}, [[[[[]]]]], {"a": {"b": {}}}, ["a", 1, None],
          {"type": "text"}, {"type": None}, [{"type": "text", "text": None}], "none", "required"]


def paths(o, p=()):
    if p:
        yield p
    children = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
    for k, v in children:
        yield from paths(v, p + (k,))


def replaced(body, path, value):
    b = copy.deepcopy(body)
    parent = b
    for k in path[:-1]:
        parent = parent[k]
    if value is not GONE:
        parent[path[-1]] = copy.deepcopy(value)
    elif isinstance(parent, dict):
        del parent[path[-1]]
    else:
        return None
    return b


@pytest.fixture(scope="module")
def url(qwen3_tokenizer_dir, tmp_path_factory):
    yield from start_server(tmp_path_factory, str(qwen3_tokenizer_dir), cmd=(SCRIPT_SERVER,))


def post(client, url, path, body):
    """-> (status, seconds); the body is sent as Python's json writes it (lone surrogates as escapes),
    and a stream is read to its end."""
    t = time.monotonic()
    with client.stream("POST", url + path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}) as r:
        r.read()
    return r.status_code, time.monotonic() - t


def healthy(client, url):
    assert client.get(url + "/health").status_code == 200
    r = client.post(url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


@pytest.mark.extended          # (the quick suite's time is spent)
def test_a_lone_surrogate_is_served_replaced(url):
    """JSON allows an unpaired "\\ud800" (a client cutting between an emoji's halves): every protocol
    serves it with U+FFFD in its place, as the same text with U+FFFD would be."""
    with httpx.Client(timeout=60) as c:
        for text in ("hi \ud800 there", "\udfff", "a\ud83d"):
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                               ("/v1/completions", {"prompt": text, "max_tokens": 4}),
                               ("/v1/responses", {"input": text}),
                               ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": text}]})):
                r = c.post(url + path, content=json.dumps({"model": "m", **body}).encode(),
                           headers={"content-type": "application/json"})
                assert r.status_code == 200, (path, r.text)
        count = lambda t: c.post(url + "/v1/messages/count_tokens", content=json.dumps(  # noqa: E731
            {"model": "m", "messages": [{"role": "user", "content": t}]}).encode()).json()["input_tokens"]
        assert count("hi \ud800 there") == count("hi \ufffd there")
        healthy(c, url)


IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}


@pytest.mark.extended          # (the quick suite's time is spent)
def test_images_in_tool_results_become_a_note(url):
    """Vision is off (every model today): an image a tool returned (Claude Code reading an image
    file, Codex's view_image) is a short note in the prompt, in every protocol; an image anywhere
    else is a 400 with code vision_disabled."""
    from server.errors import IMAGE_NOTE
    with httpx.Client(timeout=60) as c:
        for path, body in [s for s in SEEDS if "look" in json.dumps(s[1])]:
            r = c.post(url + path, json=body)
            assert r.status_code == 200, (path, r.text)
        msgs = lambda block: [{"role": "user", "content": "look"}, {"role": "assistant", "content": [  # noqa: E731
            {"type": "tool_use", "id": "t", "name": "Read", "input": {}}]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [block]}]}]
        count = lambda block: c.post(url + "/v1/messages/count_tokens", json={  # noqa: E731
            "model": "m", "messages": msgs(block)}).json()["input_tokens"]
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
        assert count(image) == count({"type": "text", "text": IMAGE_NOTE})
        for path, body in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE_URL]}]}),
                ("/v1/responses", {"input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]})):
            r = c.post(url + path, json={"model": "m", **body})
            assert r.status_code == 400 and r.json()["error"]["code"] == "vision_disabled", r.text
        r = c.post(url + "/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]})
        assert r.status_code == 400 and "vision is disabled" in r.json()["error"]["message"]


@pytest.mark.extended          # (the quick suite's time is spent)
def test_anthropic_thinking_variants(url):
    """between_tools thinks only when the turn continues after tool results; display "updates" and
    effort (with thinking off too) are taken."""
    after_tool = [{"role": "user", "content": "go"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]}]
    plain = [{"role": "user", "content": "go"}]
    tools = [{"name": "f", "input_schema": {"type": "object"}}]

    def count(messages, **thinking):
        r = httpx.post(url + "/v1/messages/count_tokens", json={"model": "m", "messages": messages, "tools": tools,
                                                                 "thinking": thinking}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]
    on, off = count(after_tool, type="enabled", budget_tokens=64), count(after_tool, type="disabled")
    assert on != off                         # (Qwen3's template closes an empty think block when off)
    assert count(after_tool, type="between_tools") == on
    assert count(plain, type="between_tools") == count(plain, type="disabled") != count(plain, type="adaptive")
    for body in ({"thinking": {"type": "adaptive", "display": "updates"}},
                 {"thinking": {"type": "between_tools", "display": "omitted"}},
                 {"thinking": {"type": "disabled"}, "output_config": {"effort": "low"}}):
        r = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 8, "messages": after_tool,
                                                   "tools": tools, **body}, timeout=30)
        assert r.status_code == 200, (body, r.text)


@pytest.mark.extended           # (~30 s: some 10,000 requests)
def test_no_field_of_any_protocol_breaks_the_server(url):
    """Every field of each protocol's bodies (nested ones too) replaced by each value of VALUES, or
    left out, streamed and not; then bodies with two or three such changes at random: no answer
    is a 5xx, none takes 30 s, and the server serves normally afterwards."""
    bad, sent = [], 0
    rng = random.Random(0)

    def send(c, path, body):
        nonlocal sent
        for stream in ((False, True) if "stream" in body else (False,)):
            body["stream"] = stream
            status, took = post(c, url, path, body)
            sent += 1
            if status >= 500 or took > 30:
                bad.append((path, status, round(took, 1), json.dumps(body)[:300]))
    with httpx.Client(timeout=60) as c:
        for path, seed in SEEDS:
            for p in paths(seed):
                for v in VALUES:
                    body = replaced(seed, p, v)
                    if body is not None:
                        send(c, path, body)
            for _ in range(150):
                body = seed
                for _ in range(rng.randint(2, 3)):
                    body = replaced(body, rng.choice(list(paths(body)) or [("model",)]), rng.choice(VALUES[1:])) or body
                send(c, path, body)
        assert not bad, (len(bad), bad[:5])
        assert sent > 5000
        healthy(c, url)
