"""infernix-bench serve: the server as a user meets it, over HTTP on loopback.

Starts `infernix-serve` `--starts` times on one compilation cache (a fresh one unless --compile-cache
names one, so the first start compiles and the next read the cache back) and measures, from the
launch: when it answers HTTP, when the README's request is answered, how long that first answer took
against the next identical one, and when /health says ready; once ready, the first request of each
kind a session sends (a forced tool call, a json_schema reply, 8 requests at once) against the next
of the same kind (the warm-up's promise: the first is as fast as the tenth). On the last start it then measures
throughput: `c` clients each sending requests one after another (default sampling, fixed-length
replies), for each c in --clients, against one client in the same run (batching must never cost
throughput)."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

README_BODY = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}
# the requests a first session sends after its first chat turn: (name, bodies sent at once)
KINDS = [
    ("forced tool call", [{"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                           "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                           "temperature": 0, "max_tokens": 48}]),
    ("json_schema reply", [{"messages": [{"role": "user", "content": "Name a big city and its population."}],
                            "response_format": {"type": "json_schema", "json_schema": {"name": "city",
                                                                                       "schema": SCHEMA}},
                            "temperature": 0, "max_tokens": 48}]),
    ("8 requests at once", [{"messages": [{"role": "user", "content": f"Say something about the number {i}."}],
                             "max_tokens": 32} for i in range(8)]),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc, deadline: float, ok=lambda r: True):
    import httpx
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"infernix-serve exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=2)
            if ok(r):
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no answer from {url} in time")


def one_start(model: str, cache: str, extra: list[str], log: Path) -> tuple[dict, object, str]:
    """Launch, measure the start-up, return (figures, process, base URL); the caller stops it."""
    import httpx
    port = _port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "scripts.serve", "--model", model, "--port", str(port),
                             "--compile-cache", cache, *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = t0 + 1800
    _wait(url + "/v1/models", proc, deadline, lambda r: r.status_code == 200)
    listening = time.time() - t0
    times, text = [], ""
    for _ in range(3):
        t = time.time()
        r = httpx.post(url + "/v1/chat/completions", json=README_BODY, timeout=600)
        r.raise_for_status()
        times.append(time.time() - t)
        text = r.json()["choices"][0]["message"]["content"]
    first_answer = listening + times[0]
    saw_loading = httpx.get(url + "/health", timeout=5).status_code == 503
    _wait(url + "/health", proc, deadline, lambda r: r.status_code == 200)
    ready = time.time() - t0
    t = time.time()
    httpx.post(url + "/v1/chat/completions", json=README_BODY, timeout=600).raise_for_status()
    after_ready = time.time() - t
    kinds = {name: [_timed_burst(url, bodies) for _ in range(2)] for name, bodies in KINDS}
    return {"first_of_each_kind": {k: {"first_s": round(a, 3), "next_s": round(b, 3), "first_over_next": round(a / b, 2)}
                                   for k, (a, b) in kinds.items()},
            "listening_s": round(listening, 2), "first_answer_at_s": round(first_answer, 2),
            "first_answer_took_s": round(times[0], 3), "next_took_s": round(times[1], 3),
            "third_took_s": round(times[2], 3), "first_over_next": round(times[0] / times[1], 2),
            "health_loading_after_answers": saw_loading, "ready_at_s": round(ready, 2),
            "answer_when_ready_s": round(after_ready, 3), "answer": text}, proc, url


def _timed_burst(url: str, bodies: list[dict]) -> float:
    """Seconds until every one of `bodies`, sent at once, is answered."""
    import httpx

    async def go():
        async with httpx.AsyncClient() as c:
            rs = await asyncio.gather(*[c.post(url + "/v1/chat/completions", json=b, timeout=600) for b in bodies])
        for r in rs:
            r.raise_for_status()
    t = time.time()
    asyncio.run(go())
    return time.time() - t


async def _client(c, url: str, i: int, n: int, tokens: int, out: list) -> None:
    for j in range(n):
        body = {"messages": [{"role": "user", "content": f"Tell me about topic {i}-{j}, in detail."}],
                "max_tokens": tokens, "ignore_eos": True}
        r = await c.post(url + "/v1/chat/completions", json=body, timeout=1200)
        r.raise_for_status()
        out.append(r.json()["usage"]["completion_tokens"])


def throughput(url: str, clients: list[int], requests: int, tokens: int) -> list[dict]:
    import httpx

    async def run(c_n: int) -> dict:
        async with httpx.AsyncClient() as c:
            await asyncio.gather(*[_client(c, url, i, 1, 8, []) for i in range(c_n)])     # shapes of this load
            out: list = []
            t = time.perf_counter()
            await asyncio.gather(*[_client(c, url, i, requests, tokens, out) for i in range(c_n)])
            dt = time.perf_counter() - t
        return {"clients": c_n, "tokens": sum(out), "seconds": round(dt, 2), "tok_s": round(sum(out) / dt, 1)}
    rows = [asyncio.run(run(c)) for c in clients]
    for r in rows:
        r["vs_first"] = round(r["tok_s"] / rows[0]["tok_s"], 2)
    return rows


def run(model: str, starts: int, cache: str | None, clients: list[int], requests: int, tokens: int,
        out: str, extra: list[str]) -> dict:
    import jax
    tmp = None
    if cache is None:
        tmp = tempfile.TemporaryDirectory(prefix="infernix-bench-cache-")
        cache = tmp.name
    Path(out).mkdir(parents=True, exist_ok=True)
    res = {"model": model, "device": str(jax.devices()[0].device_kind), "compile_cache": cache,
           "fresh_cache": tmp is not None, "starts": [], "date": time.strftime("%Y-%m-%d")}
    try:
        for i in range(starts):
            figures, proc, url = one_start(model, cache, extra, Path(out) / f"serve-start-{i + 1}.log")
            try:
                res["starts"].append(figures)
                print(f"start {i + 1}: answers HTTP at {figures['listening_s']} s; README request answered at "
                      f"{figures['first_answer_at_s']} s (took {figures['first_answer_took_s']} s, the next "
                      f"{figures['next_took_s']} s: {figures['first_over_next']}x); ready at {figures['ready_at_s']} s",
                      flush=True)
                for k, v in figures["first_of_each_kind"].items():
                    print(f"  once ready, first {k}: {v['first_s']} s, the next {v['next_s']} s ({v['first_over_next']}x)",
                          flush=True)
                if i == starts - 1 and clients:
                    res["throughput"] = throughput(url, clients, requests, tokens)
                    for r in res["throughput"]:
                        print(f"  {r['clients']} client(s) x {requests} requests of {tokens} tokens: {r['tok_s']} "
                              f"tok/s ({r['vs_first']}x {clients[0]} client(s))", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    finally:
        if tmp is not None:
            tmp.cleanup()
    path = Path(out) / "serve.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return res
