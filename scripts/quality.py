"""infernix-quality: what each route costs in output, measured against the exact route.

  infernix-quality --text FILE [--model M] [--route default,lossless] [--weights none,int8,int4,...]
                   [--kv-dtype none,int8,fp8,k8v4] [--ctx 512] [--max-tokens 4096] [--json OUT]

The text is cut into windows of --ctx tokens. The reference is the lossless route (float32, full
f32 matmuls, reference kernels) of the model as loaded; every route x weight format is compared
with it on the second half of each window: mean KL divergence, its 99th and 99.9th percentiles and
maximum, how often the most likely next token is the same, and the perplexity ratio on the text.
Each format x KV dtype also gets its honest-rounding floor: the KL of the lossless route with the
weights rounded to the format's values with exact scales and K/V rounded to nearest with an exact
f32 scale per head and token (what --kv-dtype stores), nothing else changed
(infernix_jax/quality.py), and each route's mean KL over that floor. Prints a table and writes the numbers as JSON."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time

from scripts._common import run


def main(argv=None) -> int:
    from infernix_jax.hub import DEFAULT_MODEL
    from infernix_jax.choices import LOSSY_FORMATS as FORMATS
    p = argparse.ArgumentParser(prog="infernix-quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face model directory, a .gguf file, or an alias")
    p.add_argument("--text", required=True, help="a UTF-8 text file to score")
    p.add_argument("--route", default="default,lossless",
                   help="routes to measure, comma-separated: default (what infernix-serve runs), lossless")
    p.add_argument("--weights", default="none," + ",".join(FORMATS),
                   help=f"weight formats, comma-separated: none (as loaded) or any of {', '.join(FORMATS)}")
    p.add_argument("--kv-dtype", default="none",
                   help="KV cache dtypes, comma-separated: none (the route's compute dtype), int8, fp8, k8v4")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the default route's compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4096, help="score at most this many tokens of the text")
    p.add_argument("--json", default="quality.json", help="where to write the results (default %(default)s)")
    p.add_argument("--chunk", type=int, default=0,
                   help="score the default route in pieces of this many tokens (default: whole windows). "
                        "On a GPU, pieces of up to 128 rows run the fused quantized matmul that decode runs; "
                        "whole windows run prefill's route (XLA dequantizing, then cuBLAS)")

    def go():
        a = p.parse_args(argv)
        routes = [r for r in a.route.split(",") if r]
        fmts = [f for f in a.weights.split(",") if f]
        if not routes or set(routes) - {"default", "lossless"}:
            raise ValueError(f"--route takes default and/or lossless, not {a.route!r}")
        bad = set(fmts) - set(FORMATS) - {"none"}
        if not fmts or bad:
            raise ValueError(f"unknown --weights {', '.join(sorted(bad)) or '(none given)'}; "
                             f"choose from none, {', '.join(FORMATS)}")
        from infernix_jax.models.kv_pool import KV_DTYPES
        kvs = [k for k in a.kv_dtype.split(",") if k]
        if "bf16p" in kvs:
            raise ValueError("--kv-dtype bf16p is lossless (KL 0 by construction; tests/test_kv_bf16p.py checks the "
                             "bits): infernix-quality measures the lossy KV dtypes, none, int8, fp8, k8v4")
        bad = set(kvs) - set(KV_DTYPES) - {"none"}
        if not kvs or bad:
            raise ValueError(f"unknown --kv-dtype {', '.join(sorted(bad)) or '(none given)'}; "
                             f"choose from none, {', '.join(KV_DTYPES)}")
        if a.ctx < 16 or a.max_tokens < 16:
            raise ValueError("--ctx and --max-tokens must be >= 16")
        if a.chunk < 0:
            raise ValueError(f"--chunk must be >= 0, got {a.chunk}")
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
        res = measure(a.model, text, routes, fmts, a.dtype, a.ctx, a.max_tokens, a.chunk,
                      ["" if k == "none" else k for k in kvs])
        res["text"] = a.text
        print(table(res))
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.json}", file=sys.stderr)

    return run("infernix-quality", go)


def _cast(params, dtype):
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


SPILL_BYTES = 1 << 30


def keep(windows, spill: str) -> list:
    """The reference's scored log-probs of every window, kept for all the comparisons: in memory up to
    SPILL_BYTES, past that in .npy files under `spill` (memory-mapped: at V = 152K a 4K-token text
    holds 1.2 GB of them)."""
    import numpy as np
    out, held = [], 0
    for i, lp in enumerate(windows):
        held += lp.nbytes
        if held > SPILL_BYTES:
            m = np.lib.format.open_memmap(f"{spill}/ref{i}.npy", mode="w+", dtype=lp.dtype, shape=lp.shape)
            m[...] = lp
            m.flush()
            lp = np.load(f"{spill}/ref{i}.npy", mmap_mode="r")
        out.append(lp)
    return out


def measure(model_spec: str, text: str, routes: list[str], fmts: list[str], dtype: str | None, ctx: int,
            max_tokens: int, chunk: int = 0, kv_dtypes: list[str] = ("",)) -> dict:
    import jax
    from infernix_jax.loader import DTYPES, load_model
    from infernix_jax import quality as ql
    from infernix_jax.models.fuse import fuse_params
    from infernix_jax.quant.apply import quantize_params
    model = load_model(model_spec, dtype="float32", fuse=False)     # quantized part by part, then fused, as served
    if model.weights_format:
        raise ValueError(f"{model_spec} holds {model.weights_format} weights: infernix-quality measures each format "
                         f"against the unquantized model, so give it the model they were made from")
    if model.tokenizer is None:
        raise ValueError(f"{model_spec} has no tokenizer (tokenizer.json): the text cannot be tokenized")
    ids = model.tokenizer.encode(text)
    wins = ql.windows(ids, ctx, max_tokens)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens: too few to score")
    on_gpu = jax.devices()[0].platform == "gpu"
    dt = DTYPES[dtype or ("bfloat16" if on_gpu else "float32")]
    cfg, f32 = model.cfg, DTYPES["float32"]

    def logprobs(params, route: str, dtype_, impl: str, kv: str = ""):
        """Each window's scored log-probs, one window at a time (a generator)."""
        for w in wins:
            with jax.default_matmul_precision("highest") if route == "lossless" else contextlib.nullcontext():
                lp = ql.window_logprobs(params, cfg, w, dtype_, impl, chunk=chunk if route == "default" else 0,
                                        kv_dtype=kv)
            yield ql.scored(lp, w).copy()          # (not a view: the window's other rows go)

    with tempfile.TemporaryDirectory(prefix="infernix-quality-") as spill:
        t0 = time.perf_counter()
        ref = keep(logprobs(model.params, "lossless", f32, "reference"), spill)
        res = {"model": model.name, "device": jax.devices()[0].device_kind, "ctx": ctx, "windows": len(wins),
               "default_chunk": chunk,
               "default_dtype": str(dt.__name__),
               "reference": "lossless route, weights as loaded", "rows": []}
        for fmt in fmts:
            honest = None if fmt == "none" else ql.honest_params(model.params, fmt)
            for kv in kv_dtypes:
                name = dict(weights=fmt, kv_dtype=kv or "model")
                floor = None
                if fmt != "none" or kv:          # (weights as loaded, KV in the model dtype: the reference)
                    floor = ql.compare(ref, logprobs(honest or model.params, "lossless", f32, "reference", kv), wins)
                    res["rows"].append({"route": "honest rounding", **name, **floor.row()})
                for route in routes:
                    lossless = route == "lossless"
                    if lossless and fmt == "none" and kv:
                        continue            # (the same computation as its floor, just above)
                    base = model.params if lossless else _cast(model.params, dt)
                    params = fuse_params(base if fmt == "none" else quantize_params(base, fmt, progress=False))
                    impl = "reference" if lossless or not on_gpu else "pallas"
                    st = ql.compare(ref, logprobs(params, route, f32 if lossless else dt, impl, kv),
                                    wins)
                    row = {"route": route, **name, **st.row()}
                    if floor is not None and floor.mean_kl > 0:
                        row["of_honest"] = round(st.mean_kl / floor.mean_kl, 3)
                    res["rows"].append(row)
        res["scored_tokens"] = res["rows"][0]["tokens"]         # every comparison scores the same positions
        res["seconds"] = round(time.perf_counter() - t0, 1)
        return res


def table(res: dict) -> str:
    head = f"{'route':<16} {'weights':<8} {'KV':<6} {'mean KL':>9} {'p99 KL':>9} {'p99.9 KL':>9} {'same top':>9} " \
           f"{'ppl ratio':>9} {'x honest':>9}"
    lines = [f"{res['model']}: {res['scored_tokens']} tokens scored in {res['windows']} windows of {res['ctx']}; "
             f"reference: {res['reference']}", head, "-" * len(head)]
    for r in res["rows"]:
        ratio = f"{r['of_honest']:.2f}" if "of_honest" in r else "-"
        lines.append(f"{r['route']:<16} {r['weights']:<8} {r.get('kv_dtype', 'model'):<6} {r['mean_kl']:>9.5f} {r['p99_kl']:>9.5f} {r['p999_kl']:>9.5f} "
                     f"{100 * r['same_top']:>8.1f}% {r['ppl_ratio']:>9.4f} {ratio:>9}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
