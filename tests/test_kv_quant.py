"""Quantized KV pools (pallas_kernels/kv_quant.py, --kv-dtype in progress): codes and one scale per
(head, block), written token by token or a chunk at a time, on fresh random inputs."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant as kq

nKV, P, bs, hd = 2, 6, 16, 8
TABLE = [3, 1, 4]                      # one sequence's blocks, out of order


def slot(p: int) -> int:
    return TABLE[p // bs] * bs + p % bs


def stale_pool(rng, fmt):
    """A pool whose blocks still hold a previous owner's codes and scales."""
    codes = jnp.asarray(rng.integers(0, 100, (nKV, P, bs, kq.code_dims(fmt, hd)))).astype(kq.code_dtype(fmt))
    return codes, jnp.asarray(rng.uniform(1, 2, (nKV, P)), jnp.float32)


def relative_step(fmt):
    """Largest rounding error of one encode, in units of the block scale."""
    return {"int8": 0.5, "int4": 0.5, "fp8": 448 * 2 ** -4}[fmt]


@pytest.mark.parametrize("fmt", kq.KV_FORMATS)
def test_a_prefill_chunk_rounds_each_block_once(fmt):
    rng = np.random.default_rng(1)
    pool, scale = stale_pool(rng, fmt)
    x = rng.normal(size=(40, nKV, hd)).astype(np.float32)
    pool, scale = kq.write(pool, scale, jnp.asarray(x), jnp.asarray([slot(p) for p in range(40)]), fmt)
    got = np.asarray(kq.gather_blocks(pool, scale, jnp.asarray(TABLE), fmt))        # [nKV, 3, bs, hd]
    want = np.zeros_like(got)
    for p in range(40):
        want[:, p // bs, p % bs] = x[p]
    for i in range(3):
        n = min(bs, 40 - i * bs)
        s = np.asarray(scale)[:, TABLE[i]]
        np.testing.assert_allclose(s * kq.QMAX[fmt], np.abs(want[:, i, :n]).max(axis=(1, 2)), rtol=1e-6)
        err = np.abs(got[:, i, :n] - want[:, i, :n]).max(axis=(1, 2))
        assert (err <= s * relative_step(fmt) * 1.0001).all(), (err, s)


@pytest.mark.parametrize("fmt", kq.KV_FORMATS)
def test_decode_writes_grow_the_scale_and_keep_what_the_block_held(fmt):
    rng = np.random.default_rng(2)
    pool, scale = stale_pool(rng, fmt)
    want = np.zeros((nKV, 3, bs, hd), np.float32)
    for p in range(40):                 # growing magnitudes: most tokens raise their block's scale
        y = (rng.normal(size=(1, nKV, hd)) * (1 + p / 5)).astype(np.float32)
        pool, scale = kq.write(pool, scale, jnp.asarray(y), jnp.asarray([slot(p)]), fmt)
        want[:, p // bs, p % bs] = y[0]
    got = np.asarray(kq.gather_blocks(pool, scale, jnp.asarray(TABLE), fmt))
    for i in range(3):
        n = min(bs, 40 - i * bs)
        s = np.asarray(scale)[:, TABLE[i]]
        err = np.abs(got[:, i, :n] - want[:, i, :n]).max(axis=(1, 2))
        # each raise re-rounds the block once: a few steps at most, never a stale value
        assert (err <= 4 * s * relative_step(fmt)).all(), (err, s)


def test_padding_slots_are_dropped_and_untouched_blocks_keep_their_codes():
    rng = np.random.default_rng(3)
    pool, scale = stale_pool(rng, "int8")
    x = jnp.asarray(rng.normal(size=(3, nKV, hd)), jnp.float32)
    new_pool, new_scale = kq.write(pool, scale, x, jnp.asarray([slot(0), P * bs, P * bs + 5]), "int8")
    others = [b for b in range(P) if b != TABLE[0]]
    np.testing.assert_array_equal(np.asarray(new_pool)[:, others], np.asarray(pool)[:, others])
    np.testing.assert_array_equal(np.asarray(new_scale)[:, others], np.asarray(scale)[:, others])
