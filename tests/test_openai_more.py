"""Completions and Responses over loopback with the official openai SDK and httpx."""
import httpx
import numpy as np
import openai
import pytest

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_plain_stream_echo_logprobs(client):
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 6
    chunks = list(client.completions.create(model="m", prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    e = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  echo=True, logprobs=2)
    assert e.choices[0].text.startswith("The capital of France is")
    lp = e.choices[0].logprobs               # the prompt's tokens too: the first without a logprob (null)
    P = e.usage.prompt_tokens
    assert len(lp.tokens) == P + e.usage.completion_tokens and "".join(lp.tokens) == e.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    chunks = list(client.completions.create(model="m", prompt="The capital of France is", max_tokens=4,
                                            temperature=0, echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == e.choices[0].text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and np.allclose(streamed[1:], lp.token_logprobs[1:], atol=1e-4)


def test_completions_many_prompts_and_token_ids(client):
    ids = client.completions.create(model="m", prompt=[[504, 3575, 282], "Hello"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert ids.choices[0].text == ids.choices[1].text        # greedy: both choices of a prompt agree


def test_responses_plain_and_stream(client):
    r = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=24)
    assert r.status in ("completed", "incomplete") and "Paris" in r.output_text
    assert r.usage.input_tokens > 5 and r.usage.output_tokens > 0
    events = list(client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


def test_responses_codex_shaped_request(server_url):
    body = {"model": "test-model", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "client_metadata": {"session_id": "s"}, "max_output_tokens": 16,
            "tools": [{"type": "function", "name": "exec_command", "description": "run", "strict": False,
                       "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
                      {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
                          {"type": "function", "name": "spawn_agent", "description": "spawn", "strict": False,
                           "parameters": {"type": "object", "properties": {}}}]},
                      {"type": "web_search", "external_web_access": False}],
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
                      {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                      {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Done."}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
                      {"type": "message", "role": "user", "content": "Again."}]}
    with httpx.stream("POST", server_url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [ln[7:] for ln in r.iter_lines() if ln.startswith("event: ")]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")


def test_responses_websocket_upgrade_gets_426(server_url):
    r = httpx.get(server_url + "/v1/responses", timeout=30, headers={
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert r.status_code == 426 and "error" in r.json()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [[-1]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "logprobs": 9}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": [{"type": "message", "role": "boss", "content": "x"}]}, "input"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "rocket"}]}, "tools"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
])
def test_bad_requests(server_url, path, body, param):
    r = httpx.post(server_url + path, json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
