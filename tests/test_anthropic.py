"""Anthropic Messages over loopback with the official anthropic SDK (and raw httpx for what the SDK
hides): plain and streamed replies, system prompts in every form, stop sequences, count_tokens,
thinking settings, tool blocks in history, and errors in Anthropic's own shape."""
import anthropic
import httpx
import pytest

ASK = [{"role": "user", "content": "What is the capital of France?"}]
T0 = {"temperature": 0}   # the SDK no longer has a temperature argument; the API still takes it


@pytest.fixture(scope="module")
def claude(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=300)


def test_message_plain(claude):
    m = claude.messages.create(model="test-model", max_tokens=32, messages=ASK, extra_body=T0)
    assert m.type == "message" and m.role == "assistant" and m.model == "test-model"
    assert m.content[0].type == "text" and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10 and 0 < m.usage.output_tokens <= 32


def test_stream_events_and_text_equal_plain(claude):
    plain = claude.messages.create(model="m", max_tokens=24, messages=ASK, extra_body=T0)
    with claude.messages.stream(model="m", max_tokens=24, messages=ASK, extra_body=T0) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_event_order(server_url):
    body = {"model": "m", "max_tokens": 8, "messages": ASK, "temperature": 0, "stream": True}
    with httpx.stream("POST", server_url + "/v1/messages?beta=true", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [ln[len("event: "):] for ln in r.iter_lines() if ln.startswith("event: ")]
    events = [e for e in events if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_system_forms_billing_line_and_system_role_in_messages(claude, server_url):
    base = claude.messages.create(model="m", max_tokens=12, extra_body=T0, system="Answer in one word.", messages=ASK)
    blocks = claude.messages.create(model="m", max_tokens=12, extra_body=T0, messages=ASK, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3.abc; cc_entrypoint=cli;"},
        {"type": "text", "text": "Answer in one word.", "cache_control": {"type": "ephemeral"}}])
    assert blocks.content[0].text == base.content[0].text          # the billing line changes nothing
    n1 = claude.messages.count_tokens(model="m", system="Answer in one word.", messages=ASK).input_tokens
    n2 = claude.messages.count_tokens(model="m", messages=ASK, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9.fff;"},
        {"type": "text", "text": "Answer in one word."}]).input_tokens
    assert n1 == n2 == base.usage.input_tokens + base.usage.cache_read_input_tokens
    # Claude Code puts system entries inside messages, with string or block content
    r = httpx.post(server_url + "/v1/messages", timeout=120, json={"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Say hello."}]},
        {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "system", "content": "Still brief."},
        {"role": "user", "content": "Again."}]})
    assert r.status_code == 200, r.text


def test_stop_sequences_and_max_tokens(claude):
    m = claude.messages.create(model="m", max_tokens=64, extra_body=T0, messages=ASK, stop_sequences=["Paris"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris" and "Paris" not in m.content[0].text
    m = claude.messages.create(model="m", max_tokens=2, extra_body=T0, messages=ASK)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    # agents ask for far more than the context holds: capped, not refused
    m = claude.messages.create(model="m", max_tokens=128000, extra_body=T0, messages=ASK)
    assert m.stop_reason == "end_turn"


def test_claude_code_fields_and_tool_history(claude, server_url):
    body = {"model": "test-model", "max_tokens": 48, "stream": False,
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": '{"device_id":"abc","session_id":"s"}'},
            "tools": [{"name": "Read", "description": "Read a file", "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                "properties": {"path": {"type": "string"}}, "required": ["path"]}},
                {"name": "Later", "description": "deferred", "input_schema": {"type": "object"}, "defer_loading": True}],
            "messages": [
                {"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.txt"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "hello"}]},
                    {"type": "text", "text": "What does it say?"}]}]}
    r = httpx.post(server_url + "/v1/messages?beta=true", json=body, timeout=300,
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_reason"] in ("end_turn", "tool_use", "max_tokens") and out["content"]
    for thinking in ("enabled", "disabled"):
        extra = {"budget_tokens": 1024} if thinking == "enabled" else {}
        m = claude.messages.create(model="m", max_tokens=8, messages=ASK, thinking={"type": thinking, **extra},
                                   extra_body={"output_config": {"effort": "low"}})   # effort without thinking too
        assert m.content


@pytest.mark.parametrize("body,needle", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 8}, "messages"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}, "content"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 8, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 8, "messages": ASK, "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"name": "t", "input_schema": 3}]}, "input_schema"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"name": "t"}]}, "input_schema"),          # (Anthropic: 400 too)
    ({"max_tokens": 8, "messages": ASK, "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"max_tokens": 8, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "display": "loud"}}, "thinking.display"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "word " * 9000}]}, "context"),
])
def test_bad_requests_in_anthropic_shape(server_url, body, needle):
    r = httpx.post(server_url + "/v1/messages", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert needle in j["error"]["message"]


def test_sdk_error_types(claude, server_url):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="m", max_tokens=8, messages=ASK, extra_body={"top_p": 7})
    r = httpx.post(server_url + "/v1/messages", content=b"{oops", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(server_url + "/v1/messages/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
