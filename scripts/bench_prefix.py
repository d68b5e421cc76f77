"""infernix-bench prefix: time to first token of a long conversation resent, by where its prefix
comes from: (a) cold (computed), (b) the device's cached blocks, (c) the RAM tier, (d) the SSD tier
(its file dropped from the page cache first, so the read is a real disk read where the OS allows),
(e) a restart that loads --prefix-cache-file. Each is the resent conversation plus a new 16-token
user turn, so every case computes at least those tokens. Then an agent-like replay (turns that
append to a growing context) reports the SSD tier's bytes written per hour at that pace.

Every case runs twice on fresh conversations and the second run counts (the first compiles the
step shapes it uses). CPU: the real default model; GPU: random weights at a named shape (--shape)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

GiB = 1 << 30


class IdsTokenizer:
    """Just enough of a tokenizer for the engine when the weights are random: ids as text."""
    eos_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)

    def token_to_id(self, token):
        return None


def load(shape: str | None, model_spec: str, dtype: str):
    if shape:
        import jax
        import jax.numpy as jnp
        from infernix_jax.config import PRESETS
        from infernix_jax.loader import LoadedModel
        from infernix_jax.models.params import init_params
        if shape not in PRESETS:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(PRESETS)}")
        cfg = PRESETS[shape]
        return LoadedModel(name=shape, path="", cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16),
                           tokenizer=IdsTokenizer(), dtype=jnp.bfloat16)
    from infernix_jax.loader import load_model
    return load_model(model_spec, dtype=dtype)


class PrefixBench:
    def __init__(self, model, tokens: int, workdir: Path, chunk: int, kv_dtype: str = ""):
        from infernix_jax.models.kv_pool import kv_bytes_per_token
        self.model, self.T, self.dir, self.chunk, self.kv_dtype = model, tokens, workdir, chunk, kv_dtype
        self.per_tok = kv_bytes_per_token(model.cfg, model.dtype, kv_dtype)
        self.rng = np.random.default_rng(0)
        self.rows: list[dict] = []

    def conversation(self, n: int) -> list[int]:
        return list(map(int, self.rng.integers(10, self.model.cfg.vocab_size - 10, n)))

    def engine(self, **kw):
        from infernix_jax.engine import Engine
        pool = (self.T + 256) * 1.3 * self.per_tok / GiB      # one conversation, not two: pushing one evicts
        return Engine(self.model, max_num_seqs=1, max_model_len=self.T + 256, kv_cache_gib=pool,
                      max_num_batched_tokens=self.chunk, kv_dtype=self.kv_dtype, **kw)

    @staticmethod
    def ttft(eng, prompt) -> tuple[float, int]:
        from infernix_jax.engine import Request, SamplingParams
        t = time.perf_counter()
        r = eng.generate([Request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))])[0]
        return time.perf_counter() - t, r.cached_tokens

    def case(self, name: str, make, push: str | None = None) -> None:
        """Run a case twice (the first compiles); keep the second."""
        for attempt in range(2):
            shutil.rmtree(self.dir / "case", ignore_errors=True)      # one case's files on disk at a time
            eng = make(attempt)
            conv = self.conversation(self.T)
            t_cold, _ = self.ttft(eng, conv)
            if push == "evict":                 # an unrelated conversation takes the device's blocks
                self.ttft(eng, self.conversation(self.T))
            if push == "ssd":
                self.ttft(eng, self.conversation(self.T))
                eng.cache.ssd.flush()
                _drop_page_cache(eng.cache.ssd.path)
            if push == "restart":
                eng.close()
                eng = make(attempt)
                self.ttft(eng, self.conversation(64))       # compile the new engine's small shapes
            t, cached = self.ttft(eng, conv + self.conversation(16))
            eng.close()
        row = {"case": name, "tokens": self.T, "ttft_s": round(t, 4), "cached_tokens": cached,
               "cold_ttft_s": round(t_cold, 4), "speedup_vs_cold": round(t_cold / t, 1)}
        costs = eng.cache.costs if eng.cache is not None else None
        if costs is not None and costs.read_bps:          # what the cost model measured
            row["ssd_read_gb_s"] = round(costs.read_bps / 1e9, 2)
            row["prefill_tok_s"] = round(costs.prefill_tps or 0)
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    CASES = ("a", "b", "c", "d", "e", "replay", "disk")

    def run(self, cases=CASES) -> list[dict]:
        T, bt = self.T, self.per_tok
        ram = 2.5 * T * bt / GiB
        case = str(self.dir / "case")
        if "a" in cases:
            self.case("a_cold", lambda i: self.engine(prefix_cache=False))
        if "b" in cases:
            self.case("b_device", lambda i: self.engine())
        if "c" in cases:
            self.case("c_ram", lambda i: self.engine(prefix_cache_ram_gib=ram), push="evict")
        if "d" in cases:
            self.case("d_ssd", lambda i: self.engine(prefix_cache_ram_gib=4 * 16 * bt / GiB,
                                                     ssd_context_gib=1.5 * T * bt / GiB, ssd_context_dir=case,
                                                     ssd_gib_per_hour=1000.0), push="ssd")
        if "e" in cases:
            self.case("e_restart", lambda i: self.engine(prefix_cache_ram_gib=ram,
                                                         prefix_cache_file=case + "/cache.npz"), push="restart")
        shutil.rmtree(case, ignore_errors=True)
        if "replay" in cases:
            self.replay(case)
        if "disk" in cases:
            self.rows.append(disk_probe(self.dir, self.per_tok * 16))
            print(json.dumps(self.rows[-1]), flush=True)
        return self.rows

    def replay(self, ssd_dir: str, turns: int = 8) -> None:
        """An agent session: each turn resends the context, plus the reply and a new user turn."""
        from infernix_jax.engine import Request, SamplingParams
        T, bt = self.T, self.per_tok
        eng = self.engine(prefix_cache_ram_gib=64 * 16 * bt / GiB, ssd_context_gib=2 * T * bt / GiB,
                          ssd_context_dir=ssd_dir)
        ctx = self.conversation(T // 2)
        t = time.perf_counter()
        for _ in range(turns):
            r = eng.generate([Request(ctx, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))])[0]
            ctx = ctx + r.token_ids + self.conversation(T // (2 * turns))
            self.ttft(eng, self.conversation(T // 2))       # other work evicts this session meanwhile
        eng.cache.ssd.flush()
        dt = time.perf_counter() - t
        w = eng.cache.ssd.written_bytes
        row = {"case": "replay", "turns": turns, "seconds": round(dt, 2), "ssd_bytes_written": w,
               "ssd_gib_per_hour_at_this_pace": round(w / GiB / dt * 3600, 2), "ssd_dropped": eng.cache.ssd.dropped}
        eng.close()
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def disk_probe(directory: Path, block_bytes: int, n: int = 512, threads: int = 16) -> dict:
    """What bounds the SSD tier on this host: cold reads of n KV-block-sized zstd records (16
    threads, as the tier reads), and zstd decompression, of data like random-weight bf16 KV."""
    import zstandard
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(0)
    raw = (rng.standard_normal(block_bytes // 2).astype(np.float32) * 0.5).astype(np.float16).tobytes()
    rec = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(raw)
    path = directory / "disk-probe.bin"
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(rec)
    _drop_page_cache(str(path))
    fd, L = os.open(path, os.O_RDONLY), len(rec)
    try:
        with ThreadPoolExecutor(threads) as ex:
            t = time.perf_counter()
            recs = list(ex.map(lambda i: os.pread(fd, L, i * L), range(n)))
            read_s = time.perf_counter() - t
            t = time.perf_counter()
            list(ex.map(lambda r: zstandard.ZstdDecompressor().decompress(r), recs))
            unzip_s = time.perf_counter() - t
    finally:
        os.close(fd)
        path.unlink()
    return {"case": "disk", "records": n, "record_bytes": L, "compression_ratio": round(L / len(raw), 3),
            "cold_read_gb_s": round(n * L / read_s / 1e9, 2), "zstd_gb_s": round(n * len(raw) / unzip_s / 1e9, 2)}


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(shape: str | None, model_spec: str, dtype: str, tokens: int, chunk: int, out: str | None,
        cases=PrefixBench.CASES, kv_dtype: str = "") -> None:
    import jax
    model = load(shape, model_spec, dtype)
    work = Path(tempfile.mkdtemp(prefix="infernix-bench-prefix-"))
    try:
        rows = PrefixBench(model, tokens, work, chunk, kv_dtype).run(cases)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'case':<10} {'TTFT':>9} {'cached':>7} {'x cold':>7}   ({tokens} tokens, {shape or model_spec}, "
          f"{jax.devices()[0].device_kind})")
    for r in rows:
        if "ttft_s" in r:
            print(f"{r['case']:<10} {r['ttft_s']:>8.3f}s {r['cached_tokens']:>7} {r['speedup_vs_cold']:>6.1f}x")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "model": shape or model_spec,
                                         "tokens": tokens, "kv_dtype": kv_dtype or "model", "rows": rows}, indent=1))
