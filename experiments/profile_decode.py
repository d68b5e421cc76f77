"""Experiment (issue 7): where a batch-1 decode step's GPU time goes, bf16 against quantized weights.
`python -m experiments.profile_decode [--shape qwen3-8b] [--weights none,fp8] [--impl pallas]`.
Runs the bench tool's decode (random weights, context 1024, 8 steps a dispatch), then traces one more
dispatch with jax.profiler (perfetto JSON) and sums the device's kernel time by kernel name."""
import argparse, collections, glob, gzip, json, os, re, tempfile
from pathlib import Path

import jax

from scripts import bench_shapes


def kernel_times(trace_dir: str) -> dict:
    """name -> [total us, count] over the device's kernel events of a perfetto trace."""
    f = sorted(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    ev = json.load(gzip.open(f))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {p for p, n in procs.items() if re.search(r"GPU|/device:|stream", n, re.I)}
    out = collections.defaultdict(lambda: [0.0, 0])
    for e in ev:
        if e.get("ph") == "X" and e.get("pid") in dev:
            t = out[re.sub(r"[._]\d+$", "", e["name"])[:90]]
            t[0] += float(e.get("dur", 0)); t[1] += 1
    return {"processes": sorted(procs.values()), "kernels": dict(out)}


def decode_traced(b, batch: int, context: int, reps: int = 3) -> dict:
    """b.decode(batch, context) (a bench_shapes.Bench) timed as the bench times it, then one more
    dispatch traced -> kernel_times of that dispatch."""
    timed, box = bench_shapes.timed, {}

    def traced(fn, reps, **kw):
        s = timed(fn, reps, **kw)
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            fn()
        box["trace"] = d
        return s
    bench_shapes.timed = traced
    try:
        b.decode(batch, context, reps=reps)
    finally:
        bench_shapes.timed = timed
    return kernel_times(box["trace"])


def emit(rows: list, row: dict, path: Path) -> None:
    """Print one result row and rewrite the JSON of all so far (a killed run keeps what it had)."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    path.write_text(json.dumps(rows, indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--weights", default="none,fp8")
    p.add_argument("--impl", default="pallas")
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    res = {}
    for w in a.weights.split(","):
        b = bench_shapes.Bench(a.shape, out, weights=None if w == "none" else w, impl=a.impl)
        try:
            k = decode_traced(b, a.batch, 1024)
        except Exception as e:
            res[w] = {"error": repr(e)}
            print(w, repr(e), flush=True)
            continue
        top = sorted(k["kernels"].items(), key=lambda kv: -kv[1][0])
        total = sum(v[0] for _, v in top)
        res[w] = {"decode": b.results["decode"], "processes": k["processes"], "total_us": total,
                  "per_step_us": total / b.k, "top": top[:40]}
        if not total:
            print("no device events; processes:", k["processes"], flush=True)
        print(f"== {w}: kernel time {total / b.k:.0f} us per step; {b.results['decode']}", flush=True)
        for name, (us, n) in top[:25]:
            print(f"{us / b.k:9.1f} us/step {n // b.k:5d}/step  {name}", flush=True)
        (out / "profile_decode.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
