"""Sampling inside the jitted step: greedy, temperature, top-k, top-p and min-p, one PRNG stream per
request, and log-probabilities.

Each request's key is fold_in(PRNGKey(seed), n) for its n-th generated token, so a seeded request
draws the same tokens whatever else shares its batch and however steps are grouped."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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

    @classmethod
    def greedy(cls, B: int) -> "SamplingArrays":
        """Neutral rows (greedy, no filters): padding, warm-up and benchmarks."""
        return cls(keys=np.zeros((B, 2), np.uint32), temperature=np.zeros((B,), np.float32),
                   top_p=np.ones((B,), np.float32), top_k=np.zeros((B,), np.int32),
                   min_p=np.zeros((B,), np.float32))


@struct.dataclass
class Penalties:
    """Token history of each row, for presence / frequency / repetition penalties.
    out_ids, out_counts [B, L]: distinct generated ids and how often each occurred (padding id = V);
    seen_ids [B, Lp]: ids in the prompt or the output (padding = V); the three scales are [B]."""
    out_ids: jax.Array
    out_counts: jax.Array
    seen_ids: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array

    def dense(self, B: int, V: int):
        """-> counts [B, V] int32 of generated tokens, seen [B, V] bool."""
        rows = jnp.arange(B)[:, None]
        counts = jnp.zeros((B, V), jnp.int32).at[rows, self.out_ids].add(self.out_counts, mode="drop")
        seen = jnp.zeros((B, V), bool).at[rows, self.seen_ids].set(True, mode="drop")
        return counts, seen


def apply_penalties(logits, counts, seen, pen: Penalties):
    """logits [B, V] f32 with vLLM's semantics: repetition first, then frequency and presence."""
    r = pen.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)


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


@struct.dataclass
class ThinkGuard:
    """While a row's thinking block is open, it may neither end nor open a tool call: the EOS ids and
    <tool_call> are banned until </think> (the server's --end-in-thinking refuse). open [B] bool,
    enabled [B] bool (rows that asked for it); banned [K], start, end: token ids."""
    open: jax.Array
    enabled: jax.Array
    banned: jax.Array
    start: jax.Array
    end: jax.Array

    def apply(self, logits):
        ban = jnp.zeros((logits.shape[-1],), bool).at[self.banned].set(True)
        return jnp.where(self.open[:, None] & ban[None, :], -jnp.inf, logits)

    def after(self, tok) -> "ThinkGuard":
        """The state after each row drew tok [B]."""
        is_open = self.enabled & ((self.open | (tok == self.start)) & (tok != self.end))
        return self.replace(open=is_open)


def apply_allowed(logits, allowed):
    """allowed [B, ceil(V/32)] int32 bitmask (bit j of word w allows token 32 w + j) -> logits with
    every other token at -inf (llguidance's layout: little-endian bits)."""
    V = logits.shape[-1]
    bits = jnp.unpackbits(jax.lax.bitcast_convert_type(allowed, jnp.uint8).reshape(allowed.shape[0], -1),
                          axis=-1, bitorder="little")[:, :V]
    return jnp.where(bits.astype(bool), logits, -jnp.inf)


def sample(logits, steps, s: SamplingArrays, want_top: bool = False, penalties=None, allowed=None, guard=None):
    """logits [B, V] f32; steps [B] int32 (index of the token being drawn, per request);
    penalties: None or (counts [B, V], seen [B, V], Penalties); allowed: None or a token bitmask
    [B, ceil(V/32)] int32 (constrained decoding; logprobs stay those of the unconstrained model);
    guard: None or a ThinkGuard.
    Returns ids [B] int32, their logprobs [B] f32 under the model's (unscaled) distribution, and,
    when want_top, the TOP_LOGPROBS best ids and logprobs [B, TOP_LOGPROBS]."""
    if penalties is not None:
        logits = apply_penalties(logits, *penalties)
    raw = logits
    if allowed is not None:
        logits = apply_allowed(logits, allowed)
    if guard is not None:
        logits = guard.apply(logits)
    greedy = jnp.argmax(logits, axis=-1)
    step_keys = jax.vmap(jax.random.fold_in)(s.keys, steps)
    sampled = jax.lax.cond(jnp.any(s.temperature > 0),
                           lambda: _sample_sorted(logits, step_keys, s), lambda: greedy)
    tok = jnp.where(s.temperature > 0, sampled, greedy).astype(jnp.int32)
    logp = jax.nn.log_softmax(raw, axis=-1)
    out = (tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
    if want_top:
        top_lp, top_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
        out += (top_ids.astype(jnp.int32), top_lp)
    return out

