"""Per-request statistics -> Prometheus metrics (GET /metrics) and a JSON-lines request log.

A RequestStats rides on request.ctx; the turns of the request report their tokens into it (TTFT,
inter-token gaps, counts, finish reasons); when the handler ends, `finish` observes the metrics and
writes one log line."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclasses.dataclass
class RequestStats:
    endpoint: str
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    gaps: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    delivered: bool = False    # a stream's last event went out (the client may leave at once)
    speculative: dict = dataclasses.field(default_factory=dict)   # method -> [rounds, drafted, accepted]

    def on_tokens(self) -> None:
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        elif self.t_last is not None:
            self.gaps.append(now - self.t_last)
        self.t_last = now

    def on_done(self, prompt_tokens: int, completion_tokens: int, reason: str, cached_tokens: int = 0,
                speculative: tuple = ()) -> None:
        for method, *counts in speculative:       # (n choices: summed)
            self.speculative[method] = [a + b for a, b in zip(self.speculative.get(method, [0, 0, 0]), counts)]
        self.prompt_tokens = max(self.prompt_tokens, prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, cached_tokens)
        self.completion_tokens += completion_tokens
        self.finish_reasons.append(reason)


class Metrics:
    def __init__(self, engine, log_path: str | None = None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("infernix_requests", "HTTP requests that reached an endpoint", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("infernix_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("infernix_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("infernix_prefix_cache_hit_tokens",
                                     "prompt tokens of finished requests taken from the prefix cache", registry=r)
        self.ttft = Histogram("infernix_time_to_first_token_seconds", "request arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("infernix_inter_token_latency_seconds", "time between output deltas",
                             buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("infernix_request_duration_seconds", "request arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=r)
        sch = engine.scheduler
        Gauge("infernix_queue_depth", "requests waiting for a slot", registry=r).set_function(lambda: len(sch.waiting))
        Gauge("infernix_running_requests", "requests in the running batch", registry=r).set_function(
            lambda: len(sch.running))
        bm = engine.bm
        Gauge("infernix_kv_usage_ratio", "share of KV blocks in use", registry=r).set_function(
            lambda: 1.0 - bm.num_free / max(1, bm.num_blocks))
        spec = engine.spec
        if spec is not None:            # speculative decoding: per drafting method, since start
            def counted(field, method):
                return lambda: getattr(spec.stats.get(method), field, 0)
            for name, field, doc in (("rounds", "rounds", "verify rounds"),
                                     ("draft_tokens", "drafted", "draft tokens verified (a tree: its depth)"),
                                     ("accepted_tokens", "accepted", "draft tokens the model agreed with")):
                g = Gauge(f"infernix_spec_{name}", f"speculative decoding: {doc}", ["method"], registry=r)
                for method in ("ngram", "tree", *(("mtp",) if spec.mtp else ())):
                    g.labels(method=method).set_function(counted(field, method))
        cache = engine.cache
        if cache is not None:
            Gauge("infernix_prefix_cache_device_blocks", "KV blocks kept for reuse on the device (in use or not)",
                  registry=r).set_function(lambda: bm.num_cached)
            if cache.host is not None:
                Gauge("infernix_prefix_cache_ram_bytes", "bytes held by the prefix cache's RAM tier",
                      registry=r).set_function(lambda: cache.host.used)
                Gauge("infernix_prefix_cache_ram_limit_bytes", "the RAM tier's size limit now (auto resize moves it)",
                      registry=r).set_function(lambda: cache.host.limit)
            if cache.ssd is not None:
                Gauge("infernix_prefix_cache_ssd_bytes_written", "bytes written to the SSD tier since start",
                      registry=r).set_function(lambda: cache.ssd.written_bytes)
                Gauge("infernix_prefix_cache_ssd_skipped_tokens",
                      "prompt tokens found on the SSD tier but computed, because reading was measured slower",
                      registry=r).set_function(lambda: cache.stats["ssd_skipped"])
        self.log_path = log_path
        self._log_lock = threading.Lock()
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finish(self, st: RequestStats, status: int, client: str = "", error: str = "") -> None:
        end = time.perf_counter()
        self.requests.labels(st.endpoint, str(status)).inc()
        if status == 200:
            self.prompt_tokens.inc(st.prompt_tokens)
            self.cached_tokens.inc(st.cached_tokens)
            self.generation_tokens.inc(st.completion_tokens)
            self.e2e.observe(end - st.t0)
            if st.t_first is not None:
                self.ttft.observe(st.t_first - st.t0)
            for g in st.gaps:
                self.itl.observe(g)
        if self._log is not None:
            line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "endpoint": st.endpoint, "status": status,
                    "stream": st.stream, "prompt_tokens": st.prompt_tokens,
                    "completion_tokens": st.completion_tokens, "cached_tokens": st.cached_tokens,
                    "ttft_s": None if st.t_first is None else round(st.t_first - st.t0, 4),
                    "duration_s": round(end - st.t0, 4),
                    "tokens_per_s": round(st.completion_tokens / (end - st.t_first), 2)
                    if st.t_first is not None and end > st.t_first else None,
                    "finish_reasons": st.finish_reasons, "client": client}
            if st.speculative:       # per drafting method: verify rounds, draft tokens, accepted ones
                line["speculative"] = {m: dict(rounds=r, drafted=d, accepted=a, acceptance=round(a / d, 3) if d else 0.0)
                                       for m, (r, d, a) in st.speculative.items()}
            if error:
                line["error"] = error
            with self._log_lock:
                if not self._log.closed:     # a request cancelled by the shutdown ends after close()
                    self._log.write(json.dumps(line, ensure_ascii=False) + "\n")
                    self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            with self._log_lock:
                self._log.close()
