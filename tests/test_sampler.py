"""The sampler's filters and draw (engine/sampler.py) against a reference that sorts the vocabulary:
the same kept tokens for random rows and filters, a draw whose frequencies follow the kept tokens'
renormalised probabilities, and a row's draw that does not depend on the rest of its batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.engine.sampler import TOP_K_DIRECT, SamplingArrays, _kept, sample


def kept_by_sorting(x, top_k, top_p, min_p):
    """One row, as the sorted formulation says: the top_k largest, renormalised, then the tokens whose
    mass before them (sorted by probability) is under top_p and whose probability is at least
    min_p times the top one; the top token always."""
    V = x.shape[0]
    order = np.argsort(-x, kind="stable")
    xs = x[order].astype(np.float64)
    if 0 < top_k < V:
        xs[top_k:] = -np.inf
    p = np.exp(xs - xs[0])
    p /= p.sum()
    before = np.cumsum(p) - p
    keep_sorted = (before < top_p) & (p >= min_p * p[0]) & np.isfinite(xs)
    keep_sorted[0] = True
    keep = np.zeros(V, bool)
    keep[order] = keep_sorted
    return keep


def arrays(B, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0):
    f = lambda v, t: np.full((B,), v, t) if np.isscalar(v) else np.asarray(v, t)  # noqa: E731
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(seed), B)), np.uint32)
    return SamplingArrays(keys=keys, temperature=f(temperature, np.float32), top_p=f(top_p, np.float32),
                          top_k=f(top_k, np.int32), min_p=f(min_p, np.float32))


@pytest.mark.parametrize("V", [50, 3000])
def test_kept_tokens_equal_sorting_the_vocabulary(V):
    """Random logits (no ties) and random filters per row, including top_k above the direct limit
    (bisection) and rows with no filter at all."""
    rng = np.random.default_rng(V)
    B = 24
    x = (rng.standard_normal((B, V)) * rng.uniform(0.3, 4, (B, 1))).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40, TOP_K_DIRECT + 7, V - 1, V], B)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1, 1e-6], B)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.5], B)
    got = np.asarray(jax.jit(_kept)(jnp.asarray(x), arrays(B, top_p=top_p, top_k=top_k, min_p=min_p)))
    for b in range(B):
        want = kept_by_sorting(x[b], int(top_k[b]), float(top_p[b]), float(min_p[b]))
        np.testing.assert_array_equal(got[b], want, err_msg=f"row {b}: top_k {top_k[b]}, top_p {top_p[b]}, "
                                                             f"min_p {min_p[b]}")


def test_draws_follow_the_kept_tokens_probabilities():
    """4096 rows of the same 8-token distribution, each with its own key: the kept tokens' frequencies
    match their renormalised probabilities (within 5 standard deviations); dropped tokens never come."""
    logits = np.log(np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01], np.float32))
    B = 4096
    x = jnp.asarray(np.tile(logits, (B, 1)))
    ids = np.asarray(jax.jit(sample)(x, jnp.zeros((B,), jnp.int32), arrays(B, top_p=0.7, seed=1))[0])
    keep = kept_by_sorting(logits, 0, 0.7, 0.0)               # 0.3, 0.2, 0.15, 0.12: mass before < 0.7
    assert keep.tolist() == [True] * 4 + [False] * 4
    p = np.exp(logits) * keep
    p /= p.sum()
    freq = np.bincount(ids, minlength=8) / B
    assert (freq[~keep] == 0).all()
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / B) + 1e-9), (freq, p)


def test_a_rows_draw_does_not_depend_on_its_batch():
    rng = np.random.default_rng(3)
    V, B = 1000, 8
    x = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32) * 2)
    s = arrays(B, temperature=0.8, top_p=rng.choice([1.0, 0.9], B), top_k=rng.choice([0, 50, 400], B), seed=5)
    steps = jnp.arange(B, dtype=jnp.int32)
    together = np.asarray(jax.jit(sample)(x, steps, s)[0])
    for b in range(B):
        one = jax.tree.map(lambda a: a[b:b + 1], s)
        alone = np.asarray(jax.jit(sample)(x[b:b + 1], steps[b:b + 1], one)[0])
        assert alone[0] == together[b]
