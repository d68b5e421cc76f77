"""Experiment (issue 7): can XLA's own GEMM (its Triton emitter, autotuned, split-K included) fuse the
8-bit code conversion and beat the Pallas kernel's streaming rate in decode?
`python -m experiments.xla_fused_dequant [--part alone,step] [--weights fp8,int8]`.
  alone  one product at a time on qwen3-8b's fused projections (copies of the weight in one jit,
         >= 1 GiB, as `infernix-bench qmatmul` times them): bf16 x @ W^T, the Pallas kernel, and
         dot(x, codes as bf16) * channel scale with nothing between (layers.linear's form between XLA_FUSED_ROWS), and
         for the blocked formats XLA given dequantize(W) without the barrier; the optimized HLO of
         each at one row is saved to show what XLA made of it.
  step   the bench tool's qwen3-8b decode (context 1024) and a 4K prefill with the Pallas route and
         with XLA's fused GEMM at every row count, one dispatch traced: tok/s and device time per kernel name."""
import argparse, os, tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from infernix_jax.config import PRESETS
from infernix_jax.models import layers
from infernix_jax.quant.formats import dequantize, quantize
from pallas_kernels import quant_matmul as qmm
from scripts import bench_shapes
from scripts.bench_quant import projections
from experiments.profile_decode import decode_traced, emit


def xla_fused(x, q):
    y = jnp.einsum("mi,oi->mo", x, q.data.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * q.scale.reshape(-1)).astype(x.dtype)


def alone(out: Path, formats, rows, res, names):
    cfg = PRESETS["qwen3-8b"]
    projs = {k: v for k, v in projections(cfg).items() if k in names}
    for name, (N, K) in projs.items():
        n = max(4, min(24, -(-(1 << 30) // (N * K * 2))))
        ws = [jax.random.normal(jax.random.PRNGKey(i), (N, K), jnp.bfloat16) * 0.02 for i in range(n)]
        for M in rows:
            x = jax.random.normal(jax.random.PRNGKey(99), (M, K), jnp.bfloat16)

            def per_call(fn, arg, tag):
                many = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
                if M == 1 and name == "w_gate_up":
                    one = jax.jit(fn).lower(x, arg[0]).compile().as_text()
                    (out / f"hlo-{tag}.txt").write_text(one)
                us = 1e6 * bench_shapes.timed(lambda: jax.block_until_ready(many(x, arg)), 10) / len(arg)
                return round(us, 1)
            t = per_call(lambda x, w: x @ w.T, ws, "bf16")
            emit(res, {"part": "alone", "proj": name, "N": N, "K": K, "M": M, "fmt": "bf16", "us": t,
                       "GBps": round(N * K * 2 / t / 1e3)}, out / "xla_fused_dequant.json")
            for fmt in formats:
                qs = [quantize(w, fmt) for w in ws]
                nb = qs[0].nbytes
                row = {"part": "alone", "proj": name, "N": N, "K": K, "M": M, "fmt": fmt}
                if M <= 128:
                    row["pallas_us"] = per_call(lambda x, a: qmm.quant_matmul(x, a, fmt, (N, K)),
                                                [qmm.kernel_args(q) for q in qs], f"pallas-{fmt}")
                if fmt in ("int8", "fp8"):
                    row["xla_fused_us"] = per_call(xla_fused, qs, f"xla-{fmt}")
                row["xla_dequant_us"] = per_call(lambda x, q: x @ dequantize(q, x.dtype).T, qs, f"xla-dq-{fmt}")
                best = min(v for k, v in row.items() if k.endswith("_us"))
                row.update(best_GBps=round(nb / best / 1e3), vs_bf16=round(t / best, 2))
                emit(res, row, out / "xla_fused_dequant.json")
            del qs
        del ws


def step(out: Path, formats, batches, res, prefill: bool):
    shipped = layers.XLA_FUSED_ROWS
    for w in formats:
        b = bench_shapes.Bench("qwen3-8b", out, weights=w)
        for route in ("pallas", "xla_fused"):
            layers.XLA_FUSED_ROWS = (0, 1 << 30) if route == "xla_fused" else (0, 0)
            jax.clear_caches()
            for B in batches:
                try:
                    k = decode_traced(b, B, 1024)["kernels"]
                    top = sorted(k.items(), key=lambda kv: -kv[1][0])[:12]
                    emit(res, {"part": "step", "weights": w, "route": route, **b.results["decode"][-1],
                               "kernel_us_per_step": round(sum(v[0] for v in k.values()) / b.k, 1),
                               "top": [(n, round(v[0] / b.k, 1), v[1] // b.k) for n, v in top]},
                         out / "xla_fused_dequant.json")
                except Exception as e:
                    emit(res, {"part": "step", "weights": w, "route": route, "batch": B, "error": repr(e)[:300]},
                         out / "xla_fused_dequant.json")
            try:
                if not prefill:
                    continue
                b.prefill(4096)
                emit(res, {"part": "step", "weights": w, "route": route, **b.results["prefill"][-1]},
                     out / "xla_fused_dequant.json")
            except Exception as e:
                emit(res, {"part": "step", "weights": w, "route": route, "prefill": 4096, "error": repr(e)[:300]},
                     out / "xla_fused_dequant.json")
        layers.XLA_FUSED_ROWS = shipped
        del b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="alone,step")
    p.add_argument("--weights", default="fp8,int8")
    p.add_argument("--alone-formats", default="fp8,int8,fp8b,mxfp8")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--projs", default="wqkv,w_gate_up,w_down,wq")
    p.add_argument("--no-prefill", action="store_true")
    a = p.parse_args()
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    res = []
    if "alone" in a.part:
        alone(out, a.alone_formats.split(","), [int(r) for r in a.rows.split(",")], res, a.projs.split(","))
    if "step" in a.part:
        step(out, a.weights.split(","), [int(r) for r in a.batches.split(",")], res, not a.no_prefill)


if __name__ == "__main__":
    main()
