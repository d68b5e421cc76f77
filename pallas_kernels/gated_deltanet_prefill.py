"""Gated DeltaNet prefill in Pallas: the sequential inter-chunk pass of the chunked (UT) form.

gated_deltanet.chunk_prepare computes everything that needs no state, for all chunks at once (big
batched matmuls and one triangular solve per chunk: XLA does those well). What remains is a
recurrence over chunks; in jnp it is a lax.scan whose every step is a few small kernel launches
(40 us per 64-token chunk at Qwen3.5-27B's shape on an H200). Here one program per (value head,
dv tile) walks all chunks with its [dk, block_v] slice of the fp32 state in registers:
    v' = u - w S;   o = qg S + qk v';   S = decay S + kd^T v'
The delta rule is column-separable in dv, so the tiles are independent. Reference:
gated_deltanet.gated_delta_rule_chunked (the same maths as a scan); interpret=True runs on the CPU."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import triton_params
from .gated_deltanet import chunk_output, chunk_prepare


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """a [k, m]^T x b [k, n] -> [m, n]."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(qg_ref, kd_ref, u_ref, w_ref, qk_ref, dec_ref, s0_ref, o_ref, s_ref, *, n_chunks: int):
    # qg, kd, w [N, C, dk]; u, o [N, C, bv]; qk [N, C, C]; dec [N]; s0, s [dk, bv]   (one head, one tile)
    def body(n, S):
        v_new = u_ref[n] - _dot(w_ref[n], S)                              # [C, bv]
        o_ref[n] = _dot(qg_ref[n], S) + _dot(qk_ref[n], v_new)
        return S * dec_ref[n] + _dot_tn(kd_ref[n], v_new)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...])



@functools.partial(jax.jit, static_argnames=("chunk", "use_qk_l2norm", "interpret", "block_v", "num_warps",
                                             "num_stages"))
def gated_delta_rule_chunked_pallas(q, k, v, g, beta, state=None, chunk: int = 64, use_qk_l2norm: bool = True,
                                    interpret: bool = False, block_v: int = 64, num_warps: int = 4,
                                    num_stages: int = 2):
    """Same contract as gated_deltanet.gated_delta_rule_chunked: q, k [T, Hk, dk]; v [T, Hv, dv];
    g, beta [T, Hv]; state [Hv, dk, dv] or None -> (o [T, Hv, dv] fp32, final state fp32).
    block_v 64 / 4 warps: the best of the sweep at Qwen3.5-27B's shape on an H200 (docs/benchmarks.md)."""
    qg, kd, u, w, qk, decay, state, T = chunk_prepare(q, k, v, g, beta, state, chunk, use_qk_l2norm)
    N, Hv, C, dk = w.shape
    dv = u.shape[-1]
    bv = block_v if dv % block_v == 0 else dv
    head = lambda h, j: (0, h, 0, 0)                                      # noqa: E731
    tile = lambda h, j: (0, h, 0, j)                                      # noqa: E731
    o, state = pl.pallas_call(
        functools.partial(_kernel, n_chunks=N),
        grid=(Hv, dv // bv),
        in_specs=[pl.BlockSpec((N, None, C, dk), head), pl.BlockSpec((N, None, C, dk), head),
                  pl.BlockSpec((N, None, C, bv), tile), pl.BlockSpec((N, None, C, dk), head),
                  pl.BlockSpec((N, None, C, C), head), pl.BlockSpec((N, None), lambda h, j: (0, h)),
                  pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j))],
        out_specs=[pl.BlockSpec((N, None, C, bv), tile), pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((N, Hv, C, dv), jnp.float32),
                   jax.ShapeDtypeStruct((Hv, dk, dv), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        name="gated_delta_rule_chunks",
    )(qg, kd, u, w, qk, decay, state)
    return chunk_output(o, T), state
