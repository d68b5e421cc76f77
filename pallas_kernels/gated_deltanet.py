"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the gated delta rule in pure jnp.

Two exact references for one sequence, fp32 throughout:
  recurrent  the plain token-by-token recurrence (decode, and the ground truth)
  chunked    the chunk-parallel WY / UT form (prefill): the same maths with one unit-triangular inverse and
             a few matmuls per chunk of C tokens, and a scan over chunks that carries the state
The Pallas prefill kernel mirrors `chunked` chunk by chunk.

The references are jitted (inside a model's step they are inlined): called alone, in the tests and
benches, each shape compiles once instead of op by op.

Shapes: q, k [T, Hk, dk]; v [T, Hv, dv]; g (log decay, <= 0), beta [T, Hv]; state [Hv, dk, dv] fp32.
Value head h reads key head h // (Hv / Hk) (grouped value attention, consecutive). Per value head:
    q^ = l2norm(q) / sqrt(dk), k^ = l2norm(k)
    S_t = exp(g_t) S_{t-1} + k^ (beta_t (v_t - exp(g_t) S_{t-1}^T k^))^T,   o_t = S_t^T q^
Tokens with beta = 0 and g = 0 leave the state untouched: padding is written that way, so it never
leaks into the state."""
from __future__ import annotations

import functools

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


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm",))
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


@jax.jit
def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by doubling the diagonal blocks:
    inv([[X, 0], [B, Y]]) = [[X^-1, 0], [-Y^-1 B X^-1, Y^-1]], log2(C) rounds of batched matmuls.
    Only true inverses of sub-triangles are ever formed (no powers of A, which overflow fp32 when keys
    are alike), and it stays plain matmuls: no LAPACK call, whose nested thread-pool work deadlocks
    XLA:CPU collectives on a mesh of CPU devices, and one order of sums on every device."""
    C = A.shape[-1]
    size = 1 << max(C - 1, 0).bit_length()                  # the next power of two; pad with identity rows
    if size != C:
        A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, size - C), (0, size - C)])
    lead = A.shape[:-2]
    hi = jax.lax.Precision.HIGHEST                          # fp32 products (no TF32 on the GPU)
    inv = jnp.ones((*lead, size, 1, 1), A.dtype)           # [..., nb, s, s] inverses of the diagonal blocks
    s = 1
    while s < size:
        nb = size // (2 * s)
        blocks = jnp.diagonal(A.reshape(*lead, nb, 2 * s, nb, 2 * s), axis1=-4, axis2=-2)
        b = jnp.moveaxis(blocks, -1, -3)[..., s:, :s]       # [..., nb, s, s] the block below the diagonal
        x, y = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = -jnp.matmul(y, jnp.matmul(b, x, precision=hi), precision=hi)
        top = jnp.concatenate([x, jnp.zeros_like(x)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([low, y], axis=-1)], axis=-2)
        s *= 2
    return inv[..., 0, :C, :C]


def chunk_prepare(q, k, v, g, beta, state=None, chunk: int = 64, use_qk_l2norm: bool = True):
    """The chunk-parallel part of the chunked form: everything that needs no state. Returns
    (qg, kd, u, w, qk, decay, state, T): per chunk n and value head h, [N, Hv, C, .] arrays
      qg = q^ exp(gamma)               queries scaled by the decay from the chunk start
      kd = k^ exp(gamma_last - gamma)  keys scaled by the decay to the chunk end
      u, w = (I + A)^-1 (beta v), (I + A)^-1 (beta k^ exp(gamma))   the UT transform
      qk = (q^ k^T) * decay(j -> i), causal [N, Hv, C, C];  decay = exp(gamma_last) [N, Hv]
    and the fp32 initial state. The sequential part (chunk_scan, or the Pallas kernel) is then,
    per chunk: v' = u - w S;  o = qg S + qk v';  S = decay S + kd^T v'."""
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state, use_qk_l2norm)
    T, Hv, dk = k.shape
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
    tinv = unit_lower_inverse(A)                            # (I + A)^-1
    u = tinv @ (v * beta[..., None])                        # [N, Hv, C, dv]
    w = tinv @ (kb * jnp.exp(gamma)[..., None])             # [N, Hv, C, dk]
    qk = jnp.einsum("nhid,nhjd->nhij", q, k) * gam          # causal, diagonal included
    last = gamma[..., -1:]                                  # [N, Hv, 1]
    qg = q * jnp.exp(gamma)[..., None]
    kd = k * jnp.exp(last - gamma)[..., None]
    return qg, kd, u, w, qk, jnp.exp(last[..., 0]), state, T


def chunk_output(o, T: int):
    """[N, Hv, C, dv] per-chunk outputs -> [T, Hv, dv]."""
    N, Hv, C, dv = o.shape
    return jnp.moveaxis(o, 1, 2).reshape(N * C, Hv, dv)[:T]


@functools.partial(jax.jit, static_argnames=("chunk", "use_qk_l2norm"))
def gated_delta_rule_chunked(q, k, v, g, beta, state=None, chunk: int = 64, use_qk_l2norm: bool = True):
    """The chunked (UT) form of the same recurrence -> (o [T, Hv, dv] fp32, final state)."""
    qg, kd, u, w, qk, decay, state, T = chunk_prepare(q, k, v, g, beta, state, chunk, use_qk_l2norm)

    def step(S, x):                                         # S [Hv, dk, dv]
        qc, kc, uc, wc, qkc, dc = x
        v_new = uc - wc @ S                                 # [Hv, C, dv]
        o = qc @ S + qkc @ v_new
        S = S * dc[:, None, None] + jnp.einsum("hcd,hce->hde", kc, v_new)
        return S, o

    state, o = jax.lax.scan(step, state, (qg, kd, u, w, qk, decay))
    return chunk_output(o, T), state
