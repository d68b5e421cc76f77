"""The fused dequantizing matmul (pallas_kernels/quant_matmul.py) against its reference, x @ W^T with W
dequantized (quant_reference.quant_matmul_reference), on fresh random inputs, for every format:
interpret mode on the CPU, compiled on the GPU (marked gpu), and lowered to Triton for the GPU from
the CPU (what the CPU can check of the compiled route).
Tolerances are keyed by dtype: f32 is multiplied exactly, bf16 rounds the output."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.quant.formats import FORMATS, quantize
from infernix_jax.route import Route, use
from pallas_kernels.quant_matmul import BlockSizes, kernel_args, quant_matmul, quant_matmul_reference, unsupported

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
CASES = [  # (M, N, K, block sizes): decode rows, odd row counts, K not a multiple of 128, K splits
    (1, 192, 576, None),
    (37, 128, 256, None),
    (5, 64, 384, BlockSizes(bm=16, bn=32, bk=64, split=3)),
    (130, 96, 512, BlockSizes(bm=64, bn=32, bk=128, split=1)),
    (1, 128, 512, BlockSizes(bm=16, bn=32, bk=256, split=2)),     # two int4 / fp8b groups per K step
]


INTERPRET = Route.named("pallas_interpret")

def weights(seed, shape):
    w = jax.random.t(jax.random.PRNGKey(seed), 5.0, shape) * 0.02     # heavy tails, as real weights
    return w.at[3].multiply(30.0)


def reference(x, q):
    return quant_matmul_reference(x, kernel_args(q), q.fmt, q.shape)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_matmul_matches_the_reference(fmt, case, dtype, interpret):
    M, N, K, bs = CASES[case]
    assert_matches_reference(quantize(weights(case, (N, K)), fmt), M, dtype, bs, interpret, seed=100 + case)


def assert_matches_reference(q, M: int, dtype, bs, interpret: bool, seed: int):
    """The kernel on q for M fresh random rows in dtype, within TOL[dtype] of the reference."""
    x = jax.random.normal(jax.random.PRNGKey(seed), (M, q.shape[1]), jnp.float32).astype(dtype)
    out = quant_matmul(x, kernel_args(q), q.fmt, q.shape, block_sizes=bs, interpret=interpret)
    assert out.shape == (M, q.shape[0]) and out.dtype == dtype
    out, ref = np.asarray(out, np.float32), np.asarray(reference(x, q))
    assert np.isfinite(out).all()
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err <= TOL[dtype], err


def test_every_tile_table_says_where_its_numbers_come_from_and_ends_in_a_catch_all():
    from pallas_kernels import grouped_matmul, quant_matmul
    for table in (quant_matmul.TILES, grouped_matmul.TILES):
        assert all(len(t.source) > 20 for t in table)
        assert table[-1].most_rows is None and table[-1].formats == ()
    assert quant_matmul.for_rows(1, "nvfp4").split == 4 and quant_matmul.for_rows(1, "int8").split == 0
    assert quant_matmul.for_rows(17).bm == 64 and quant_matmul.for_rows(4096).bm == 256


@pytest.mark.extended
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_matmul_lowers_to_triton_for_the_gpu(fmt):
    """Pallas's lowering to Triton runs on the CPU: decode and prefill tiles of a qwen3-8b
    projection lower without error (the GPU compiles this IR; tests marked gpu run it)."""
    assert_lowers_to_triton(quantize(weights(9, (1024, 4096)), fmt), (1, 64, 4096))


def assert_lowers_to_triton(q, rows):
    """The kernel on q for each row count in rows, exported for CUDA from the CPU: its Triton call."""
    from jax import export
    for M in rows:
        f = jax.jit(lambda x, a: quant_matmul(x, a, q.fmt, q.shape))
        exp = export.export(f, platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
        text = exp(jax.ShapeDtypeStruct((M, q.shape[1]), jnp.bfloat16), kernel_args(q)).mlir_module()
        assert "__gpu$xla.gpu.triton" in text


def test_unsupported_shapes_fall_back_to_the_reference():
    from infernix_jax.models.layers import linear
    assert unsupported("int8", (100, 64), jnp.float32)           # N not a multiple of 16
    assert unsupported("int8", (4, 64, 64), jnp.float32)         # stacked experts
    assert unsupported("int8", (64, 64), jnp.bfloat16) is None
    q = quantize(weights(7, (100, 64)), "int8")
    x = jax.random.normal(jax.random.PRNGKey(8), (3, 64))
    with use(INTERPRET):
        np.testing.assert_allclose(np.asarray(linear(x, q)), np.asarray(reference(x, q)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cannot take this weight"):
        quant_matmul(x, kernel_args(q), "int8", q.shape, interpret=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_rows_take_the_kernel_xla_s_fused_gemm_or_dequantization(fmt):
    """linear's three routes for per-channel 8-bit weights (layers.XLA_FUSED_ROWS): the Pallas
    kernel for decode's rows, XLA's GEMM with the codes' conversion fused (no barrier, no kernel)
    between, dequantizing first past it; each within bf16's tolerance of the reference."""
    from infernix_jax.models import layers
    q = quantize(weights(11, (192, 256)), fmt)
    with use(INTERPRET):
        _three_routes(q, layers)


def _three_routes(q, layers):
    lo, hi = layers.XLA_FUSED_ROWS
    for M, route in ((lo, "pallas_call"), (lo + 1, "fused"), (hi, "fused"), (hi + 1, "optimization_barrier")):
        x = jax.random.normal(jax.random.PRNGKey(M), (M, 256), jnp.float32).astype(jnp.bfloat16)
        text = str(jax.make_jaxpr(layers.linear)(x, q))
        for r in ("pallas_call", "optimization_barrier"):
            assert (r in text) == (r == route), (M, r)
        out, ref = np.asarray(layers.linear(x, q), np.float32), np.asarray(reference(x, q))
        assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= TOL[jnp.bfloat16], M
    f32 = jax.random.normal(jax.random.PRNGKey(5), (lo + 1, 256), jnp.float32)    # the lossless route:
    assert "pallas_call" in str(jax.make_jaxpr(layers.linear)(f32, q))            # the kernel's exact f32


def test_an_engine_on_the_kernels_gives_the_reference_tokens(smollm):
    """A tiny quantized model decodes the same greedy tokens through the fused kernels (and the
    Pallas attention kernels, interpreted) as through the reference route."""
    import dataclasses
    from infernix_jax.engine import Engine, Request, SamplingParams
    from infernix_jax.loader import LoadedModel
    from infernix_jax.models import init_params
    from infernix_jax.quant.apply import quantize_params
    cfg = dataclasses.replace(smollm.cfg, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    params = quantize_params(init_params(cfg, jax.random.PRNGKey(0), scale=0.5), "int4", progress=False)
    model = LoadedModel(name="tiny-int4", path=smollm.path, cfg=cfg, params=params, tokenizer=smollm.tokenizer,
                        dtype=smollm.dtype, weights_format="int4")
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 40000, 21)]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = {impl: Engine(model, max_num_seqs=1, max_model_len=64, attn_impl=impl).generate([Request(prompt, p)])
           for impl in ("reference", "pallas_interpret")}
    assert got["pallas_interpret"][0].token_ids == got["reference"][0].token_ids
