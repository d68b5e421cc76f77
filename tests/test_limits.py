"""Server limits on a second server started with them: API key, body size, pending requests, the
JSON-lines request log, and sampling defaults with a reply cap (--override-generation-config)."""
import json
import threading
import time

import httpx
import openai
import pytest

from conftest import SERVED_NAMES, start_server

KEY = "sk-test-123"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def limited(smollm, tmp_path_factory):
    log = tmp_path_factory.mktemp("reqlog") / "requests.jsonl"
    for url in start_server(tmp_path_factory, "--max-batch", "2", "--api-key", KEY, "--max-body-mb", "0.05", *SERVED_NAMES,
                            "--max-pending-requests", "1", "--log-requests", str(log), "--speculative", "ngram",
                            "--override-generation-config", '{"temperature": 0, "max_new_tokens": 200}'):
        yield url, log


def test_api_key(limited):
    url, _ = limited
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages", json={"messages": ASK, "max_tokens": 2}, timeout=60,
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert httpx.get(url + "/health", timeout=30).status_code == 200          # open without a key
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model="m", messages=ASK, max_tokens=2).choices[0].message.content is not None
    r = httpx.post(url + "/v1/messages", json={"model": "m", "messages": ASK, "max_tokens": 2}, timeout=60,
                   headers={"x-api-key": KEY})
    assert r.status_code == 200


def test_body_too_large(limited):
    url, _ = limited
    big = [{"role": "user", "content": "x" * 100_000}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": big}, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "error" in r.json()


def test_pending_limit_and_request_log(limited):
    url, log = limited
    h = {"Authorization": f"Bearer {KEY}"}
    started = threading.Event()

    def long_stream():
        with httpx.stream("POST", url + "/v1/chat/completions", headers=h, timeout=120, json={
                "messages": ASK, "stream": True, "max_tokens": 150, "ignore_eos": True}) as r:
            for _ in r.iter_lines():
                started.set()
    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    r = httpx.post(url + "/v1/chat/completions", headers=h, json={"messages": ASK, "max_tokens": 2}, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
    t.join(120)
    deadline = time.time() + 30           # the first request's slot comes back when it finishes
    while time.time() < deadline:
        r = httpx.post(url + "/v1/chat/completions", headers=h, json={"messages": ASK, "max_tokens": 2}, timeout=60)
        if r.status_code == 200:
            break
        time.sleep(0.5)
    assert r.status_code == 200
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    ok = [ln for ln in lines if ln["status"] == 200 and ln["endpoint"] == "chat.completions"]
    assert any(ln["stream"] and ln["completion_tokens"] == 150 and ln["ttft_s"] is not None for ln in ok)
    # (--speculative ngram: 150 tokens of a small model repeat some pair of tokens; the log counts the rounds)
    spec = [ln["speculative"]["ngram"] for ln in ok if ln["completion_tokens"] == 150]
    assert spec and spec[0]["rounds"] > 0 and 0 <= spec[0]["accepted"] <= spec[0]["drafted"]
    assert any(ln["status"] == 429 for ln in lines)
    assert any(ln["status"] == 401 and ln["endpoint"] == "chat.completions" for ln in lines)   # refused early,
    assert any(ln["status"] == 413 for ln in lines)                                           # logged too
    assert all({"duration_s", "prompt_tokens", "finish_reasons", "cached_tokens"} <= set(ln) for ln in lines)


def test_generation_config_override(limited):
    """temperature 0 by default (two unseeded requests agree, and with an explicit 0); an explicit
    temperature still samples; max_new_tokens caps what a request asks for."""
    url, _ = limited
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "Write a long story about a dragon."}]
    texts = [c.chat.completions.create(model="m", messages=ask, max_tokens=24, **kw).choices[0].message.content
             for kw in ({}, {}, {"temperature": 0})]
    assert texts[0] == texts[1] == texts[2]
    hot = {c.chat.completions.create(model="m", messages=ask, max_tokens=24, temperature=1.5,
                                     seed=s).choices[0].message.content for s in range(3)}
    assert len(hot) > 1
    r = c.chat.completions.create(model="m", messages=ask, max_tokens=500, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 200 and r.choices[0].finish_reason == "length"
