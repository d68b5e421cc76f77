"""Sampling inside the jitted step: greedy, temperature, top-k and top-p, one PRNG stream per request.

Each request's key is fold_in(PRNGKey(seed), step), so a seeded request draws the same tokens
whatever else shares its batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _sample_sorted(logits, keys, temperature, top_p, top_k):
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)                                 # [B, V] descending
    s = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    s = jnp.where(keep, s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                          # mass strictly before each token
    s = jnp.where(before < top_p[:, None], s, -jnp.inf)                   # the top token always survives
    pick = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, s)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]


def sample(logits, keys, steps, temperature, top_p, top_k):
    """logits [B, V] f32; keys [B, 2] uint32; steps [B] int32; temperature/top_p [B] f32; top_k [B] int32.
    Returns token ids [B] int32 and their log-probabilities [B] f32 under the unscaled distribution."""
    greedy = jnp.argmax(logits, axis=-1)
    step_keys = jax.vmap(jax.random.fold_in)(keys, steps)
    sampled = jax.lax.cond(jnp.any(temperature > 0),
                           lambda: _sample_sorted(logits, step_keys, temperature, top_p, top_k),
                           lambda: greedy)
    tok = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
