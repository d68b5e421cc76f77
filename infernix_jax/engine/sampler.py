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


# top_k filters of at most this many tokens find their threshold with lax.top_k; larger ones bisect
TOP_K_DIRECT = 256


def _sortable(x):
    """float32 -> int32 of the same order (for bisecting on values); _from_sortable inverts it."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i >= 0, i, i ^ 0x7FFFFFFF)


def _from_sortable(i):
    return jax.lax.bitcast_convert_type(jnp.where(i >= 0, i, i ^ 0x7FFFFFFF), jnp.float32)


def _bisect(pred, lo, hi, iters: int):
    """The smallest int32 t in [lo, hi] (per row) where pred(t) holds; pred is monotone (false
    below, true from there on) and holds at hi. iters >= log2(hi - lo + 1) makes it exact."""
    def body(_, c):
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)          # floor((lo + hi) / 2) without overflow
        ok = pred(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    return jax.lax.fori_loop(0, iters, body, (lo, hi))[1]


def _kth_largest(x, k):
    """x [B, V] f32, k [B] int32 in 1..V -> [B] the k-th largest value of each row."""
    V = x.shape[-1]
    K = min(V, TOP_K_DIRECT)
    top = jax.lax.top_k(x, K)[0]                                               # [B, K] descending
    direct = jnp.take_along_axis(top, jnp.clip(k - 1, 0, K - 1)[:, None], axis=-1)[:, 0]

    def bisected():         # the largest value v with count(x >= v) >= k, i.e. below the smallest
        xs = _sortable(x)   # t (a sortable int) with count(x >= t) < k
        lo = jnp.full(k.shape, jnp.iinfo(jnp.int32).min, jnp.int32)
        hi = jnp.full(k.shape, jnp.iinfo(jnp.int32).max, jnp.int32)
        t = _bisect(lambda t: (xs >= t[:, None]).sum(-1) < k, lo, hi, 33)
        return _from_sortable(t - 1)
    return jax.lax.cond(jnp.any(k > K), bisected, lambda: direct)


def _top_p_threshold(p, top_p):
    """p [B, V] probabilities, top_p [B] in (0, 1] -> [B] the smallest probability t such that the
    mass of the tokens strictly more likely than t is below top_p: token i is kept iff p_i >= t
    (the tokens sorted by probability, those whose mass before them is under top_p)."""
    B = p.shape[0]
    one = jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32)
    as_f = lambda t: jax.lax.bitcast_convert_type(t, jnp.float32)           # noqa: E731  (t >= 0)
    pred = lambda t: jnp.sum(jnp.where(p > as_f(t)[:, None], p, 0.0), -1) < top_p   # noqa: E731
    return as_f(_bisect(pred, jnp.zeros((B,), jnp.int32), jnp.full((B,), one), 31))


def _kept(x, s: SamplingArrays):
    """x [B, V] temperature-scaled logits -> the tokens top-k, top-p and min-p keep [B, V] bool (the
    most likely always), as sorting by probability would: top-k, then the probabilities renormalised
    over what is left, then top-p and min-p on those."""
    V = x.shape[-1]
    k = s.top_k
    on_k = (k > 0) & (k < V)
    x = jax.lax.cond(jnp.any(on_k), lambda: jnp.where(
        on_k[:, None] & (x < _kth_largest(x, jnp.where(on_k, k, 1))[:, None]), -jnp.inf, x), lambda: x)
    probs = jax.nn.softmax(x, axis=-1)
    top1 = probs.max(-1)
    t_p = jax.lax.cond(jnp.any(s.top_p < 1), lambda: _top_p_threshold(probs, s.top_p),
                       lambda: jnp.zeros_like(s.top_p))
    return ((probs >= jnp.maximum(t_p, s.min_p * top1)[:, None]) & (x > -jnp.inf)) | (probs == top1[:, None])


def _sample_filtered(logits, keys, s: SamplingArrays):
    """Temperature, then the filters (_kept), then a draw from what is left, without sorting the
    vocabulary (a [B, V] sort cost ~90 ms a step at B = 8, V = 49K on the CPU: 7x the rest of this):
    thresholds by lax.top_k and bisection, the draw by the Gumbel-max trick with one noise value per
    token id, so that a row's draw depends on its own key and logits alone."""
    V = logits.shape[-1]
    x = logits / jnp.maximum(s.temperature, 1e-6)[:, None]                  # [B, V]
    g = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(keys)
    return jnp.argmax(jnp.where(_kept(x, s), x + g, -jnp.inf), axis=-1)


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
                           lambda: _sample_filtered(logits, step_keys, s), lambda: greedy)
    tok = jnp.where(s.temperature > 0, sampled, greedy).astype(jnp.int32)
    logp = jax.nn.log_softmax(raw, axis=-1)
    out = (tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
    if want_top:
        top_lp, top_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
        out += (top_ids.astype(jnp.int32), top_lp)
    return out

