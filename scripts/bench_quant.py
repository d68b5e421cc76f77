"""The fused dequantizing matmul at a real model's projection shapes (GPU), against the same
product in bf16 through XLA (cuBLAS) and against XLA dequantizing the weight first, measured in
this run:

  python -m scripts.bench qmatmul [--shape qwen3-8b] [--batches 1,64,4096] [--formats int8,fp8,...]

(--formats also takes the GGUF block formats, q8_0, q4_0, q4_1, q4_k, q6_k, iq4_xs, as random blocks.)

For each format, shape and row count: microseconds, the weight bytes read per second (decode is
bound by them: the HBM roofline is the copy bandwidth measured here), and the speed-up over bf16.
`--tune` first sweeps the kernel's block sizes on the largest projection and uses the best per row
count for the rest (printed, to carry into pallas_kernels/quant_matmul.for_rows).
Results go to stdout as JSON lines and to OUT/bench-qmatmul-<shape>.json."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from infernix_jax.config import PRESETS
from infernix_jax.quant.formats import dequantize, quantize
from infernix_jax.quant.ggml import GGML_FORMATS, from_blocks, random_blocks
from pallas_kernels import quant_matmul as qmm
from scripts.bench_probes import copy_bandwidth, timed

SWEEP = {  # row class -> block sizes to try (bm, bn, bk, split, warps, stages)
    "decode": [(16, 32, 256, 1, 4, 3), (16, 32, 256, 2, 4, 3), (16, 64, 256, 2, 4, 3), (16, 64, 256, 4, 4, 3),
               (16, 128, 256, 4, 4, 3), (16, 128, 256, 8, 4, 3), (16, 128, 128, 4, 4, 4), (16, 64, 512, 2, 4, 3),
               (16, 128, 512, 4, 8, 3), (16, 256, 128, 4, 8, 3), (16, 64, 128, 4, 4, 5), (16, 128, 256, 4, 8, 4)],
    "small": [(64, 64, 128, 0, 4, 3), (64, 128, 128, 0, 4, 3), (64, 64, 128, 2, 4, 3), (64, 128, 128, 2, 4, 4),
              (64, 64, 256, 2, 4, 3), (32, 64, 128, 2, 4, 3)],
    "prefill": [(128, 128, 64, 1, 8, 3), (128, 128, 128, 1, 8, 3), (128, 256, 64, 1, 8, 3), (64, 128, 64, 1, 4, 3),
                (128, 64, 128, 1, 4, 3), (256, 128, 64, 1, 8, 3)],
}


TUNE_FORMATS = ("int8", "mxfp8", "int4", "nvfp4")     # one of each way of dequantizing a tile


def quantized(w, fmt: str, seed: int):
    """w in format fmt; the GGUF block formats (which nothing here quantizes to) as random blocks of
    w's shape: the kernel's speed does not depend on the values."""
    if fmt in GGML_FORMATS:
        import numpy as np
        raw = random_blocks(np.random.default_rng(seed), fmt, *w.shape)
        return jax.tree.map(jnp.asarray, from_blocks(fmt, raw, tuple(w.shape)))
    return quantize(w, fmt)


def row_class(m: int) -> str:
    return "decode" if m <= 16 else "small" if m <= 256 else "prefill"


def projections(cfg) -> dict:
    """name -> (N, K) of one layer's projections as the loader fuses them (models/fuse.py), plus
    the parts (wo is wq's transpose, the same shape in the Qwen3 dense models)."""
    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return {"wqkv": (q + 2 * kv, H), "w_gate_up": (2 * I, H), "wq": (q, H), "wk": (kv, H), "w_up": (I, H),
            "w_down": (H, I)}


def run(shape: str, out: str, batches: list[int], formats: list[str], tune: bool) -> dict:
    cfg = PRESETS[shape]
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    res = {"shape": shape, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "copy_GBps": round(bw / 1e9, 1), "best": {}, "rows": []}

    def emit(row):
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        (outdir / f"bench-qmatmul-{shape}.json").write_text(json.dumps(res, indent=1))

    def per_call_us(fn, x, ws) -> float:
        """fn(x, w) for each of the R copies ws inside one jit, unrolled: the launches queue up
        without a host round trip between them, and the copies together are far larger than the
        L2, so every product reads its weight from HBM. Microseconds per product."""
        many = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
        return 1e6 * timed(lambda: jax.block_until_ready(many(x, ws)), 10) / len(ws)

    def weights(N: int, K: int) -> list:
        """Distinct bf16 [N, K] weights, >= 1 GiB of them in all (4 to 32)."""
        n = max(4, min(32, -(-(1 << 30) // (N * K * 2))))
        return [jax.random.normal(jax.random.PRNGKey(i), (N, K), jnp.bfloat16) * 0.02 for i in range(n)]

    def kernel_us(x, qs, bs):
        q = qs[0]
        return per_call_us(lambda x, a: qmm.quant_matmul(x, a, q.fmt, q.shape, block_sizes=bs), x,
                           [qmm.kernel_args(q) for q in qs])

    projs = projections(cfg)
    key = jax.random.PRNGKey(0)
    totals: dict = {}            # row class -> tiles -> microseconds summed over the formats
    if tune:
        N, K = projs["w_up"]
        ws = weights(N, K)
        for fmt in [f for f in formats if f in TUNE_FORMATS]:
            q = [quantized(w, fmt, i) for i, w in enumerate(ws)]
            for M in batches:
                x = jax.random.normal(key, (M, K), jnp.bfloat16)
                for cand in SWEEP[row_class(M)]:
                    bs = qmm.BlockSizes(*cand)
                    try:
                        us = kernel_us(x, q, bs)
                    except Exception as e:       # a tile the compiler rejects: report, go on
                        emit({"tune": fmt, "M": M, "blocks": cand, "error": str(e).splitlines()[0][:200]})
                        continue
                    emit({"tune": fmt, "M": M, "blocks": cand, "us": round(us, 1)})
                    t = totals.setdefault(row_class(M), {})
                    t[cand] = t.get(cand, 0.0) + us
        # one choice per row class: the smallest total over formats (ties: the first)
        res["best"] = {rc: min(t, key=t.get) for rc, t in totals.items()}
        print(json.dumps({"best": res["best"]}), flush=True)

    for name, (N, K) in projs.items():
        ws = weights(N, K)
        bf16_bytes = N * K * 2
        for M in batches:
            x = jax.random.normal(key, (M, K), jnp.bfloat16)
            t_bf16 = per_call_us(lambda x, w: x @ w.T, x, ws)
            emit({"proj": name, "N": N, "K": K, "M": M, "fmt": "bf16", "us": round(t_bf16, 1),
                  "GBps": round(bf16_bytes / t_bf16 / 1e3, 1), "of_roofline": round(bf16_bytes / t_bf16 / 1e3 / (bw / 1e9), 3)})
            for fmt in formats:
                qs = [quantized(w, fmt, i) for i, w in enumerate(ws)]
                nbytes = qs[0].nbytes
                cand = res["best"].get(row_class(M))
                bs = qmm.BlockSizes(*cand) if cand else None
                t_k = kernel_us(x, qs, bs)
                t_x = per_call_us(lambda x, q: x @ dequantize(q, jnp.bfloat16).T, x, qs)
                emit({"proj": name, "N": N, "K": K, "M": M, "fmt": fmt, "us": round(t_k, 1),
                      "xla_dequant_us": round(t_x, 1), "GBps": round(nbytes / t_k / 1e3, 1),
                      "of_roofline": round(nbytes / t_k / 1e3 / (bw / 1e9), 3),
                      "vs_bf16": round(t_bf16 / t_k, 2), "vs_xla_dequant": round(t_x / t_k, 2)})
    return res


__all__ = ["run", "projections"]
