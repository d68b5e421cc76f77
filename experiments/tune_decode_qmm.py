"""Experiment (issue 7): the quantized matmul's decode tiles judged inside a decode step, not alone.
`python -m experiments.tune_decode_qmm [--weights fp8,int8] [--batch 1]`.
The isolated-product bench (`infernix-bench qmatmul --tune`) lands every kernel near the same ~40 us
floor at one row, so its choice of tiles says little; here each candidate replaces
quant_matmul.for_rows for decode's rows, the bench tool's qwen3-8b decode (context 1024) is rebuilt,
timed, and one dispatch is traced: tok/s and the quantized kernels' device time per step."""
import argparse, os, tempfile
from pathlib import Path

import jax

from pallas_kernels import quant_matmul as qmm
from scripts import bench_shapes
from experiments.profile_decode import decode_traced, emit

CANDIDATES = [  # (bn, bk, split, warps, stages) at bm = 16; the first is the shipped one
    (32, 256, 2, 4, 3), (32, 256, 0, 4, 3), (32, 256, 1, 4, 3), (32, 256, 4, 4, 3),
    (64, 256, 0, 4, 3), (64, 256, 1, 4, 3), (64, 512, 0, 4, 3), (32, 512, 0, 4, 4),
    (128, 256, 0, 4, 3), (64, 256, 0, 8, 4), (32, 128, 0, 4, 5), (64, 128, 0, 4, 5),
    (128, 128, 0, 8, 4), (16, 512, 0, 4, 3), (32, 256, 0, 2, 4), (64, 256, 0, 4, 5),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--weights", default="fp8,int8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    a = p.parse_args()
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    res, original = [], qmm.for_rows
    for w in a.weights.split(","):
        b = bench_shapes.Bench(a.shape, out, weights=w)
        for cand in CANDIDATES:
            tiles = qmm.BlockSizes(16, *cand)
            qmm.for_rows = lambda m, fmt="", t=tiles: t if m <= 16 else original(m, fmt)
            jax.clear_caches()
            try:
                k = decode_traced(b, a.batch, a.context)["kernels"]
                qus = sum(v[0] for n, v in k.items() if n.startswith("quant_matmul")) / b.k
                red = sum(v[0] for n, v in k.items() if "reduce" in n) / b.k
                row = {"weights": w, "tiles": str(tiles), **b.results["decode"][-1],
                       "quant_matmul_us_per_step": round(qus, 1), "reduce_us_per_step": round(red, 1)}
            except Exception as e:  # a candidate that does not compile
                row = {"weights": w, "tiles": str(tiles), "error": repr(e)[:200]}
            emit(res, row, out / "tune_decode_qmm.json")
        del b
    qmm.for_rows = original


if __name__ == "__main__":
    main()
