"""Hybrids (Qwen3-Next, Qwen3.5) over the engine's cache: the full-attention layers use the paged KV
like every other family; the Gated DeltaNet layers keep a fixed-size state per sequence in a state
pool beside it (PagedKV.conv / .ssm, one slot per running sequence).

In a ragged step the flat token axis mixes rows that feed one token (decodes) and rows that feed a
prefill chunk. The recurrence needs each row's tokens in order, so the linear layers gather them
into two layouts (StateRows): one token per row for the decodes (the recurrent step: the Pallas
decode kernel on GPUs), and [rows, T] right-padded for the prefill chunks (the chunked form: its
inter-chunk pass in Pallas on GPUs), then
scatter the outputs back to the flat axis. Padding reads state slot S (out of range: zeros) and
its writes are dropped, and padded tokens get beta = g = 0: nothing leaks into any state.

A verify step (speculative decoding) adds a third layout for the rows that end in drafts: their
known tokens and then the draft nodes (a chain or a tree), run one token at a time as decode runs
them, each node continuing from its parent's state, and the state written back is the one after the
row's last known token. Whatever the target model rejects never reaches the pool: the next step
feeds the accepted tokens again, as known ones (the engine's hybrid rule, engine/spec).
(Snapshots of a slot, for the prefix cache: cache/device.py.)"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from ...config import ModelConfig
from ...route import Route
from ...sharding import constrain
from .model import gated_attention, gdn_core, gdn_inputs, gdn_output, hybrid_mlp, rms_norm_1p
from ..kv_pool import PagedKV, paged_attend


@struct.dataclass
class StateRows:
    """Where each batch row's tokens and state are, for the linear layers of one step.
    dec_tok [B]: flat index of the row's token when it feeds one token (N otherwise: dropped);
    dec_slot [B]: its state slot (S, out of range, for other rows); dec_fresh [B] bool: the row
    starts its sequence here (its state starts at zero, whatever the slot held before).
    pre_tok [Bp, T]: flat indices of the rows that feed several tokens, right-padded with N;
    pre_len, pre_slot, pre_fresh [Bp]. The pre_* fields are None when no row feeds several.
    spec_tok [Bs, Ts]: flat indices of the rows ending in drafts (padded with N), spec_par [Bs, Ts]
    each token's parent's index in its row (-1: the slot's state), spec_commit [Bs] the index whose
    state is written back (the last known token), spec_slot, spec_fresh [Bs]; None without drafts."""
    dec_tok: jax.Array
    dec_slot: jax.Array
    dec_fresh: jax.Array
    pre_tok: jax.Array | None = None
    pre_len: jax.Array | None = None
    pre_slot: jax.Array | None = None
    pre_fresh: jax.Array | None = None
    spec_tok: jax.Array | None = None
    spec_par: jax.Array | None = None
    spec_commit: jax.Array | None = None
    spec_slot: jax.Array | None = None
    spec_fresh: jax.Array | None = None


def _gdn_fns(route: Route):
    """(decode_fn, chunked_fn) for gdn_core: the Pallas kernels, or None for the jnp references."""
    if route.pallas:
        from pallas_kernels.gated_deltanet_decode import gated_delta_rule_decode
        from pallas_kernels.gated_deltanet_prefill import gated_delta_rule_chunked_pallas
        interpret = route.interpret
        return (partial(gated_delta_rule_decode, interpret=interpret),
                partial(gated_delta_rule_chunked_pallas, interpret=interpret))
    return None, None


def _run_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, tok, slot, fresh, lens, fns, out):
    """One layout: tok [R, T] flat indices -> outputs scattered into out [N, Hv, dv], pools updated."""
    take = lambda arr: jnp.take(arr, tok, axis=0, mode="fill", fill_value=0)  # noqa: E731  [R, T, ...]
    cs, ss = _start_states(conv_pool, ssm_pool, slot, fresh)
    o, cs, ss = gdn_core(cfg, p, take(mixed), take(b), take(a), cs, ss, lens, *fns)
    conv_pool = conv_pool.at[slot].set(cs.astype(conv_pool.dtype), mode="drop")
    ssm_pool = ssm_pool.at[slot].set(ss, mode="drop")
    return out.at[tok].set(o, mode="drop"), conv_pool, ssm_pool


def _start_states(conv_pool, ssm_pool, slot, fresh):
    keep = ~fresh
    cs = jnp.take(conv_pool, slot, axis=0, mode="fill", fill_value=0) * keep[:, None, None].astype(conv_pool.dtype)
    ss = jnp.where(keep[:, None, None, None], jnp.take(ssm_pool, slot, axis=0, mode="fill", fill_value=0), 0.0)
    return cs, ss


def _run_spec_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, rows: StateRows, fns, out):
    """The verify layout (module doc): each row's tokens in order, token j from the state after its
    parent spec_par[j] (one decode step each), the state after spec_commit written back."""
    tok, par, commit, slot = rows.spec_tok, rows.spec_par, rows.spec_commit, rows.spec_slot
    R, T = tok.shape
    take = lambda arr: jnp.take(arr, tok, axis=0, mode="fill", fill_value=0)  # noqa: E731  [R, T, ...]
    xm, xb, xa = take(mixed), take(b), take(a)
    cs0, ss0 = _start_states(conv_pool, ssm_pool, slot, rows.spec_fresh)
    cs0 = cs0.astype(xm.dtype)
    r = jnp.arange(R)

    def one(carry, j):
        convs, ssms = carry                              # [R, T, K-1, C], [R, T, Hv, dk, dv]: after each token
        pj = par[:, j]
        at = jnp.clip(pj, 0, T - 1)
        cs = jnp.where((pj < 0)[:, None, None], cs0, convs[r, at])
        ss = jnp.where((pj < 0)[:, None, None, None], ss0, ssms[r, at])
        o, cs, ss = gdn_core(cfg, p, xm[:, j, None], xb[:, j, None], xa[:, j, None], cs, ss, None, *fns)
        return (convs.at[:, j].set(cs), ssms.at[:, j].set(ss)), o[:, 0]

    init = (jnp.zeros((R, T) + cs0.shape[1:], cs0.dtype), jnp.zeros((R, T) + ss0.shape[1:], jnp.float32))
    (convs, ssms), o = jax.lax.scan(one, init, jnp.arange(T))                       # o [T, R, Hv, dv]
    conv_pool = conv_pool.at[slot].set(convs[r, commit].astype(conv_pool.dtype), mode="drop")
    ssm_pool = ssm_pool.at[slot].set(ssms[r, commit], mode="drop")
    return out.at[tok].set(o.swapaxes(0, 1), mode="drop"), conv_pool, ssm_pool


def _gdn_paged(cfg: ModelConfig, p, x, conv_pool, ssm_pool, rows: StateRows, fns):
    """x [N, H] flat -> (output [N, H], conv_pool, ssm_pool)."""
    mixed, z, b, a = (t[0] for t in gdn_inputs(cfg, p, x[None]))      # [N, C], [N, Hv, dv], [N, Hv] x2
    out = jnp.zeros((x.shape[0], cfg.lin_v_heads, cfg.lin_v_dim), jnp.float32)
    out, conv_pool, ssm_pool = _run_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, rows.dec_tok[:, None],
                                         rows.dec_slot, rows.dec_fresh, None, fns, out)
    if rows.pre_tok is not None:
        out, conv_pool, ssm_pool = _run_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, rows.pre_tok,
                                             rows.pre_slot, rows.pre_fresh, rows.pre_len, fns, out)
    if rows.spec_tok is not None:
        out, conv_pool, ssm_pool = _run_spec_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, rows, fns, out)
    return gdn_output(cfg, p, out, z, x.dtype), conv_pool, ssm_pool


def hybrid_forward_paged(params, cfg: ModelConfig, tokens, positions, slots, kv: PagedKV, block_tables, kv_lens,
                         cu_q, route: Route, rows: StateRows, multi_rows=None, tree=None):
    """models.paged.forward_paged for hybrids: tokens, positions, slots [N] -> hidden [N, H], the cache."""
    conv, ssm = list(kv.conv), list(kv.ssm)
    attend, pools = paged_attend(kv, slots, block_tables, kv_lens, cu_q, route, multi_rows, tree)
    fns = _gdn_fns(route)
    eps = cfg.rms_norm_eps
    x = constrain(params["embed"][tokens][None], "batch", "seq", "embed")   # [1, N, H]
    ia = il = 0
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            h = rms_norm_1p(x, p["attn_norm"], eps)
            if cfg.is_linear_layer(i):
                h, conv[il], ssm[il] = _gdn_paged(cfg, p, h[0], conv[il], ssm[il], rows, fns)
                h, il = h[None], il + 1
            else:
                h = gated_attention(cfg, p, h, positions[None], lambda q, k, v, j=ia: attend(j, q, k, v))
                ia += 1
            x = x + h
            x = x + hybrid_mlp(cfg, p, i, rms_norm_1p(x, p["mlp_norm"], eps), route)
            x = constrain(x, "batch", "seq", "embed")
    x = rms_norm_1p(x, params["final_norm"], eps)
    return x[0], kv.replace(**pools(), conv=tuple(conv), ssm=tuple(ssm))
