"""Experiment (issue 7): `python -m experiments.mgpu_mixed` (Hopper GPU). Does a Mosaic GPU mixed-type wgmma kernel (jax's own example op, weights as the
64-row operand, tokens as N) read 8-bit weights near HBM bandwidth at decode's few rows?"""
import json, os, traceback, functools
import jax, jax.numpy as jnp
print("jax", jax.__version__, flush=True)
from scripts.bench_probes import timed
OUT = os.environ.get("OUT", "/tmp")
res = {"jax": jax.__version__, "rows": []}
def emit(r):
    res["rows"].append(r); print(json.dumps(r), flush=True)
    open(f"{OUT}/mgpu_exp.json", "w").write(json.dumps(res, indent=1))
try:
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm
except Exception as e:
    emit({"import_error": repr(e)}); raise SystemExit(0)
N, K = 12288, 4096
nw = 20
ws = [jax.random.randint(jax.random.PRNGKey(i), (N, K), -127, 127, jnp.int8) for i in range(nw)]
def per_call(fn, x, args):
    many = jax.jit(lambda x, a: [fn(x, t) for t in a])
    return 1e6 * timed(lambda: jax.block_until_ready(many(x, args)), 10) / len(args)
for n in (16, 8, 64):
    xt = jax.random.normal(jax.random.PRNGKey(9), (K, n), jnp.bfloat16)
    ref = jnp.dot(ws[0].astype(jnp.float32), xt.astype(jnp.float32))
    emit({"n": n, "v": "cublas_bf16", "us": per_call(lambda x, w: w.astype(jnp.bfloat16) @ x, xt, [w.astype(jnp.bfloat16) for w in ws[:10]])})
    for tm, tk, steps, wgd, gmd, gw in [(64, 128, 4, "M", "M", 1), (64, 256, 4, "M", "M", 1), (128, 128, 4, "M", "M", 1),
                                         (64, 128, 6, "M", "M", 1), (64, 64, 8, "M", "M", 1), (128, 256, 3, "M", "M", 1)]:
        row = {"n": n, "tile_m": tm, "tile_k": tk, "steps": steps}
        try:
            cfg = mm.TuningConfig(tile_m=tm, tile_n=n, tile_k=tk, max_concurrent_steps=steps, epi_tile_n=n,
                                  epi_tile_m=min(64, tm), grid_minor_dim=mm.MatmulDimension[gmd], grid_tile_width=gw,
                                  wg_dimension=mm.MatmulDimension[wgd])
            f = functools.partial(mm.mixed_matmul_kernel, out_dtype=jnp.float32, config=cfg)
            got = jax.jit(lambda w, x: f(w, x))(ws[0], xt)
            row["relerr"] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            row["us"] = per_call(lambda x, w: f(w, x), xt, ws)
            row["GBps"] = N * K / row["us"] / 1e3
        except Exception as e:
            row["error"] = "".join(traceback.format_exception_only(e))[-400:]
        emit(row)
