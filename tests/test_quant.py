"""Weight formats (infernix_jax/quant): each format's rounding error stays within its own step size
on fresh random weights (odd sizes: partial groups and tiles), exact formats are idempotent, e2m1
rounding matches ml_dtypes, and nothing breaks on all-zero rows."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infernix_jax.quant.formats import E2M1, FORMATS, _e2m1_codes, _pack4, _unpack4, dequantize, quantize


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
    np.testing.assert_array_equal(np.asarray(_unpack4(_pack4(codes))), np.asarray(codes))


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
