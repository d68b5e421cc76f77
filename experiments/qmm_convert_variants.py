"""Experiment (issue 7): what limits the 8-bit decode kernel inside a step: the code conversion?
`python -m experiments.qmm_convert_variants [--check]`.
Each variant replaces quant_matmul's kernel body for int8 / fp8 weights (the rest of the call is
the shipped one), the bench tool's qwen3-8b decode (batch 1, context 1024) is rebuilt and timed,
and one dispatch is traced for the quantized kernels' device time per step. `--check` runs each
variant in interpret mode against the reference instead (CPU).
  shipped   codes -> bf16 (Triton's conversion), tensor-core dot with x
  via_f32   codes -> f32 -> bf16
  f16       codes -> f16, x -> f16, f16 dot (f32 accumulation)
  bits      e4m3 bits placed in bf16 bits (sign, exponent and mantissa shifted; the 2^120 exponent
            bias difference folded into the channel scale): two integer ops, no conversion
  gemv      one row: multiply and sum along K on the CUDA cores in f32 (no tensor cores)"""
import argparse, os, tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import quant_matmul as qmm

SHIPPED = qmm._kernel


def variant_kernel(how: str):
    def kernel(*refs, fmt: str, bk: int, bn: int, steps: int, precision, rows: int):
        if fmt not in ("int8", "fp8") or how == "shipped" or (how == "bits" and fmt != "fp8") \
                or (how == "gemv" and rows != 1):
            return SHIPPED(*refs, fmt=fmt, bk=bk, bn=bn, steps=steps, precision=precision, rows=rows)
        x_ref, d_ref, s_ref, o_ref = refs
        split = pl.program_id(2)
        bm = x_ref.shape[0]
        live = (pl.program_id(0) * bm + jnp.arange(bm) < rows)[:, None]

        def load_x(k):
            return plt.load(x_ref.at[:, pl.ds(k, bk)], mask=live, other=0) if rows % bm else x_ref[:, pl.ds(k, bk)]

        if how == "gemv":
            def body(i, acc):
                k = (split * steps + i) * bk
                x = x_ref[0, pl.ds(k, bk)].astype(jnp.float32)                  # [bk]
                w = d_ref[:, pl.ds(k, bk)].astype(jnp.float32)                  # [bn, bk]
                return acc + (w * x[None, :]).sum(axis=1)
            acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn,), jnp.float32))
            acc = acc * s_ref[...].reshape(bn)
            full = jnp.broadcast_to(acc[None, :], (bm, bn))
            plt.store(o_ref, full.astype(o_ref.dtype), mask=live)
            return

        def body(i, acc):
            k = (split * steps + i) * bk
            x, d = load_x(k), d_ref[:, pl.ds(k, bk)]
            if how == "via_f32":
                w = d.astype(jnp.float32).astype(x.dtype)
            elif how == "f16":
                x, w = x.astype(jnp.float16), d.astype(jnp.float16)
            else:                                                              # bits (fp8 only)
                u = jax.lax.bitcast_convert_type(d, jnp.uint8).astype(jnp.uint16)
                w = jax.lax.bitcast_convert_type(((u & 0x80) << 8) | ((u & 0x7F) << 4), jnp.bfloat16)
            return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        scale = s_ref[...].reshape(1, bn) * (2.0 ** 120 if how == "bits" else 1.0)
        acc = acc * scale
        if rows % bm:
            plt.store(o_ref, acc.astype(o_ref.dtype), mask=live)
        else:
            o_ref[...] = acc.astype(o_ref.dtype)
    return kernel


VARIANTS = ["shipped", "via_f32", "f16", "bits", "gemv"]


def check():
    from infernix_jax.quant.formats import dequantize, quantize
    for fmt in ("int8", "fp8"):
        w = jax.random.normal(jax.random.PRNGKey(0), (128, 512)) * 0.02
        q = quantize(w, fmt)
        x = jax.random.normal(jax.random.PRNGKey(1), (1, 512), jnp.bfloat16)
        ref = x.astype(jnp.float32) @ dequantize(q, jnp.float32).T
        for how in VARIANTS:
            qmm._kernel = variant_kernel(how)
            jax.clear_caches()
            out = qmm.quant_matmul(x, qmm.kernel_args(q), fmt, q.shape, interpret=True).astype(jnp.float32)
            print(fmt, how, float(jnp.abs(out - ref).max() / jnp.abs(ref).max()))
    qmm._kernel = SHIPPED


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--weights", default="fp8,int8")
    a = p.parse_args()
    if a.check:
        return check()
    from scripts import bench_shapes
    from experiments.profile_decode import decode_traced, emit
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    res = []
    for w in a.weights.split(","):
        b = bench_shapes.Bench("qwen3-8b", out, weights=w)
        for how in VARIANTS:
            if (how == "bits" and w != "fp8") or (how == "via_f32" and w == "int8"):
                continue
            qmm._kernel = variant_kernel(how)
            jax.clear_caches()
            try:
                k = decode_traced(b, 1, 1024)["kernels"]
                qus = sum(v[0] for n, v in k.items() if n.startswith("quant_matmul")) / b.k
                row = {"weights": w, "variant": how, **b.results["decode"][-1], "quant_matmul_us_per_step": round(qus, 1)}
            except Exception as e:
                row = {"weights": w, "variant": how, "error": repr(e)[:300]}
            emit(res, row, out / "qmm_convert_variants.json")
        del b
    qmm._kernel = SHIPPED


if __name__ == "__main__":
    main()
