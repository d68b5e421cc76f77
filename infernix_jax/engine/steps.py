"""The jitted entry points. Shapes reaching them are bucketed by the caller (see `bucket`), so the
number of compilations stays small; the cache is donated so XLA updates it in place."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..models.llama import KVCache, forward, logits_from_hidden
from .sampler import sample


def bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n (at least `minimum`)."""
    b = minimum
    while b < n:
        b *= 2
    return b


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(params, cfg: ModelConfig, tokens, lengths, cache: KVCache, keys, temperature, top_p, top_k):
    """tokens [B, T] right-padded, lengths [B] -> first sampled token [B], its logprob [B], cache."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, cache = forward(params, cfg, tokens, positions, cache)
    last = h[jnp.arange(B), lengths - 1]                                  # [B, H]
    logits = logits_from_hidden(params, cfg, last)
    tok, lp = sample(logits, keys, jnp.zeros((B,), jnp.int32), temperature, top_p, top_k)
    return tok, lp, cache


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode(params, cfg: ModelConfig, tokens, positions, steps, cache: KVCache, keys, temperature, top_p, top_k):
    """tokens, positions, steps [B] -> next token [B], its logprob [B], cache."""
    h, cache = forward(params, cfg, tokens[:, None], positions[:, None], cache)
    logits = logits_from_hidden(params, cfg, h[:, 0])
    tok, lp = sample(logits, keys, steps, temperature, top_p, top_k)
    return tok, lp, cache


@partial(jax.jit, static_argnames=("cfg",))
def full_logprobs(params, cfg: ModelConfig, tokens, cache: KVCache):
    """tokens [1, T] -> log-probabilities [1, T, V] f32 of the next token at every position."""
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    h, _ = forward(params, cfg, tokens, positions, cache)
    return jax.nn.log_softmax(logits_from_hidden(params, cfg, h), axis=-1)
