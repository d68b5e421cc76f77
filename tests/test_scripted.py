"""Tool-call and reasoning parsing through the whole server, with an engine that replays chosen
output (tests/scripted_server.py): both tool-call formats, cut at every point across stream deltas,
rendered by every protocol with the official SDKs."""
import json
from pathlib import Path

import anthropic
import openai
import pytest

from conftest import requests_total, start_server

SCRIPT_SERVER = str(Path(__file__).with_name("scripted_server.py"))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
JSON_CALLS = ('<think>\nThe user wants weather.\n</think>\n\nChecking.<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Rome"}}\n</tool_call>')
XML_CALLS = ('<think>\nThe user wants weather.\n</think>\n\nChecking.<tool_call>\n<function=get_weather>\n'
             '<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n'
             '<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>')
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]


@pytest.fixture(scope="module", params=["json", "xml"])
def scripted(request, qwen3_tokenizer_dir, tmp_path_factory):
    extra = ("--xml",) if request.param == "xml" else ()
    for url in start_server(tmp_path_factory, str(qwen3_tokenizer_dir), *extra, cmd=(SCRIPT_SERVER,)):
        yield url, JSON_CALLS if request.param == "json" else XML_CALLS


def ask(script: dict) -> list[dict]:
    return [{"role": "user", "content": "SCRIPT:" + json.dumps(script)}]


def chat_stream(client, script, **kw):
    chunks = list(client.chat.completions.create(model="m", messages=ask(script), tools=TOOLS, stream=True, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [(tc.function.name, json.loads(tc.function.arguments))
             for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return reasoning, text, calls, finish


def test_tool_calls_cut_everywhere(scripted):
    url, text = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for script in [{"text": text, "chars": True}, *({"text": text, "cuts": [k]} for k in range(len(text) + 1))]:
        reasoning, content, calls, finish = chat_stream(client, script)
        assert reasoning == "\nThe user wants weather.\n" and content == "Checking.", script
        assert calls == EXPECTED and finish == ["tool_calls"], script


def test_every_protocol_renders_the_calls(scripted):
    url, text = scripted
    script = {"text": text, "cuts": [5, 40, 41, 90]}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=ask(script), tools=TOOLS)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
    assert m.reasoning_content == "\nThe user wants weather.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == EXPECTED
    rs = client.responses.create(model="m", input=ask(script), tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}])
    kinds = [it.type for it in rs.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert [(it.name, json.loads(it.arguments)) for it in rs.output if it.type == "function_call"] == EXPECTED
    events = list(client.responses.create(model="m", input=ask(script), stream=True, tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]))
    assert [it.type for it in events[-1].response.output] == kinds
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    for stream in (False, True):
        if stream:
            with claude.messages.stream(model="m", max_tokens=100, messages=ask(script), tools=[tool]) as s:
                msg = s.get_final_message()
        else:
            msg = claude.messages.create(model="m", max_tokens=100, messages=ask(script), tools=[tool])
        assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert msg.content[0].thinking == "\nThe user wants weather.\n" and msg.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in msg.content[2:]] == EXPECTED
        hidden = dict(model="m", max_tokens=100, messages=ask(script), tools=[tool],
                      thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
        if stream:
            with claude.messages.stream(**hidden) as s:
                events = list(s)
                msg = s.get_final_message()
            assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        else:
            msg = claude.messages.create(**hidden)
        assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]    # the block stays,
        assert msg.content[0].thinking == ""                                                  # its text does not


@pytest.mark.extended
def test_root_one_of_parameters_are_typed(scripted):
    """A tool whose parameters are a root oneOf: each argument is typed by the branch that names it,
    in both formats ("123" for a string stays a string, 2 for an integer is one), and a forced or
    required call of it is taken (its grammar compiles)."""
    url, calls_text = scripted
    params = {"oneOf": [{"type": "object", "properties": {"ref": {"type": "string"}}, "required": ["ref"]},
                        {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}]}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    xml = "<tool_call>\n<function=pick>\n<parameter=ref>\n123\n</parameter>\n</function>\n</tool_call>"
    js = '<tool_call>\n{"name": "pick", "arguments": {"ref": "123"}}\n</tool_call>'
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    text = xml if "<function=" in calls_text else js
    for choice in ("auto", "required", {"type": "function", "function": {"name": "pick"}}):
        r = client.chat.completions.create(model="m", messages=ask({"text": text}), tools=tools, tool_choice=choice)
        assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"ref": "123"}]


@pytest.mark.extended
def test_responses_cut_by_max_output_tokens_mark_the_message_incomplete(scripted):
    url, _ = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for finish, want in (("length", "incomplete"), ("stop", "completed")):
        script = {"text": "Half a sent", "cuts": [4], "finish": finish}
        r = client.responses.create(model="m", input=ask(script))
        assert r.status == want and r.output[-1].status == want and r.output_text == "Half a sent"
        events = list(client.responses.create(model="m", input=ask(script), stream=True))
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [i.status for i in done] == [want] and done[0].content[0].text == "Half a sent"
        assert events[-1].type == f"response.{want}" and events[-1].response.output[-1].status == want


def test_parallel_tool_calls_false_ends_at_the_first_call(scripted):
    """parallel_tool_calls false (Anthropic: disable_parallel_tool_use): one call, finish reason
    tool_calls, and generation stops there (the script's later characters are never produced)."""
    url, text = scripted
    script = {"text": text + "\nAnd some words after the calls.", "chars": True, "delay": 0.005}
    n_chars = len(script["text"])
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=ask(script), tools=TOOLS, parallel_tool_calls=False)
    m = r.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == EXPECTED[:1]
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < n_chars - 20
    reasoning, content, calls, finish = chat_stream(client, script, parallel_tool_calls=False)
    assert calls == EXPECTED[:1] and finish == ["tool_calls"] and content == "Checking."
    rs = client.responses.create(model="m", input=ask(script), parallel_tool_calls=False, tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}])
    assert [it.type for it in rs.output] == ["reasoning", "message", "function_call"]
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    msg = claude.messages.create(model="m", max_tokens=100, messages=ask(script), tools=[tool],
                                 tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == EXPECTED[:1]
    assert msg.stop_reason == "tool_use"
    r = client.chat.completions.create(model="m", messages=ask(script), tools=TOOLS)       # default: all calls
    assert len(r.choices[0].message.tool_calls) == 2
    r = client.chat.completions.create(model="m", messages=ask(script), tools=TOOLS, tool_choice="none")
    assert not r.choices[0].message.tool_calls and "<tool_call>" in r.choices[0].message.content   # no parsing
    assert r.choices[0].finish_reason == "stop"


def test_cut_off_call_and_literal_tag(scripted):
    url, text = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    cut = text[:text.index("Rome")]
    r = client.chat.completions.create(model="m", messages=ask({"text": cut, "finish": "length"}), tools=TOOLS)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    # json: the first call closed before the cut; xml: both functions sit in the one unclosed <tool_call>
    closed = EXPECTED[:1] if text == JSON_CALLS else []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []] == closed
    assert m.content.startswith("Checking.") and "<tool_call>" in m.content     # the cut call stays text
    prose = "Use a <tool_call> tag to call tools. That is all."
    reasoning, content, calls, finish = chat_stream(client, {"text": prose, "chars": True})
    assert content == prose and calls == [] and finish == ["stop"]


def test_tolerant_tool_calls_keep_a_cut_call(qwen3_tokenizer_dir, tmp_path_factory):
    cut = JSON_CALLS[:JSON_CALLS.index("Rome") + 2]
    for url in start_server(tmp_path_factory, str(qwen3_tokenizer_dir), "--tolerant", cmd=(SCRIPT_SERVER,)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="m", messages=ask({"text": cut, "finish": "length"}), tools=TOOLS)
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
        assert calls == [EXPECTED[0], ("get_weather", {"city": "Ro"})]
        assert r.choices[0].message.content == "Checking."
        r = client.chat.completions.create(model="m", messages=ask({"text": cut, "finish": "abort"}), tools=TOOLS)
        assert len(r.choices[0].message.tool_calls) == 2          # (a cancellation: kept too)
        # only max_tokens / the context / a cancellation make a cut call worth keeping: not a stop token or string
        r = client.chat.completions.create(model="m", messages=ask({"text": cut, "finish": "stop"}), tools=TOOLS)
        assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].message.content.endswith('"Ro')


def test_heartbeats_during_a_long_prefill(scripted):
    """No bytes before the first token unless the wait passes the heartbeat interval (0.3 s on this
    server); then each protocol's own heartbeat keeps the stream alive until the first token."""
    import time

    import httpx
    url, _ = scripted
    cases = [("/v1/chat/completions", {"messages": None}, ": keep-alive"),
             ("/v1/messages", {"messages": None, "max_tokens": 10}, "event: ping"),
             ("/v1/responses", {"input": None}, ": keep-alive")]
    for path, template, beat in cases:
        for delay, expect_beats in ((0.0, False), (1.2, True)):
            msgs = ask({"text": "Hello there.", "first_delay": delay})
            body = {k: (msgs if v is None else v) for k, v in template.items()}
            t0 = time.time()
            with httpx.stream("POST", url + path, json={"model": "m", "stream": True, **body}, timeout=60) as r:
                lines = list(r.iter_lines())
            assert r.status_code == 200 and time.time() - t0 >= delay
            first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data:"))
            beats = [i for i, ln in enumerate(lines) if ln.startswith(beat)]
            assert bool(beats) == expect_beats, (path, delay, lines[:6])
            if beats and beat.startswith(":"):
                assert beats[0] < first_data          # comments go out alone: the first event is real output


@pytest.fixture(scope="module")
def strict(qwen3_tokenizer_dir, tmp_path_factory):
    """A scripted server with a 2 s paused-reader limit, room for one HTTP request at a time, and
    --end-in-thinking allow."""
    yield from start_server(tmp_path_factory, str(qwen3_tokenizer_dir), "--paused-reader-s", "2",
                            "--max-http-clients", "1", "--end-in-thinking", "allow", cmd=(SCRIPT_SERVER,))


def _count(url, status):
    return requests_total(url, "chat.completions", status)


def test_paused_reader_is_cancelled(strict):
    """A client that stops reading keeps its request for the server's paused-reader time (2 s on this
    server, 60 s by default); then the request is cancelled (499 in /metrics) and its connection
    closed. A client reading the same long stream steadily is served to the end."""
    import socket
    import time

    import httpx
    url = strict
    long_reply = {"text": "word " * 400, "cuts": list(range(200, 2000, 200)), "repeat": 3000}   # ~6 MB of SSE
    body = {"model": "m", "stream": True, "messages": ask(long_reply)}
    ok0, gone0 = _count(url, 200), _count(url, 499)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        read = sum(len(b) for b in r.iter_bytes())          # a steady reader gets all of it
    assert read > 5_000_000 and _count(url, 200) == ok0 + 1
    small = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    with httpx.Client(transport=small, timeout=120) as c, c.stream("POST", url + "/v1/chat/completions",
                                                                  json=body) as r:
        chunks = r.iter_bytes()            # kept: a dropped iterator would close the response
        assert next(chunks)
        t0 = time.time()
        while _count(url, 499) == gone0 and time.time() - t0 < 60:    # the client reads nothing now
            time.sleep(0.25)
        waited = time.time() - t0
        assert _count(url, 499) == gone0 + 1 and 2 <= waited < 30, waited
    assert _count(url, 200) == ok0 + 1 and httpx.get(url + "/health", timeout=30).status_code == 200


def test_max_http_clients_answers_503(strict):
    """--max-http-clients is the ceiling of open connections. With 1 and one stream open, a request on
    a second connection gets 503 with Retry-After in the protocol's error shape, and that connection
    is closed; once the stream ends, requests are served again. An idle keep-alive connection counts
    too, until its client closes it."""
    import threading

    import httpx
    url = strict
    opened = threading.Event()

    def slow():
        body = {"model": "m", "stream": True, "messages": ask({"text": "x" * 40, "chars": True, "delay": 0.1})}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                opened.set()
    t = threading.Thread(target=slow)
    t.start()
    assert opened.wait(30)
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": ask({"text": "hi"})}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "overloaded_error"
    assert r.headers["connection"] == "close"
    r = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": ask({"text": "hi"})},
                   timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    assert httpx.get(url + "/health", timeout=30).status_code == 200           # not an API request
    t.join(60)
    chat = {"model": "m", "messages": ask({"text": "hi"})}
    with httpx.Client(timeout=30) as idle:
        r = idle.post(url + "/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 503
        assert idle.post(url + "/v1/chat/completions", json=chat).status_code == 200      # (its own: served)
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200


@pytest.mark.extended           # (~15 s: waits out the grace)
def test_idle_connections_outlive_the_advertised_keep_alive_by_10_s(qwen3_tokenizer_dir, tmp_path_factory):
    """Keep-Alive: timeout=S is advertised; the server closes an idle connection 10 s after S, so a
    client trusting the header never sends on a socket being closed."""
    import http.client
    import time
    for url in start_server(tmp_path_factory, str(qwen3_tokenizer_dir), "--keep-alive-s", "1", cmd=(SCRIPT_SERVER,)):
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=30)
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.getheader("keep-alive") == "timeout=1"
        time.sleep(4)                                  # past the advertised 1 s: still served
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        t0 = time.monotonic()
        assert conn.sock.recv(1) == b""                # then closed, after 1 + 10 s idle
        assert 10 <= time.monotonic() - t0 < 20


def test_end_in_thinking_reaches_the_engine(scripted, strict):
    """refuse (the default) asks the engine to keep a thinking reply from ending or opening a tool call
    inside <think> (the sampler's ThinkGuard, tested in test_engine); allow does not."""
    for url, expect in ((scripted[0], "True"), (strict, "False")):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:     # (strict: 1 connection)
            r = client.chat.completions.create(model="m", messages=ask({"text": "", "echo_think_guard": True}))
        assert r.choices[0].message.content == f"think_guard={expect}"
