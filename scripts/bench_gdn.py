"""infernix-bench gdn: the Gated DeltaNet pieces at a real model's linear-layer shape (GPU).

- decode: one recurrent step for B sequences, the Pallas kernel against the jnp recurrence (XLA),
  as time per layer and as a share of the state-read roofline (each fp32 state [Hv, dk, dv] read
  and written once: 2 x B x Hv x dk x dv x 4 bytes, over the copy bandwidth measured in the same run);
- prefill: the chunked form (chunk 64) at the given lengths, the Pallas inter-chunk kernel against
  the all-jnp version, in ms and tokens/s per layer.
Prints one JSON line per measurement."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp

from pallas_kernels.gated_deltanet import gated_delta_rule_chunked, gated_delta_rule_recurrent
from pallas_kernels.gated_deltanet_decode import gated_delta_rule_decode
from pallas_kernels.gated_deltanet_prefill import gated_delta_rule_chunked_pallas
from scripts.bench_probes import copy_bandwidth, timed

# linear-layer shapes: (key heads, value heads, dk, dv)
SHAPES = {"qwen3.5-27b": (16, 48, 128, 128), "qwen3.5-35b-a3b": (16, 32, 128, 128), "qwen3-next-80b": (16, 32, 128, 128)}


# decode kernel tiles timed (dv columns per program, warps); the kernel's default is (32, 4)
TILES = ((16, 2), (32, 4), (32, 2), (64, 4), (128, 8))


def _inputs(key, B, T, Hk, Hv, dk, dv, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, Hk, dk), dtype)
    k = jax.random.normal(ks[1], (B, T, Hk, dk), dtype)
    v = jax.random.normal(ks[2], (B, T, Hv, dv), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, Hv))) * 0.3
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, Hv)))
    s = jax.random.normal(ks[5], (B, Hv, dk, dv), jnp.float32) * 0.1
    return q, k, v, g, beta, s


def run(shape: str, batches, prefills) -> None:
    Hk, Hv, dk, dv = SHAPES[shape]
    bw = copy_bandwidth()
    print(json.dumps({"shape": shape, "copy_GBps": round(bw / 1e9, 1), "device": jax.devices()[0].device_kind}))
    ref_step = jax.jit(jax.vmap(lambda q, k, v, g, b, s: gated_delta_rule_recurrent(q, k, v, g, b, s)))
    for B in batches:
        q, k, v, g, beta, s = _inputs(jax.random.key(B), B, 1, Hk, Hv, dk, dv)
        t_ref = timed(lambda: ref_step(q, k, v, g, beta, s)[0].block_until_ready(), 50)
        roof = 2 * B * Hv * dk * dv * 4 / bw
        step_in = [x[:, 0] for x in (q, k, v, g, beta)]    # sliced once: no extra dispatches timed
        for block_v, warps in TILES:
            state = [s + 0]                                # the kernel donates (updates in place) its state

            def ours():
                o, state[0] = gated_delta_rule_decode(*step_in, state[0], block_v=block_v, num_warps=warps)
                o.block_until_ready()
            t_ours = timed(ours, 50)
            print(json.dumps({"kind": "gdn_decode", "batch": B, "block_v": block_v, "num_warps": warps,
                              "pallas_us": round(t_ours * 1e6, 1), "jnp_us": round(t_ref * 1e6, 1),
                              "roofline_us": round(roof * 1e6, 1), "pallas_of_roofline": round(roof / t_ours, 3),
                              "speedup_vs_jnp": round(t_ref / t_ours, 2)}), flush=True)
    chunked = jax.jit(jax.vmap(lambda q, k, v, g, b, s: gated_delta_rule_chunked(q, k, v, g, b, s)))
    for T in prefills:
        q, k, v, g, beta, s = _inputs(jax.random.key(T), 1, T, Hk, Hv, dk, dv)
        t_ref = timed(lambda: chunked(q, k, v, g, beta, s)[0].block_until_ready(), 5)
        for block_v, warps in ((64, 4), (32, 4), (32, 2)):        # the kernel's default first
            ours = jax.jit(jax.vmap(lambda q, k, v, g, b, s: gated_delta_rule_chunked_pallas(
                q, k, v, g, b, s, block_v=block_v, num_warps=warps)))
            t = timed(lambda: ours(q, k, v, g, beta, s)[0].block_until_ready(), 5)
            print(json.dumps({"kind": "gdn_prefill", "tokens": T, "block_v": block_v, "num_warps": warps,
                              "pallas_ms": round(t * 1e3, 2), "jnp_chunked_ms": round(t_ref * 1e3, 2),
                              "pallas_tok_s": round(T / t, 1), "speedup_vs_jnp": round(t_ref / t, 2)}), flush=True)
