"""Weight formats (infernix_jax/quant): each format's rounding error stays within its own step size
on fresh random weights (odd sizes: partial groups and tiles), exact formats are idempotent, e2m1
rounding matches ml_dtypes, and nothing breaks on all-zero rows."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infernix_jax.quant.formats import E2M1, FORMATS, _e2m1_codes, dequantize, quantize
from pallas_kernels.ggml_blocks import unpack_bits
from pallas_kernels.quant_reference import pack4


def weights(seed, shape=(2, 72, 200)):
    # heavy-ish tails and one outlier row, as real weights have
    w = jax.random.t(jax.random.PRNGKey(seed), 5.0, shape) * 0.02
    return w.at[0, 3].multiply(40.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_error_stays_within_the_format_step(fmt):
    w = weights(1)
    q = quantize(w, fmt)
    assert q.shape == w.shape and dequantize(q).shape == w.shape
    err = np.abs(np.asarray(dequantize(q)) - np.asarray(w))
    a = np.abs(np.asarray(w))
    amax_row = a.max(-1, keepdims=True)
    if fmt == "int8":
        bound = amax_row / 127 / 2
    elif fmt == "int4":
        g = np.pad(np.asarray(w), [(0, 0), (0, 0), (0, -200 % 128)]).reshape(2, 72, -1, 128)
        span = np.maximum(g.max(-1), 0) - np.minimum(g.min(-1), 0)
        bound = np.repeat(span / 15 / 2, 128, -1)[..., :200]
    elif fmt == "nvfp4":
        # e2m1's widest gap is 2 (between 4 and 6) times the block's scale, and the block scale itself
        # is rounded to e4m3 (3 mantissa bits)
        g = np.pad(a, [(0, 0), (0, 0), (0, -200 % 16)]).reshape(2, 72, -1, 16)
        bound = np.repeat(g.max(-1) / 6 * (1 + 2 ** -3), 16, -1)[..., :200] * 1.0 + a * 2 ** -3
    else:   # e4m3 (3 mantissa bits): relative 2^-4, absolute near its subnormals
        bound = a * 2 ** -4 + amax_row * 2 ** -12      # (e4m3's smallest step is 2^-9 of 448 / 448 ...)
    assert (err <= bound * (1 + 1e-5) + 1e-12).all(), float((err - bound).max())
    assert float(np.sqrt((err ** 2).mean())) < float(np.sqrt((np.asarray(w) ** 2).mean()))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8b", "mxfp8"])
def test_exact_formats_are_idempotent(fmt):
    dq = dequantize(quantize(weights(2), fmt))      # representable values come back (to f32 rounding)
    np.testing.assert_allclose(np.asarray(dequantize(quantize(dq, fmt))), np.asarray(dq), rtol=1e-6, atol=0)


def test_e2m1_rounding_matches_ml_dtypes_and_packing_round_trips():
    x = np.array(jax.random.uniform(jax.random.PRNGKey(3), (4096,), minval=-6.5, maxval=6.5))
    x[:8] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5]          # the ties
    got = E2M1[np.asarray(_e2m1_codes(jnp.asarray(x)))]
    want = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    codes = jax.random.randint(jax.random.PRNGKey(4), (3, 10), 0, 16).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(unpack_bits(pack4(codes), 4)), np.asarray(codes))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows_and_bytes(fmt):
    w = weights(5, (64, 96)).at[7].set(0.0)
    q = quantize(w, fmt)
    dq = np.asarray(dequantize(q, jnp.bfloat16).astype(jnp.float32))
    assert np.isfinite(dq).all() and (dq[7] == 0).all()
    bits = q.nbytes * 8 / w.size
    assert bits <= {"int8": 8.6, "fp8": 8.6, "fp8b": 8.1, "mxfp8": 8.3, "int4": 4.7, "nvfp4": 4.6}[fmt]


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        quantize(jnp.ones((4, 4)), "int3")


# ---- a quantized model (--weights) ------------------------------------------------------------
TEXT = ("The river Tagus rises in the mountains of eastern Spain and flows west through Toledo before "
        "it reaches the Atlantic at Lisbon, where its estuary forms one of the largest natural harbours")
# mean KL (nats/token) to the exact model and top-token agreement over this text's 35 tokens: about
# twice / a bit under what round-to-nearest measured for SmolLM2-135M (float32) on 2026-12-03:
# int8 0.005 / 0.94, fp8 0.028 / 0.86, fp8b 0.050 / 0.86, mxfp8 0.026 / 0.94, int4 0.56 / 0.57,
# nvfp4 0.33 / 0.69 (a 135M model is far more sensitive than the 8B-class ones)
KL_BOUND = {"int8": 0.01, "fp8": 0.06, "fp8b": 0.1, "mxfp8": 0.06, "int4": 1.1, "nvfp4": 0.7}
TOP_BOUND = {"int8": 0.9, "fp8": 0.8, "fp8b": 0.8, "mxfp8": 0.9, "int4": 0.5, "nvfp4": 0.6}


@pytest.fixture(scope="module")
def exact_logprobs(smollm):
    return _logprobs(smollm.params, smollm)


def _logprobs(params, model):
    from infernix_jax.engine.steps import full_logprobs
    from infernix_jax.models import init_cache
    ids = model.tokenizer.encode(TEXT)
    lp = full_logprobs(params, model.cfg, jnp.asarray([ids]), init_cache(model.cfg, 1, len(ids), model.dtype))
    return np.asarray(lp[0], np.float64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_smollm_stays_close_to_the_exact_model(smollm, exact_logprobs, fmt):
    from infernix_jax.quant.apply import quantize_params
    from infernix_jax.quant.formats import QTensor
    params = quantize_params(smollm.params, fmt, progress=False)
    assert isinstance(params["layers"][0]["w_down"], QTensor) and not isinstance(params["embed"], QTensor)
    lp = _logprobs(params, smollm)
    kl = float((np.exp(exact_logprobs) * (exact_logprobs - lp)).sum(-1).mean())
    top = float((exact_logprobs.argmax(-1) == lp.argmax(-1)).mean())
    assert 0 < kl < KL_BOUND[fmt], kl
    assert top >= TOP_BOUND[fmt], top


@pytest.mark.extended
def test_a_quantized_model_serves_and_plans_smaller(smollm):
    import dataclasses
    from infernix_jax.engine import Engine, Request, SamplingParams
    from infernix_jax.engine.plan import make_plan
    from infernix_jax.quant.apply import quantize_params
    model = dataclasses.replace(smollm, params=quantize_params(smollm.params, "int8", progress=False),
                                weights_format="int8")
    eng = Engine(model, max_num_seqs=2, max_model_len=256)
    exact = Engine(smollm, max_num_seqs=2, max_model_len=256)
    ids = smollm.tokenizer.encode(TEXT)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = eng.generate([Request(ids, p)])[0]
    assert len(got.token_ids) == 8
    assert got.token_ids[:4] == exact.generate([Request(ids, p)])[0].token_ids[:4]
    assert eng.fingerprint != exact.fingerprint          # prefix caches never mix the two
    full = make_plan(smollm.cfg, smollm.dtype, max_model_len=256, max_num_seqs=2)
    q4 = make_plan(smollm.cfg, smollm.dtype, max_model_len=256, max_num_seqs=2, weights_format="int4")
    assert q4.weights_bytes < full.weights_bytes


# ---- lossless 12-bit packing (--weights bf16p) -----------------------------------------------
def test_bf16p_round_trips_every_bit():
    from infernix_jax.quant.packed import pack, unpack
    w = (jax.random.t(jax.random.PRNGKey(11), 5.0, (3, 40, 301)) * 0.02).astype(jnp.bfloat16)
    special = jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan, 1e-38, 3e4, -1e-30], jnp.bfloat16)
    w = w.at[1, 2, :8].set(special)
    p = pack(w)
    back = np.asarray(unpack(p))
    np.testing.assert_array_equal(back.view(np.uint16), np.asarray(w).view(np.uint16))
    assert 0 < p.esc_idx.shape[0] < 40                      # the specials, not the bulk
    assert p.nbytes <= w.size * 1.5 + 6 * p.esc_idx.shape[0] + 3 * 40 + 8


def test_bf16p_needs_bfloat16(smollm):
    from infernix_jax.loader import load_model
    from infernix_jax.quant.packed import pack
    from infernix_jax.weights import ModelLoadError
    with pytest.raises(ValueError, match="bf16p packs bfloat16 weights"):
        pack(np.ones((4, 4), np.float32))
    with pytest.raises(ModelLoadError, match="add --dtype bfloat16"):
        load_model(str(smollm.path), weights="bf16p")


@pytest.mark.extended
def test_bf16p_model_is_bit_identical_to_plain_bf16(smollm):
    from infernix_jax.engine import Engine, Request, SamplingParams
    from infernix_jax.loader import load_model
    from infernix_jax.quant.packed import report
    from infernix_jax.quality import window_logprobs
    plain = load_model(str(smollm.path), dtype="bfloat16")
    packed = load_model(str(smollm.path), dtype="bfloat16", weights="bf16p")
    bf16, size, esc = report(packed.params)
    assert size < 0.76 * bf16 and esc > 0
    ids = smollm.tokenizer.encode(TEXT)
    a = window_logprobs(plain.params, plain.cfg, ids, plain.dtype, "reference")
    b = window_logprobs(packed.params, packed.cfg, ids, packed.dtype, "reference")
    np.testing.assert_array_equal(a, b)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [Engine(m, max_num_seqs=1, max_model_len=128).generate([Request(ids, p)])[0].token_ids
            for m in (plain, packed)]
    assert outs[0] == outs[1]


@pytest.mark.extended
def test_bf16p_saves_device_memory_at_run_time(smollm):
    """The plan counts 12 bits a weight: the compiled decode must not hold every layer unpacked at
    once beside the packed form (XLA would unpack them all up front; layers._after orders them)."""
    from infernix_jax.engine import steps
    from infernix_jax.engine.sampler import SamplingArrays
    from infernix_jax.loader import load_model
    from infernix_jax.models.kv_pool import init_paged_kv
    total = {}
    for w in (None, "bf16p"):
        m = load_model(str(smollm.path), dtype="bfloat16", weights=w, with_tokenizer=False)
        B, M = 2, 4
        kv = init_paged_kv(m.cfg, B * M + 1, 16, m.dtype)
        args = (m.params, m.cfg, kv, jnp.zeros((B,), jnp.int32), jnp.full((B,), 5, jnp.int32),
                jnp.arange(B * M, dtype=jnp.int32).reshape(B, M), jnp.ones((B,), bool), jnp.zeros((B,), jnp.int32),
                SamplingArrays.greedy(B))
        ma = steps.decode_steps.lower(*args, num_steps=2).compile().memory_analysis()
        total[w] = ma.temp_size_in_bytes + ma.argument_size_in_bytes
    assert total["bf16p"] < total[None] - 30 * 2**20, total       # packing saves ~50 MB here
