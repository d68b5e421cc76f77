"""The grouped expert kernel (pallas_kernels/grouped_matmul.py) against its reference on fresh random
inputs and routings: plain and quantized experts, decode-sized and prefill-sized groups; interpret
mode on the CPU, compiled on the GPU (marked gpu)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.quant.formats import FORMATS, dequantize, quantize
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.quant_matmul import BlockSizes, kernel_args

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


def routing(seed, T, E, k):
    """Each of T tokens picks k distinct experts of E (uneven loads: a few experts are popular)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 0.3))
    return jnp.asarray(np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(T)]), jnp.int32)


def test_align_lays_pairs_out_by_expert_in_whole_tiles():
    idx = routing(0, 37, 8, 2).reshape(-1)                                       # 74 pairs
    order, te, where = (np.asarray(a) for a in gm.align(idx, 8, 16))
    P = idx.shape[0]
    assert order.shape[0] == te.shape[0] * 16
    assert sorted(order[order < P].tolist()) == list(range(P))                   # every pair once
    assert (order[where] == np.arange(P)).all()
    for t, e in enumerate(te):                                                   # one expert per tile
        pairs = order[t * 16:(t + 1) * 16]
        pairs = pairs[pairs < P]
        if e < 0:
            assert pairs.size == 0
        else:
            assert (np.asarray(idx)[pairs] == e).all()
    used = te[te >= 0]
    assert (np.diff(used) >= 0).all() and set(used.tolist()) == set(np.asarray(idx).tolist())


CASES = [  # (T tokens, E experts, k, N, K, bm, block sizes)
    (3, 8, 2, 64, 256, 16, None),                                                # decode
    (40, 8, 2, 96, 512, 16, BlockSizes(bm=16, bn=32, bk=128, split=2)),         # K split
    (70, 4, 2, 128, 256, 32, BlockSizes(bm=32, bn=64, bk=64, split=1)),         # prefill-sized groups
]


def run_case(case, fmt, dtype, interpret):
    T, E, k, N, K, bm, bs = CASES[case]
    key = jax.random.PRNGKey(case)
    w = jax.random.t(key, 5.0, (E, N, K)) * 0.02
    q = quantize(w, fmt) if fmt else None
    args, wd = (kernel_args(q), dequantize(q, jnp.float32)) if fmt else ((w.astype(dtype),), w.astype(dtype))
    x = jax.random.normal(jax.random.fold_in(key, 1), (T, K), jnp.float32).astype(dtype)
    idx = routing(case, T, E, k).reshape(-1)
    order, te, where = gm.align(idx, E, bm)
    rows = jnp.where(order < idx.shape[0], order // k, T)                         # token of each row
    out = gm.grouped_matmul(x, rows, te, args, fmt, (E, N, K), bm, block_sizes=bs, interpret=interpret)
    ref = gm.grouped_matmul_reference(x, rows, te, wd)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    assert not out[np.asarray(order) >= idx.shape[0]].any()                      # padding rows: zero
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err <= TOL[dtype], err
    # and the reference is each pair's token times its own expert
    direct = np.einsum("pk,pnk->pn", np.asarray(x, np.float32)[np.arange(idx.shape[0]) // k],
                       np.asarray(wd, np.float32)[np.asarray(idx)])
    got = ref[np.asarray(where)]
    assert np.max(np.abs(got - direct)) / np.max(np.abs(direct)) <= TOL[dtype]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_grouped_matmul_plain_experts(case, dtype, interpret):
    run_case(case, "", dtype, interpret)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", [0, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_matmul_quantized_experts(fmt, case, interpret):
    run_case(case, fmt, jnp.bfloat16, interpret)


@pytest.mark.parametrize("fmt", ["", "int8", "fp8", "int4", "nvfp4", "q8_0", "q4_k", "iq4_xs"])
def test_grouped_matmul_lowers_to_triton_for_the_gpu(fmt):
    """Pallas's lowering to Triton runs on the CPU: decode and prefill tiles of a qwen3-30b-a3b
    expert stack lower without error (the GPU compiles this IR; tests marked gpu run it), GGUF
    blocks (--weights gguf keeps MoE experts in them) included."""
    from jax import export
    from infernix_jax.quant.ggml import from_blocks, random_blocks
    E, N, K = 128, 768, 2048
    w = jax.ShapeDtypeStruct((E, N, K), jnp.bfloat16)
    if fmt.startswith(("q", "iq")):              # the arrays' shapes, from one expert's random blocks
        one = from_blocks(fmt, random_blocks(np.random.default_rng(0), fmt, N, K), (N, K))
        args = tuple(jax.ShapeDtypeStruct((E, *a.shape), a.dtype) for a in kernel_args(one))
    else:
        args = jax.eval_shape(lambda w: kernel_args(quantize(w, fmt)) if fmt else (w,), w)
    for T, bm in ((1, 16), (512, 64)):
        P = T * 8
        tiles = -(-P // bm) + min(E, P)
        f = jax.jit(lambda x, r, te, a, bm=bm: gm.grouped_matmul(x, r, te, a, fmt, (E, N, K), bm))
        exp = export.export(f, platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
        text = exp(jax.ShapeDtypeStruct((T, K), jnp.bfloat16), jax.ShapeDtypeStruct((tiles * bm,), jnp.int32),
                   jax.ShapeDtypeStruct((tiles,), jnp.int32), args).mlir_module()
        assert "__gpu$xla.gpu.triton" in text
