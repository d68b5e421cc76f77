"""Sampling inside the jitted step: greedy, temperature, top-k, top-p and min-p, one PRNG stream per
request, and log-probabilities.

Each request's key is fold_in(PRNGKey(seed), n) for its n-th generated token, so a seeded request
draws the same tokens whatever else shares its batch and however steps are grouped."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

TOP_LOGPROBS = 20  # the most top_logprobs a request may ask for (OpenAI's limit)


@struct.dataclass
class SamplingArrays:
    """Per-row sampling parameters, all [B]."""
    keys: jax.Array           # [B, 2] uint32
    temperature: jax.Array    # f32, 0 = greedy
    top_p: jax.Array          # f32
    top_k: jax.Array          # int32, 0 = off
    min_p: jax.Array          # f32, 0 = off


def _sample_sorted(logits, keys, s: SamplingArrays):
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)                                 # [B, V] descending
    x = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    x = jnp.where((s.top_k[:, None] <= 0) | (rank < s.top_k[:, None]), x, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                          # mass strictly before each token
    keep = (before < s.top_p[:, None]) & (probs >= s.min_p[:, None] * probs[:, :1])
    x = jnp.where(keep | (rank == 0), x, -jnp.inf)                       # the top token always survives
    pick = jax.vmap(jax.random.categorical)(keys, x)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]


def sample(logits, steps, s: SamplingArrays, want_top: bool = False):
    """logits [B, V] f32; steps [B] int32 (index of the token being drawn, per request).
    Returns ids [B] int32, their logprobs [B] f32 under the model's (unscaled) distribution, and,
    when want_top, the TOP_LOGPROBS best ids and logprobs [B, TOP_LOGPROBS]."""
    greedy = jnp.argmax(logits, axis=-1)
    step_keys = jax.vmap(jax.random.fold_in)(s.keys, steps)
    sampled = jax.lax.cond(jnp.any(s.temperature > 0),
                           lambda: _sample_sorted(logits, step_keys, s), lambda: greedy)
    tok = jnp.where(s.temperature > 0, sampled, greedy).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = (tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
    if want_top:
        top_lp, top_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
        out += (top_ids.astype(jnp.int32), top_lp)
    return out


def take_rows(s: SamplingArrays, rows) -> SamplingArrays:
    return dataclasses.replace(s, **{f.name: getattr(s, f.name)[rows] for f in dataclasses.fields(s)})
