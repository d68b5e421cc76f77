"""Experiment (issue 7, not part of the bench tool): why the fused 8-bit matmul is stuck near 1.2 TB/s at
one row. `python -m experiments.qmatmul_variants` (GPU; interpret mode on the CPU). Variants on the
qwen3-8b up projection (12288 x 4096), weights >= 1 GiB in copies."""
import functools, json, os
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from scripts.bench_probes import copy_bandwidth, timed
from pallas_kernels import quant_matmul as qmm
from infernix_jax.quant.formats import quantize

OUT = os.environ.get("OUT", "/tmp")
INTERP = jax.devices()[0].platform == "cpu"


def dot_kernel(x_ref, d_ref, s_ref, o_ref, *, bk, steps, hint):
    split = pl.program_id(2)
    def body(i, acc):
        k = (split * steps + i) * bk
        if hint:
            k = pl.multiple_of(k, bk)
        x = x_ref[:, pl.ds(k, bk)]
        w = d_ref[:, pl.ds(k, bk)].astype(x.dtype)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc * s_ref[...].reshape(1, -1)


def gemv_kernel(x_ref, d_ref, s_ref, o_ref, *, bk, steps, hint, M):
    # x_ref [M, K]; d_ref [bn, K]; o_ref [M, bn]
    split = pl.program_id(1)
    def body(i, acc):
        k = (split * steps + i) * bk
        if hint:
            k = pl.multiple_of(k, bk)
        w = d_ref[:, pl.ds(k, bk)].astype(jnp.float32)          # [bn, bk]
        rows = []
        for m in range(M):
            xm = x_ref[pl.ds(m, 1), pl.ds(k, bk)].astype(jnp.float32)   # [1, bk]
            rows.append(jnp.sum(w * xm, axis=1))                # [bn]
        return tuple(a + r for a, r in zip(acc, rows))
    bn = d_ref.shape[0]
    acc = jax.lax.fori_loop(0, steps, body, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(M)))
    s = s_ref[...].reshape(-1)
    for m in range(M):
        o_ref[m, :] = acc[m] * s


def call(kind, x, d, s, *, bm=16, bn=32, bk=256, split=2, warps=4, stages=3, hint=True):
    M, K = x.shape
    N = d.shape[0]
    steps = K // bk // split
    cp = None if INTERP else pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    if kind == "dot":
        Mp = max(bm, 16)
        xp = jnp.pad(x, ((0, Mp - M), (0, 0)))
        out = pl.pallas_call(functools.partial(dot_kernel, bk=bk, steps=steps, hint=hint),
            grid=(1, N // bn, split),
            in_specs=[pl.BlockSpec((Mp, K), lambda m, n, k: (0, 0)),
                      pl.BlockSpec((bn, K), lambda m, n, k: (n, 0)),
                      pl.BlockSpec((bn, 1), lambda m, n, k: (n, 0))],
            out_specs=pl.BlockSpec((None, Mp, bn), lambda m, n, k: (k, 0, n)),
            out_shape=jax.ShapeDtypeStruct((split, Mp, N), jnp.float32),
            compiler_params=cp, interpret=INTERP)(xp, d, s)
        return out.sum(0)[:M].astype(x.dtype)
    out = pl.pallas_call(functools.partial(gemv_kernel, bk=bk, steps=steps, hint=hint, M=M),
        grid=(N // bn, split),
        in_specs=[pl.BlockSpec((M, K), lambda n, k: (0, 0)),
                  pl.BlockSpec((bn, K), lambda n, k: (n, 0)),
                  pl.BlockSpec((bn, 1), lambda n, k: (n, 0))],
        out_specs=pl.BlockSpec((None, M, bn), lambda n, k: (k, 0, n)),
        out_shape=jax.ShapeDtypeStruct((split, M, N), jnp.float32),
        compiler_params=cp, interpret=INTERP)(x, d, s)
    return (out[0] if split == 1 else out.sum(0)).astype(x.dtype)


def main():
    N, K = (12288, 4096) if not INTERP else (256, 1024)
    res = {"device": jax.devices()[0].device_kind, "rows": []}
    if not INTERP:
        res["copy_GBps"] = copy_bandwidth() / 1e9
    n = 4 if INTERP else 11
    ws = [jax.random.normal(jax.random.PRNGKey(i), (N, K), jnp.bfloat16) * 0.02 for i in range(n)]
    qs = {f: [quantize(w, f) for w in ws] for f in ("int8", "fp8")}
    ones = jnp.ones((N, 1), jnp.float32)
    def emit(r):
        res["rows"].append(r); print(json.dumps(r), flush=True)
        open(f"{OUT}/qmm_exp.json", "w").write(json.dumps(res, indent=1))
    def per_call(fn, x, args):
        many = jax.jit(lambda x, a: [fn(x, *t) for t in a])
        return 1e6 * timed(lambda: jax.block_until_ready(many(x, args)), 5 if INTERP else 10) / len(args)
    for M in ([1, 4] if INTERP else [1, 2, 4, 8, 16]):
        x = jax.random.normal(jax.random.PRNGKey(99), (M, K), jnp.bfloat16)
        ref = {f: (x.astype(jnp.float32) @ (q[0].data.astype(jnp.float32) * q[0].scale).T) for f, q in qs.items()}
        emit({"M": M, "v": "cublas_bf16", "us": per_call(lambda x, w: x @ w.T, x, [(w,) for w in ws])})
        for f, q in qs.items():
            args = [(q_.data, q_.scale) for q_ in q]
            emit({"M": M, "v": "current", "fmt": f, "us": per_call(lambda x, d, s: qmm.quant_matmul(x, (d, s), f, (N, K), interpret=INTERP), x, args)})
        cands = [("dot", dict(bn=32, bk=256, split=2, hint=False)), ("dot", dict(bn=32, bk=256, split=2, hint=True)),
                 ("dot", dict(bn=64, bk=512, split=2, hint=True, warps=4))]
        if M <= 8:
            cands += [("gemv", dict(bn=bn, bk=bk, split=sp, warps=w, hint=True))
                      for bn, bk, sp, w in [(8, 512, 1, 4), (16, 512, 1, 4), (16, 256, 2, 4), (32, 256, 1, 4),
                                            (16, 1024, 1, 4), (32, 512, 2, 8), (8, 1024, 2, 4), (64, 256, 1, 8),
                                            (16, 512, 2, 4), (4, 1024, 1, 2)]]
            cands.append(("gemv", dict(bn=16, bk=512, split=1, warps=4, hint=False)))
        if INTERP:
            cands = cands[:2] + cands[3:5]
        for f in ("bf16", "int8", "fp8"):
            args = [(w, ones) for w in ws] if f == "bf16" else [(q_.data, q_.scale) for q_ in qs[f]]
            for kind, kw in cands:
                if K // kw["bk"] % kw["split"]:
                    continue
                row = {"M": M, "v": kind, "fmt": f, **kw}
                try:
                    fn = lambda x, d, s, kind=kind, kw=kw: call(kind, x, d, s, **kw)
                    if f != "bf16":
                        got = fn(x, *args[0]).astype(jnp.float32)
                        row["maxerr"] = float(jnp.max(jnp.abs(got - ref[f])) / jnp.max(jnp.abs(ref[f])))
                    row["us"] = per_call(fn, x, args)
                    row["GBps"] = args[0][0].nbytes / row["us"] / 1e3
                except Exception as e:
                    row["error"] = str(e).splitlines()[0][:300]
                emit(row)


if __name__ == "__main__":
    main()
