"""Gated DeltaNet references against transformers' own (qwen3_next's torch recurrent and chunked
gated delta rule), on fresh random inputs at lengths that are not multiples of the chunk."""
import numpy as np
import pytest

from pallas_kernels import gated_deltanet as gdn



def _inputs(rng, T, Hk=2, Hv=4, dk=16, dv=24):
    q = rng.standard_normal((T, Hk, dk)).astype(np.float32)
    k = rng.standard_normal((T, Hk, dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((T, Hv)))).astype(np.float32) * 0.3     # -softplus: <= 0
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, Hv))))).astype(np.float32)
    state = rng.standard_normal((Hv, dk, dv)).astype(np.float32) * 0.1
    return q, k, v, g, beta, state


def _hf(fn, q, k, v, g, beta, state, **kw):
    torch = pytest.importorskip("torch")       # not on bare GPU machines: the kernel tests run there
    t = [torch.from_numpy(x)[None] for x in (q, k, v, g, beta)]
    o, s = fn(*t, initial_state=torch.from_numpy(state)[None], output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)
    return o[0].numpy(), s[0].numpy()


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130, 300])
def test_recurrent_and_chunked_match_transformers(T):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    rng = np.random.default_rng(T)
    x = _inputs(rng, T)
    want_o, want_s = _hf(hf.torch_recurrent_gated_delta_rule, *x)
    chunk_o, chunk_s = _hf(hf.torch_chunk_gated_delta_rule, *x, chunk_size=64)
    np.testing.assert_allclose(chunk_o, want_o, rtol=1e-4, atol=1e-4)      # HF's two forms agree
    for fn in (gdn.gated_delta_rule_recurrent, gdn.gated_delta_rule_chunked):
        o, s = fn(*x)
        np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-4, atol=1e-4, err_msg=fn.__name__)
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-4, atol=1e-4, err_msg=fn.__name__)


@pytest.mark.parametrize("C", [1, 5, 16, 48, 64])
def test_unit_lower_inverse_matches_numpy(C):
    """(I + A)^-1 by block doubling equals numpy's inverse (float64) for random strictly-lower A and
    for nearly equal keys (A ~ ones below the diagonal), where a power series would overflow fp32."""
    rng = np.random.default_rng(C)
    alike = np.tril(np.full((C, C), 0.99, np.float32), -1)[None, None]
    random = np.tril(rng.standard_normal((3, 2, C, C)).astype(np.float32) * 0.3, -1)
    for A in (random, alike):
        want = np.linalg.inv(np.eye(C) + A.astype(np.float64))
        got = np.asarray(gdn.unit_lower_inverse(A))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("split,chunk", [(117, 64), (1, 16), (64, 64), (299, 32)])
def test_state_carried_across_prefill_chunks(split, chunk):
    """A prefill cut at any position, the state carried over, equals one pass (chunked prefill)."""
    rng = np.random.default_rng(split)
    q, k, v, g, beta, s0 = _inputs(rng, 300)
    full_o, full_s = gdn.gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    a_o, a_s = gdn.gated_delta_rule_chunked(q[:split], k[:split], v[:split], g[:split], beta[:split], s0, chunk=chunk)
    b_o, b_s = gdn.gated_delta_rule_chunked(q[split:], k[split:], v[split:], g[split:], beta[split:], a_s,
                                            chunk=chunk)
    np.testing.assert_allclose(np.concatenate([a_o, b_o]), np.asarray(full_o), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(b_s), np.asarray(full_s), rtol=1e-4, atol=1e-4)


MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Hk,Hv,dk,dv", [(2, 4, 16, 32), (4, 4, 32, 16), (1, 8, 128, 128)])
def test_decode_kernel_matches_the_recurrence(interpret, dtype, Hk, Hv, dk, dv):
    """Five decode steps of the Pallas kernel (state updated in place) against the jnp recurrence,
    on fresh random inputs for a batch of 3 sequences with their own states."""
    import jax.numpy as jnp
    from pallas_kernels.gated_deltanet_decode import gated_delta_rule_decode
    rng = np.random.default_rng(Hk * 100 + dk)
    B, steps = 3, 5
    xs = [_inputs(rng, steps, Hk, Hv, dk, dv) for _ in range(B)]
    dt = jnp.dtype(dtype)
    q, k, v = (jnp.asarray(np.stack([x[i] for x in xs], 1), dt) for i in range(3))     # [steps, B, H, d]
    g, beta = (jnp.asarray(np.stack([x[i] for x in xs], 1)) for i in (3, 4))           # [steps, B, Hv]
    s0 = np.stack([x[5] for x in xs])                                                   # [B, Hv, dk, dv]
    state = jnp.asarray(s0)
    outs = []
    for t in range(steps):
        o, state = gated_delta_rule_decode(q[t], k[t], v[t], g[t], beta[t], state, interpret=interpret)
        outs.append(np.asarray(o))
    for b in range(B):
        o_ref, s_ref = gdn.gated_delta_rule_recurrent(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], jnp.asarray(s0[b]))
        np.testing.assert_allclose(np.stack(outs)[:, b], np.asarray(o_ref), rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_allclose(np.asarray(state)[b], np.asarray(s_ref), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("T,Hk,Hv,dk,dv", [(1, 2, 4, 16, 32), (63, 2, 2, 32, 16), (130, 1, 2, 16, 64),
                                           (300, 2, 4, 32, 32)])
def test_pallas_chunked_prefill_matches_the_recurrence(interpret, T, Hk, Hv, dk, dv):
    """The Pallas inter-chunk kernel (chunk 64, lengths that are not multiples of it, an incoming
    state) against the plain recurrence, fp32 on fresh random inputs; vmapped over a batch of 2."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.gated_deltanet_prefill import gated_delta_rule_chunked_pallas
    rng = np.random.default_rng(T * 7 + dv)
    xs = [_inputs(rng, T, Hk, Hv, dk, dv) for _ in range(2)]
    batch = [jnp.asarray(np.stack([x[i] for x in xs])) for i in range(6)]
    o, s = jax.vmap(lambda *a: gated_delta_rule_chunked_pallas(*a, interpret=interpret, block_v=16))(*batch)
    for b, x in enumerate(xs):
        o_ref, s_ref = gdn.gated_delta_rule_recurrent(*map(jnp.asarray, x))
        np.testing.assert_allclose(np.asarray(o[b]), np.asarray(o_ref), rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(np.asarray(s[b]), np.asarray(s_ref), rtol=2e-4, atol=2e-4)
