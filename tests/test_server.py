"""The server over loopback with the official openai SDK and httpx."""
import concurrent.futures as cf

import httpx
import openai
import pytest

from conftest import requests_total

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_health_and_models(server_url, client):
    assert httpx.get(server_url + "/health").json()["status"] == "ok"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2-135m-instruct"]


def test_chat_completion_greedy(client):
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0)
    c = r.choices[0]
    assert "Paris" in c.message.content and c.message.role == "assistant"
    assert c.finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_max_tokens_and_stop(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content.startswith("The capital")


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "Write a short poem."}], temperature=1.0,
              max_tokens=16, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    c = client.chat.completions.create(**{**kw, "seed": 99}).choices[0].message.content
    assert a == b and a != c


def test_concurrent_requests_all_answered(client):
    def ask(i):
        return client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=12)
    with cf.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(ask, range(4)))
    assert len({o.choices[0].message.content for o in outs}) == 1


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": QUESTION, "temperature": "hot"}, "temperature"),
    ({"messages": QUESTION, "temperature": 5}, "temperature"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": QUESTION, "n": 9}, "n"),
    ({"messages": QUESTION, "tool_choice": "required"}, "tool_choice"),
    ({"messages": QUESTION, "reasoning_effort": "max"}, "reasoning_effort"),
    ({"messages": QUESTION, "stop": [""]}, "stop"),
    ({"messages": QUESTION, "stream": "yes"}, "stream"),
    ({"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": QUESTION, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),          # past the 8K context
    ({"messages": QUESTION, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": QUESTION, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_bodies_get_400_json(server_url, body, param):
    r = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_json_and_unknown_paths(server_url):
    r = httpx.post(server_url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server_url + "/v1/chat/completions", json=[1, 2], timeout=30)
    assert r.status_code == 400
    r = httpx.get(server_url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server_url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


def test_logprobs_and_penalties(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token   # greedy: the chosen token is the best one
    assert "".join(i.token for i in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=6,
                                                 logprobs=True, stream=True))
    streamed = [i for ch in chunks if ch.choices and ch.choices[0].logprobs for i in ch.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    r2 = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=6,
                                        frequency_penalty=1.0, presence_penalty=0.5)
    assert r2.choices[0].message.content


def test_sdk_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="between 0"):
        client.chat.completions.create(model="m", messages=QUESTION, top_p=3)


def test_unknown_model_is_404_in_each_protocol(server_url, client):
    import anthropic
    with pytest.raises(openai.NotFoundError, match="gpt-9") as e:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "smollm2-135m-instruct" in e.value.message
    ac = anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="claude-9", max_tokens=2, messages=QUESTION)
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.count_tokens(model="claude-9", messages=QUESTION)
    r = httpx.post(server_url + "/v1/responses", json={"model": "gpt-9", "input": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server_url + "/v1/completions", json={"model": 7, "prompt": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    for name in ("m", "smollm2-135m-instruct"):              # the served names, and none at all
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).choices
    r = httpx.post(server_url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200


def test_query_string_and_developer_role_and_parts(server_url):
    body = {"model": "m", "temperature": 0, "max_tokens": 8, "messages": [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]}
    r = httpx.post(server_url + "/v1/chat/completions?beta=true", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_client_disconnect_mid_stream_leaves_server_healthy(server_url, client):
    with httpx.stream("POST", server_url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": QUESTION, "stream": True, "max_tokens": 4000, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '""' not in line:
                break  # walk away mid-stream
    _wait_idle(server_url, 20)        # cancelled: 4000 tokens would take minutes on the CPU
    out = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=8)
    assert out.choices[0].message.content


def _status_count(server_url, status: int) -> float:
    return requests_total(server_url, "chat.completions", status)


def _wait_idle(server_url, seconds: float) -> dict:
    """/health once nothing runs or waits and every KV block is free (or at the deadline)."""
    import time
    deadline = time.time() + seconds
    while True:
        h = httpx.get(server_url + "/health", timeout=30).json()
        if (h["running"] == 0 and h["waiting"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"]) \
                or time.time() > deadline:
            assert h["status"] == "ok" and h["running"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"], h
            return h
        time.sleep(0.25)


def test_n_choices_and_usage(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0.8, max_tokens=8, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(1 for _ in range(3)) * 0 + r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, temperature=0.8, max_tokens=8,
                                                 n=3, seed=5, stream=True, stream_options={"include_usage": True}))
    for i in range(3):
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        assert text == r.choices[i].message.content       # same seeds, same texts, streamed or not
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_metrics_endpoint_and_keep_alive(server_url, client):
    client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=4)
    r = httpx.get(server_url + "/metrics", timeout=30)
    assert r.status_code == 200
    text = r.text
    for name in ("infernix_requests_total", "infernix_generation_tokens_total", "infernix_queue_depth",
                 "infernix_time_to_first_token_seconds_bucket", "infernix_inter_token_latency_seconds_bucket",
                 "infernix_kv_usage_ratio", 'infernix_spec_rounds{method="ngram"}',
                 'infernix_spec_accepted_tokens{method="tree"}'):
        assert name in text, name
    assert 'infernix_requests_total{endpoint="chat.completions",status="200"}' in text
    assert httpx.get(server_url + "/health", timeout=30).headers.get("keep-alive") == "timeout=360"


def test_deep_nesting_is_refused(server_url):
    deep = {"a": 1}
    for _ in range(300):
        deep = {"x": deep}
    r = httpx.post(server_url + "/v1/chat/completions", timeout=30, json={"messages": QUESTION, "metadata": deep})
    assert r.status_code == 400 and "deeper than 256" in r.json()["error"]["message"]
    args = "[" * 300 + "]" * 300
    r = httpx.post(server_url + "/v1/chat/completions", timeout=30, json={"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]})
    assert r.status_code == 400 and "deeper than 256" in r.json()["error"]["message"]
    r = httpx.post(server_url + "/v1/chat/completions", timeout=30, content=b"[" * 5000 + b"]" * 5000)
    assert r.status_code == 400


@pytest.mark.extended
def test_32_streams_8_walk_away_all_blocks_come_back(server_url):
    """32 concurrent streaming clients, 8 of which disconnect mid-way: the other 24 complete, the 8 are
    cancelled (499; they asked for 4000 tokens each, minutes of work had they run on), and afterwards
    every KV block is free and the server is healthy."""
    left_before = _status_count(server_url, 499)

    def one(i):
        body = {"model": "m", "messages": [{"role": "user", "content": f"Count to {i + 5}."}], "stream": True,
                "max_tokens": 4000 if i % 4 == 0 else 24, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, timeout=300) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    n += 1
                    if i % 4 == 0 and n == 3:
                        return "left"
                if line == "data: [DONE]":
                    return "done"
        return "cut"
    with cf.ThreadPoolExecutor(32) as ex:
        outcomes = list(ex.map(one, range(32)))
    assert outcomes.count("left") == 8 and outcomes.count("done") == 24
    _wait_idle(server_url, 30)
    assert _status_count(server_url, 499) - left_before == 8
