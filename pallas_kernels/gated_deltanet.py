"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the gated delta rule in pure jnp.

Two exact references for one sequence, fp32 throughout:
  recurrent  the plain token-by-token recurrence (decode, and the ground truth)
  chunked    the chunk-parallel WY / UT form (prefill): the same maths with one triangular solve and
             a few matmuls per chunk of C tokens, and a scan over chunks that carries the state
The Pallas prefill kernel mirrors `chunked` chunk by chunk.

Shapes: q, k [T, Hk, dk]; v [T, Hv, dv]; g (log decay, <= 0), beta [T, Hv]; state [Hv, dk, dv] fp32.
Value head h reads key head h // (Hv / Hk) (grouped value attention, consecutive). Per value head:
    q^ = l2norm(q) / sqrt(dk), k^ = l2norm(k)
    S_t = exp(g_t) S_{t-1} + k^ (beta_t (v_t - exp(g_t) S_{t-1}^T k^))^T,   o_t = S_t^T q^
Tokens with beta = 0 and g = 0 leave the state untouched: padding is written that way, so it never
leaks into the state."""
from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2norm(x, eps: float = L2_EPS):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, state, use_qk_l2norm: bool):
    """-> fp32 q^, k^ expanded to the value heads [T, Hv, dk], v [T, Hv, dv], g, beta [T, Hv], state."""
    Hk, Hv = k.shape[1], v.shape[1]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    q, k = jnp.repeat(q, Hv // Hk, axis=1), jnp.repeat(k, Hv // Hk, axis=1)
    if state is None:
        state = jnp.zeros((Hv, k.shape[-1], v.shape[-1]), jnp.float32)
    return q, k, v, g, beta, state.astype(jnp.float32)


def gated_delta_rule_recurrent(q, k, v, g, beta, state=None, use_qk_l2norm: bool = True):
    """-> (o [T, Hv, dv] fp32, final state [Hv, dk, dv] fp32)."""
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state, use_qk_l2norm)

    def step(S, x):                                         # S [Hv, dk, dv]
        qt, kt, vt, gt, bt = x                              # [Hv, dk], [Hv, dk], [Hv, dv], [Hv], [Hv]
        S = S * jnp.exp(gt)[:, None, None]
        err = vt - jnp.einsum("hkv,hk->hv", S, kt)          # v - S^T k
        S = S + kt[:, :, None] * (bt[:, None] * err)[:, None, :]
        return S, jnp.einsum("hkv,hk->hv", S, qt)

    state, o = jax.lax.scan(step, state, (q, k, v, g, beta))
    return o, state


def gated_delta_rule_chunked(q, k, v, g, beta, state=None, chunk: int = 64, use_qk_l2norm: bool = True):
    """The chunked (UT) form of the same recurrence -> (o [T, Hv, dv] fp32, final state)."""
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state, use_qk_l2norm)
    T, Hv, dk = k.shape
    dv = v.shape[-1]
    pad = -T % chunk
    if pad:                                                 # beta = g = 0 (and k = 0): no effect on the state
        q, k, v, g, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    N, C = (T + pad) // chunk, chunk

    def split(x):                                           # [N*C, Hv, ...] -> [N, Hv, C, ...]
        return jnp.moveaxis(x.reshape(N, C, *x.shape[1:]), 2, 1)
    q, k, v, g, beta = map(split, (q, k, v, g, beta))      # [N, Hv, C, d] / [N, Hv, C]

    gamma = jnp.cumsum(g, axis=-1)                          # [N, Hv, C] log decay from the chunk start
    lower = jnp.tril(jnp.ones((C, C), bool))                # j <= i
    diff = jnp.where(lower, gamma[..., :, None] - gamma[..., None, :], -jnp.inf)
    gam = jnp.exp(diff)                                     # [N, Hv, C, C] decay from j to i (0 above)
    kb = k * beta[..., None]
    A = jnp.einsum("nhid,nhjd->nhij", kb, k) * gam
    A = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), A, 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    tinv = jax.scipy.linalg.solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True,
                                             unit_diagonal=True)          # (I + A)^-1
    u = tinv @ (v * beta[..., None])                        # [N, Hv, C, dv]
    w = tinv @ (kb * jnp.exp(gamma)[..., None])             # [N, Hv, C, dk]
    qk = jnp.einsum("nhid,nhjd->nhij", q, k) * gam          # causal, diagonal included

    def step(S, x):                                         # S [Hv, dk, dv]
        qc, kc, uc, wc, qkc, gc = x
        v_new = uc - wc @ S                                 # [Hv, C, dv]
        o = (qc * jnp.exp(gc)[..., None]) @ S + qkc @ v_new
        last = gc[:, -1]                                    # [Hv]
        S = S * jnp.exp(last)[:, None, None] + jnp.einsum(
            "hcd,hce->hde", kc * jnp.exp(last[:, None] - gc)[..., None], v_new)
        return S, o

    state, o = jax.lax.scan(step, state, (q, k, u, w, qk, gamma))
    o = jnp.moveaxis(o, 1, 2).reshape(N * C, Hv, dv)[:T]    # [T, Hv, dv]
    return o, state
