"""A first engine over the contiguous KV cache: static batches of up to `max_batch` requests,
prefilled together and decoded in lock-step until each row stops. One thread owns the device.
(The paged engine with continuous batching replaces this loop; the request/event interface stays.)"""
from __future__ import annotations

import logging
import queue
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from ..loader import LoadedModel
from ..models.llama import init_cache
from . import steps
from .request import Event, Request, Result, SamplingParams
from .stops import TextTracker

log = logging.getLogger("infernix.engine")


class _Row:
    def __init__(self, req: Request, tokenizer, eos_ids):
        self.req = req
        p = req.params
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        self.tracker = TextTracker(tokenizer, tuple(p.stop))
        self.out_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish: str | None = None

    def emit(self, ev: Event):
        if ev.kind == "delta":
            self.text_parts.append(ev.text)
        if self.req.on_event is not None:
            self.req.on_event(ev)

    def result(self) -> Result:
        return Result(text="".join(self.text_parts), token_ids=self.out_ids, finish_reason=self.finish or "abort",
                      prompt_tokens=len(self.req.prompt_ids), completion_tokens=len(self.out_ids))


class Engine:
    def __init__(self, model: LoadedModel, max_batch: int = 8, max_context: int | None = None):
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = model.tokenizer
        self.max_batch = max_batch
        self.max_context = min(max_context or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        self.model_name = model.name
        self.eos_ids = tuple(self.tokenizer.eos_ids if self.tokenizer else self.cfg.eos_token_ids)
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # ---- synchronous API (scripts) -------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Result]:
        results = []
        for i in range(0, len(requests), self.max_batch):
            results += self.run_batch(requests[i:i + self.max_batch])
        return results

    # ---- device thread (server) ----------------------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        """Start the device thread; warmup compiles the common batch-1 shapes before the first request."""
        if warmup:
            self._queue.put(Request(prompt_ids=[0] * 20, params=SamplingParams(max_tokens=2, temperature=0.0)))
        self._thread = threading.Thread(target=self._loop, name="infernix-device", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        self._queue.put(req)

    def stop(self) -> None:
        if self._thread:
            self._queue.put(None)
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                self.run_batch(batch)
            except Exception as e:  # the engine survives; only this batch's requests fail
                log.error("batch failed: %s\n%s", e, traceback.format_exc())
                for r in batch:
                    if r.on_event:
                        r.on_event(Event("error", message=f"internal error: {type(e).__name__}: {e}"))

    # ---- one static batch ----------------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt < 1:
            raise ValueError("the prompt is empty")
        if n_prompt + max_tokens > self.max_context:
            raise ValueError(f"this model's context is {self.max_context} tokens; the prompt has {n_prompt} "
                             f"tokens and max_tokens is {max_tokens}: shorten the prompt or lower max_tokens")

    def run_batch(self, reqs: list[Request]) -> list[Result]:
        rows = [_Row(r, self.tokenizer, self.eos_ids) for r in reqs]
        live = [r for r in rows if not r.req.cancelled.is_set()]
        for r in rows:
            if r.req.cancelled.is_set():
                r.finish = "abort"
        if not live:
            return [r.result() for r in rows]
        n = len(live)
        B = steps.bucket(n, minimum=1)
        lens = [len(r.req.prompt_ids) for r in live]
        T = steps.bucket(max(lens))
        S = steps.bucket(max(len(r.req.prompt_ids) + r.req.params.max_tokens for r in live), minimum=256)
        S = max(S, T)
        tokens = np.zeros((B, T), np.int32)
        lengths = np.ones((B,), np.int32)
        for i, r in enumerate(live):
            tokens[i, :lens[i]] = r.req.prompt_ids
            lengths[i] = lens[i]
        temp = np.zeros((B,), np.float32)
        top_p = np.ones((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        keys = np.zeros((B, 2), np.uint32)
        for i, r in enumerate(live):
            p = r.req.params
            temp[i], top_p[i], top_k[i] = p.temperature, p.top_p, p.top_k
            seed = p.seed if p.seed is not None else np.random.randint(0, 2**31 - 1)
            keys[i] = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
        params, cfg = self.model.params, self.cfg
        cache = init_cache(cfg, B, S, self.model.dtype)
        tok, _, cache = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                                      keys, temp, top_p, top_k)
        positions = lengths.copy()
        step = 0
        while True:
            new = np.asarray(tok)
            for i, r in enumerate(live):
                if r.finish is None:
                    self._accept(r, int(new[i]), S)
            if all(r.finish is not None for r in live):
                break
            step += 1
            tok, _, cache = steps.decode(params, cfg, jnp.asarray(new), jnp.asarray(positions), 
                                         jnp.full((B,), step, jnp.int32), cache, keys, temp, top_p, top_k)
            positions = positions + 1
        return [r.result() for r in rows]

    def _accept(self, r: _Row, t: int, cache_len: int) -> None:
        if r.req.cancelled.is_set():
            r.finish = "abort"
            return
        p = r.req.params
        if t in r.stop_ids:
            r.out_ids.append(t)
            self._finish(r, "stop")
            return
        r.out_ids.append(t)
        text = r.tracker.push(t)
        if r.tracker.stopped:
            if text:
                r.emit(Event("delta", text=text, token_ids=(t,)))
            self._finish(r, "stop")
            return
        if text:
            r.emit(Event("delta", text=text, token_ids=(t,)))
        if len(r.out_ids) >= p.max_tokens or len(r.req.prompt_ids) + len(r.out_ids) >= cache_len:
            self._finish(r, "length")

    def _finish(self, r: _Row, reason: str) -> None:
        tail = r.tracker.finish()
        if tail:
            r.emit(Event("delta", text=tail))
        r.finish = reason
        r.emit(Event("done", finish_reason=reason, prompt_tokens=len(r.req.prompt_ids),
                     completion_tokens=len(r.out_ids)))
