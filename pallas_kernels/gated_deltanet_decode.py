"""Gated DeltaNet decode: one token per sequence, the recurrent update of the fp32 state in place, in
Pallas (lowered through Triton on NVIDIA GPUs; `interpret=True` runs it on the CPU for tests).

Grid (batch, value head, dv tile): each program reads a [dk, block_v] slice of its sequence's state
once, decays it, applies the delta rule with its key head (h // (Hv / Hk)) and writes it back over
the input buffer (aliased), so a decode step reads and writes each state exactly once: the step's
roofline is 2 x B x Hv x dk x dv x 4 bytes per linear layer. The delta rule is column-separable
(column j of S only needs column j of v), so the dv tiles are independent; tiling keeps the fp32
slice in registers (a whole 128 x 128 state per program spilled: 7x slower than XLA on an H200)
and gives the GPU B x Hv x dv / block_v programs. Reference: gated_deltanet.gated_delta_rule_recurrent."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import triton_params
from .gated_deltanet import L2_EPS


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref, *, scale: float, l2: bool):
    q = q_ref[...].astype(jnp.float32)                     # [1, dk]
    k = k_ref[...].astype(jnp.float32)                     # [1, dk]
    if l2:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS)
    q = q * scale
    v = v_ref[...].astype(jnp.float32)                     # [1, dv]
    s = s_ref[...] * jnp.exp(g_ref[...].astype(jnp.float32))          # [dk, dv] * [1, 1]
    kt = jnp.transpose(k)                                  # [dk, 1]
    err = v - jnp.sum(s * kt, axis=0, keepdims=True)       # [1, dv]: v - S^T k
    s = s + kt * (b_ref[...].astype(jnp.float32) * err)
    o_ref[...] = jnp.sum(s * jnp.transpose(q), axis=0, keepdims=True)
    s_out_ref[...] = s



@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "interpret", "block_v", "num_warps"),
                   donate_argnames=("state",))
def gated_delta_rule_decode(q, k, v, g, beta, state, use_qk_l2norm: bool = True, interpret: bool = False,
                            block_v: int = 32, num_warps: int = 4):
    """q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; state [B, Hv, dk, dv] fp32 (donated, updated
    in place) -> (o [B, Hv, dv] fp32, state)."""
    B, Hk, dk = k.shape
    Hv, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or Hv % Hk or state.shape != (B, Hv, dk, dv) or g.shape != (B, Hv) \
            or beta.shape != (B, Hv):
        raise ValueError(f"shape mismatch: q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape} "
                         f"state {state.shape}")
    r = Hv // Hk
    bv = min(block_v, dv)
    if dv % bv:
        bv = dv
    kernel = functools.partial(_kernel, scale=dk ** -0.5, l2=use_qk_l2norm)
    row = lambda b, h, j: (b, h // r, 0)                   # noqa: E731  key head of value head h
    one = lambda b, h, j: (b, h, 0)                        # noqa: E731
    o, state = pl.pallas_call(
        kernel,
        grid=(B, Hv, dv // bv),
        in_specs=[pl.BlockSpec((None, 1, dk), row), pl.BlockSpec((None, 1, dk), row),
                  pl.BlockSpec((None, 1, bv), lambda b, h, j: (b, h, j)),
                  pl.BlockSpec((None, 1, 1), one), pl.BlockSpec((None, 1, 1), one),
                  pl.BlockSpec((None, None, dk, bv), lambda b, h, j: (b, h, 0, j))],
        out_specs=[pl.BlockSpec((None, 1, bv), lambda b, h, j: (b, h, j)),
                   pl.BlockSpec((None, None, dk, bv), lambda b, h, j: (b, h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((B, Hv, dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hv, dk, dv), jnp.float32)],
        input_output_aliases={5: 1},
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="gated_delta_rule_decode",
    )(q, k, v, g[..., None], beta[..., None], state.astype(jnp.float32))
    return o, state
