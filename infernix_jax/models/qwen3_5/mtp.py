"""The multi-token prediction (MTP) head of Qwen3-Next / Qwen3.5 checkpoints (mtp.*): the drafter of
`--speculative mtp` (MODELS.md section 3; vLLM's qwen3_next_mtp.py).

From the target's final hidden state h_t and the token after it, tok_{t+1}, the head predicts
tok_{t+2}:
    x = fc([pre_norm_embed(embed(tok_{t+1})) ; pre_norm_hidden(h_t)])
    y = mtp.norm(decoder_layer(x))      (a full-attention layer, MoE when the model is, with its own
                                         K/V: one more attention layer in the paged pool)
    logits_{t+2} = lm_head(y)
and, chained, y takes h's place and the drafted token tok's. The row (h_t, tok_{t+1}) sits at
position t, in the target's slot for t (as vLLM's proposer places it; RoPE sees only relative
offsets, so MODELS.md's "position t+1" is the same head). Every position of a sequence gets its row
in the step that computes the target there (`mtp_context`), so the head attends to the whole
sequence as it did in training; the chain's rows past the sequence (`mtp_chain`) write their K/V
in slots that later steps overwrite. `mtp_reference` is the same head on one whole sequence in
plain jnp with a contiguous cache: the tests hold the paged path (and its kernels) to it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...config import ModelConfig
from ...route import Route
from ..kv_pool import PagedKV, num_attention_layers, paged_attend
from ..layers import attention, linear, write_cache
from ..llama.model import logits_from_hidden
from .model import gated_attention, hybrid_mlp, rms_norm_1p


def mtp_input(params, cfg: ModelConfig, h, next_tokens):
    """h [..., H] the hidden state at position t, next_tokens [...] the token at t + 1 -> x [..., H]."""
    m, eps = params["mtp"], cfg.rms_norm_eps
    e = rms_norm_1p(params["embed"][next_tokens], m["pre_norm_embed"], eps)
    hn = rms_norm_1p(h.astype(e.dtype), m["pre_norm_hidden"], eps)
    return linear(jnp.concatenate([e, hn], axis=-1), m["fc"])


def mtp_layer(params, cfg: ModelConfig, x, positions, attend, route: Route | None = None):
    """x [B, T, H], positions [B, T] -> y [B, T, H] after mtp.norm (what lm_head reads, and the h of
    the next chained step). attend(q, k, v) as in gated_attention."""
    m, eps = params["mtp"], cfg.rms_norm_eps
    p = m["layers"][0]
    x = x + gated_attention(cfg, p, rms_norm_1p(x, p["attn_norm"], eps), positions, attend)
    kw = {} if route is None else {"route": route}
    x = x + hybrid_mlp(cfg, p, None, rms_norm_1p(x, p["mlp_norm"], eps), **kw)
    return rms_norm_1p(x, m["norm"], eps)


def _greedy(params, cfg: ModelConfig, y):
    return jnp.argmax(logits_from_hidden(params, cfg, y), axis=-1).astype(jnp.int32)


def mtp_context(params, cfg: ModelConfig, kv: PagedKV, h, next_tokens, positions, slots, block_tables, kv_lens,
                cu_q, route: Route, multi_rows=None, tree=None):
    """The head's rows of one step, laid out as the step's tokens (ragged with cu_q, one per row
    without): h [N, H] the target's hidden at each token, next_tokens [N] the token after it,
    positions [N], slots [N] (the dropped slot: a row whose K/V is not kept). -> (y [N, H], pool)."""
    attend, pools = paged_attend(kv, slots, block_tables, kv_lens, cu_q, route, multi_rows, tree)
    j = num_attention_layers(cfg)                 # the head's K/V: the pool's layer after the model's
    y = mtp_layer(params, cfg, mtp_input(params, cfg, h, next_tokens)[None], positions[None],
                  lambda q, k, v: attend(j, q, k, v), route)
    return y[0], kv.replace(**pools())


def mtp_chain(params, cfg: ModelConfig, kv: PagedKV, y, positions, block_tables, cap, depth: int, route: Route):
    """depth drafts per row, greedy: y [B, H] the head's output at each row's last position
    positions [B] (its argmax is the first draft), then depth - 1 chained steps at the positions
    after it. cap [B]: the row's slots (its blocks' tokens); a step at or past it keeps no K/V and
    reads none that is not there, and the host cuts the draft before it. -> (drafts [B, depth], pool)."""
    bs, dropped = kv.block_size, kv.num_blocks * kv.block_size
    M = block_tables.shape[1]
    j = num_attention_layers(cfg)
    first = _greedy(params, cfg, y)

    def one(carry, i):
        kv, y, d = carry
        pos = positions + i
        blk = jnp.take_along_axis(block_tables, jnp.minimum(pos // bs, M - 1)[:, None], axis=1)[:, 0]
        slots = jnp.where(pos < cap, blk * bs + pos % bs, dropped)
        attend, pools = paged_attend(kv, slots, block_tables, jnp.clip(pos + 1, 1, jnp.maximum(cap, 1)), None, route)
        y = mtp_layer(params, cfg, mtp_input(params, cfg, y, d)[None], pos[None],
                      lambda q, k, v: attend(j, q, k, v), route)[0]
        d = _greedy(params, cfg, y)
        return (kv.replace(**pools()), y, d), d

    if depth == 1:
        return first[:, None], kv
    (kv, _, _), rest = jax.lax.scan(one, (kv, y, first), jnp.arange(1, depth))
    return jnp.concatenate([first[:, None], rest.T], axis=1), kv


def mtp_reference(params, cfg: ModelConfig, h, tokens, depth: int, length=None):
    """The head on one whole sequence, contiguous, in plain jnp: h [T, H] the target's final hidden
    states at positions 0 .. T-1, tokens [T + 1] the sequence's tokens and the one drawn after it
    -> greedy drafts [depth] for positions T + 1 .. T + depth. length (may be traced): the
    sequence is only the first length rows (h and tokens padded past them), so that one compiled
    reference serves every prefix of a sequence."""
    T = h.shape[0]
    n = T if length is None else length
    shape = (1, T + depth, cfg.num_kv_heads, cfg.head_dim)
    cache = [jnp.zeros(shape, h.dtype), jnp.zeros(shape, h.dtype)]

    def attend(q, k, v, pos):      # (rows past n write K/V only at positions the chain overwrites or never sees)
        cache[0], cache[1] = write_cache(cache[0], k, pos), write_cache(cache[1], v, pos)
        return attention(q, cache[0], cache[1], pos)

    pos = jnp.arange(T)[None]
    ys = mtp_layer(params, cfg, mtp_input(params, cfg, h, tokens[1:T + 1])[None], pos,
                   lambda q, k, v: attend(q, k, v, pos))[0]
    y = ys[n - 1]
    drafts = [_greedy(params, cfg, y)]
    for i in range(1, depth):
        pos = jnp.full((1, 1), n - 1 + i)
        y = mtp_layer(params, cfg, mtp_input(params, cfg, y, drafts[-1])[None, None], pos,
                      lambda q, k, v, pos=pos: attend(q, k, v, pos))[0, 0]
        drafts.append(_greedy(params, cfg, y))
    return jnp.stack(drafts)
