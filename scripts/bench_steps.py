"""infernix-bench steps: the cost of one mixed step (a prompt chunk beside B-1 decodes) with the
reference attention's row layout (only the prompt's row gets N query slots, the decodes attend as
decodes: Runner._multi_rows) against every row given all N slots, in the same run; and a decode
dispatch of the same batch for scale. This is what serving on the CPU (or any --attn-impl
reference engine) pays when requests arrive beside running ones."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def _timed(f, repeats: int = 5) -> float:
    import jax
    jax.block_until_ready(f())                                   # compile (or read the cache), warm
    t = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(f())
    return (time.perf_counter() - t) / repeats * 1000


def run(model, cases: list[tuple[int, int]], context: int, out: str) -> list[dict]:
    from infernix_jax.engine import Engine
    from infernix_jax.engine.sampler import SamplingArrays
    eng = Engine(model, max_num_seqs=max(B for _, B in cases), max_model_len=context + 1024)
    r = eng.runner
    M = r.table_width(-(-context // r.block_size))

    def mixed(N: int, B: int, layout: bool):
        zb = np.zeros((B,), np.int32)
        cu = np.concatenate([[0], N - B + 1 + np.arange(B)]).astype(np.int32)       # row 0: the prompt chunk
        multi = np.asarray([0], np.int32) if layout else None
        return lambda: r._device("mixed", np.zeros((N,), np.int32), np.zeros((N,), np.int32),
                                 np.full((N,), r.num_blocks * r.block_size, np.int32), np.zeros((B, M), np.int32),
                                 np.full((B,), context, np.int32), cu, (cu[1:] - 1)[:, None], zb,
                                 SamplingArrays.greedy(B),
                                 route=r.route, want_top=True, penalties=None, allowed=r._allowed([], B),
                                 guard=None, rows=None, multi_rows=multi)

    def decode(B: int, k: int):
        zb = np.zeros((B,), np.int32)
        return lambda: r._device("decode", zb, zb + context, np.zeros((B, M), np.int32), np.ones((B,), bool), zb,
                                 SamplingArrays.greedy(B), num_steps=k, route=r.route, want_top=False,
                                 penalties=None, guard=None, rows=None, **r._ends([], B))

    rows = []
    for N, B in cases:
        every, laid = _timed(mixed(N, B, False)), _timed(mixed(N, B, True))
        rows.append({"N": N, "B": B, "context": context, "every_row_ms": round(every, 1),
                     "laid_out_ms": round(laid, 1), "speedup": round(every / laid, 2)})
        print(f"mixed step, {N - B + 1}-token chunk beside {B - 1} decodes (N={N}, context {context}): every row "
              f"ragged {every:.1f} ms, rows laid out {laid:.1f} ms ({every / laid:.2f}x)", flush=True)
    k = eng.scheduler.decode_steps
    for B in sorted({B for _, B in cases}):
        ms = _timed(decode(B, k))
        rows.append({"decode_B": B, "k": k, "ms": round(ms, 1)})
        print(f"decode dispatch, batch {B}, {k} steps: {ms:.1f} ms", flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "steps.json").write_text(json.dumps({"model": model.name, "rows": rows}, indent=1))
    return rows
