"""Warm-up (engine/shapes.py): after the basic level a first session compiles nothing; the device
thread serves requests while it warms and says ready once warm; the shapes a run met are remembered
for the next start of the same engine; the server's /health says "loading" until warm and the
compilation cache and shapes record are written."""
import json
import re
import threading
import time

import pytest

from conftest import compiles, start_server
from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.engine.constraints import grammar_from_json_schema
from test_engine import tiny  # noqa: F401  (the fixture)


def chat(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


def first_session(eng, tok):
    """What a first user does: a question (greedy, then sampled), the same again (a prefix-cache hit),
    a follow-up turn, three questions at once, logprobs, a JSON-schema reply."""
    q = chat(tok, "What is the capital of France?")
    g = lambda n=12, **kw: SamplingParams(max_tokens=n, temperature=0, **kw)  # noqa: E731
    a = eng.generate([Request(q, g())])[0]
    eng.generate([Request(q, SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=1))])
    eng.generate([Request(q, g())])
    turn = q + a.token_ids + chat(tok, "And of Italy?")
    eng.generate([Request(turn, g())])
    eng.generate([Request(chat(tok, f"Name a color number {i}."), g()) for i in range(3)])
    eng.generate([Request(q, g(logprobs=True, top_logprobs=3))])
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    eng.generate([Request(q, g(24, grammar=grammar_from_json_schema(schema)))])


def test_after_the_basic_warmup_a_first_session_compiles_nothing(tiny):  # noqa: F811
    eng = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=128, decode_steps=4)
    assert eng.warmup("basic") == len(eng.warm_keys("basic")) > 0
    before = compiles()
    first_session(eng, tiny.tokenizer)
    assert compiles() == before


def test_without_warmup_the_same_session_compiles(tiny):  # noqa: F811
    """(The check above can fail: this engine's shapes are new to the process.)"""
    eng = Engine(tiny, max_num_seqs=3, max_num_batched_tokens=96, decode_steps=3)
    before = compiles()
    first_session(eng, tiny.tokenizer)
    assert compiles() > before


def test_requests_are_served_while_warming_and_ready_comes_after(tiny):  # noqa: F811
    eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=2)
    eng.start("basic")
    done = threading.Event()
    eng.submit(Request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0),
                       on_event=lambda ev: ev.kind == "done" and done.set()))
    assert done.wait(300)
    assert eng.ready.wait(300)
    w = eng.warm_state
    assert w["done"] == w["total"] == len(eng.warm_keys("basic"))
    eng.stop()


def test_the_shapes_a_run_met_are_warmed_by_the_next_start(tiny, tmp_path):  # noqa: F811
    """A shape outside the basic level (penalties) is saved at close; the next engine of the same
    identity warms it while idle; an engine with other limits does not read it; a damaged record is
    ignored."""
    kw = dict(max_num_seqs=2, max_num_batched_tokens=64, decode_steps=2, shapes_dir=str(tmp_path))
    a = Engine(tiny, **kw)
    a.generate([Request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, presence_penalty=1.0))])
    met = set(a.runner.shapes.counts)
    assert any(k[0] == "decode" and k[-1] is not None for k in met)       # a penalised decode
    a.close()
    files = list(tmp_path.glob("infernix-shapes-*.json"))
    assert len(files) == 1
    b = Engine(tiny, **kw)
    assert set(b.earlier_shapes) == met
    b.start("basic")
    assert b.ready.wait(300)
    deadline = time.time() + 300
    while b._idle_keys and time.time() < deadline:
        time.sleep(0.1)
    assert not b._idle_keys
    before = compiles()
    b_done = threading.Event()
    b.submit(Request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, presence_penalty=1.0),
                     on_event=lambda ev: ev.kind == "done" and b_done.set()))
    assert b_done.wait(300) and compiles() == before
    b.stop()
    assert Engine(tiny, **{**kw, "max_num_seqs": 3}).earlier_shapes == []
    files[0].write_text("{not json")
    assert Engine(tiny, **kw).earlier_shapes == []


@pytest.mark.extended
def test_server_says_loading_until_warm_and_writes_its_cache(tmp_path_factory, smollm):
    """A request sent while the server warms up is answered; /health says 503 "loading" until the
    warm-up is done, then 200; the compilation cache and the shapes record (which the next start
    reads: test above) are written."""
    import httpx
    cache = tmp_path_factory.mktemp("xla-cache")
    flags = ("--compile-cache", str(cache), "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
             "--max-model-len", "1024")
    statuses = []
    for url in start_server(tmp_path_factory, *flags, warmup="basic", ready_path="/v1/models"):
        h = httpx.get(url + "/health", timeout=10)
        statuses.append(h.status_code)
        if h.status_code == 503:
            assert h.json()["status"] == "loading" and re.fullmatch(r"\d+/\d+ step shapes", h.json()["warmup"])
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        deadline = time.time() + 600
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.time() < deadline
            time.sleep(0.2)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert 503 in statuses                           # (the warm-up of a fresh cache takes tens of seconds)
    assert any(p.name.startswith("infernix-shapes-") for p in cache.iterdir())
    assert len(list(cache.iterdir())) > 10           # compiled executables
    record = json.loads(next(cache.glob("infernix-shapes-*.json")).read_text())
    assert record["shapes"] and all(n >= 1 for _, n in record["shapes"])
