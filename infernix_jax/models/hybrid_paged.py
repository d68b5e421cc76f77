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

Snapshots: the state of one sequence copied out of its slot (and to host memory and back), so that
the prefix cache can resume a hybrid conversation where a snapshot was taken."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..config import ModelConfig
from ..sharding import constrain
from .hybrid import gated_attention, gdn_core, gdn_inputs, gdn_output, hybrid_mlp, rms_norm_1p
from .kv_pool import PagedKV, paged_attend
from .host_memory import to_device, to_host


@struct.dataclass
class StateRows:
    """Where each batch row's tokens and state are, for the linear layers of one step.
    dec_tok [B]: flat index of the row's token when it feeds one token (N otherwise: dropped);
    dec_slot [B]: its state slot (S, out of range, for other rows); dec_fresh [B] bool: the row
    starts its sequence here (its state starts at zero, whatever the slot held before).
    pre_tok [Bp, T]: flat indices of the rows that feed several tokens, right-padded with N;
    pre_len, pre_slot, pre_fresh [Bp]. The pre_* fields are None when no row feeds several."""
    dec_tok: jax.Array
    dec_slot: jax.Array
    dec_fresh: jax.Array
    pre_tok: jax.Array | None = None
    pre_len: jax.Array | None = None
    pre_slot: jax.Array | None = None
    pre_fresh: jax.Array | None = None


def _gdn_fns(attn_impl: str):
    """(decode_fn, chunked_fn) for gdn_core: the Pallas kernels, or None for the jnp references."""
    if attn_impl in ("pallas", "pallas_interpret"):
        from pallas_kernels.gated_deltanet_decode import gated_delta_rule_decode
        from pallas_kernels.gated_deltanet_prefill import gated_delta_rule_chunked_pallas
        interpret = attn_impl == "pallas_interpret"
        return (partial(gated_delta_rule_decode, interpret=interpret),
                partial(gated_delta_rule_chunked_pallas, interpret=interpret))
    return None, None


def _run_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, tok, slot, fresh, lens, fns, out):
    """One layout: tok [R, T] flat indices -> outputs scattered into out [N, Hv, dv], pools updated."""
    take = lambda arr: jnp.take(arr, tok, axis=0, mode="fill", fill_value=0)  # noqa: E731  [R, T, ...]
    keep = ~fresh
    cs = jnp.take(conv_pool, slot, axis=0, mode="fill", fill_value=0) * keep[:, None, None].astype(conv_pool.dtype)
    ss = jnp.where(keep[:, None, None, None], jnp.take(ssm_pool, slot, axis=0, mode="fill", fill_value=0), 0.0)
    o, cs, ss = gdn_core(cfg, p, take(mixed), take(b), take(a), cs, ss, lens, *fns)
    conv_pool = conv_pool.at[slot].set(cs.astype(conv_pool.dtype), mode="drop")
    ssm_pool = ssm_pool.at[slot].set(ss, mode="drop")
    return out.at[tok].set(o, mode="drop"), conv_pool, ssm_pool


def _gdn_paged(cfg: ModelConfig, p, x, conv_pool, ssm_pool, rows: StateRows, fns):
    """x [N, H] flat -> (output [N, H], conv_pool, ssm_pool)."""
    mixed, z, b, a = (t[0] for t in gdn_inputs(cfg, p, x[None]))      # [N, C], [N, Hv, dv], [N, Hv] x2
    out = jnp.zeros((x.shape[0], cfg.lin_v_heads, cfg.lin_v_dim), jnp.float32)
    out, conv_pool, ssm_pool = _run_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, rows.dec_tok[:, None],
                                         rows.dec_slot, rows.dec_fresh, None, fns, out)
    if rows.pre_tok is not None:
        out, conv_pool, ssm_pool = _run_rows(cfg, p, mixed, b, a, conv_pool, ssm_pool, rows.pre_tok,
                                             rows.pre_slot, rows.pre_fresh, rows.pre_len, fns, out)
    return gdn_output(cfg, p, out, z, x.dtype), conv_pool, ssm_pool


def hybrid_forward_paged(params, cfg: ModelConfig, tokens, positions, slots, kv: PagedKV, block_tables, kv_lens,
                         cu_q, attn_impl: str, rows: StateRows, multi_rows=None):
    """models.paged.forward_paged for hybrids: tokens, positions, slots [N] -> hidden [N, H], the cache."""
    conv, ssm = list(kv.conv), list(kv.ssm)
    attend, pools = paged_attend(kv, slots, block_tables, kv_lens, cu_q, attn_impl, multi_rows)
    fns = _gdn_fns(attn_impl)
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
            x = x + hybrid_mlp(cfg, p, i, rms_norm_1p(x, p["mlp_norm"], eps), attn_impl)
            x = constrain(x, "batch", "seq", "embed")
    x = rms_norm_1p(x, params["final_norm"], eps)
    return x[0], kv.replace(**pools(), conv=tuple(conv), ssm=tuple(ssm))


# ---- snapshots -----------------------------------------------------------------------------------
@struct.dataclass
class StateSnapshot:
    """One sequence's recurrent state after its first num_tokens tokens: conv[j] [K-1, C] and
    ssm[j] [Hv, dk, dv] fp32 per linear layer. The arrays are device arrays (take_snapshot), arrays
    in host memory (to_host: the copy runs in the background) or numpy (loaded from a file);
    restore_snapshot takes any of them. The attention layers' K/V of the same prefix are
    ordinary blocks, found by the block hashes: a snapshot pairs with the hash of its last block."""
    conv: tuple
    ssm: tuple
    num_tokens: int = struct.field(pytree_node=False)

    def to_host(self) -> "StateSnapshot":
        """A copy in host memory (models/host_memory.py), started without waiting for it."""
        conv, ssm = to_host((self.conv, self.ssm))
        return StateSnapshot(conv, ssm, self.num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (*self.conv, *self.ssm))


@jax.jit
def _gather_slot(conv, ssm, slot):
    return tuple(c[slot] for c in conv), tuple(s[slot] for s in ssm)


@partial(jax.jit, donate_argnames=("kv",))
def _scatter_slot(kv: PagedKV, slot, conv, ssm):
    return kv.replace(conv=tuple(c.at[slot].set(x.astype(c.dtype)) for c, x in zip(kv.conv, conv)),
                      ssm=tuple(s.at[slot].set(x) for s, x in zip(kv.ssm, ssm)))


def take_snapshot(kv: PagedKV, slot: int, num_tokens: int) -> StateSnapshot:
    """A copy (on the device) of the state in `slot`, which holds the first num_tokens tokens."""
    conv, ssm = _gather_slot(kv.conv, kv.ssm, jnp.int32(slot))
    return StateSnapshot(conv, ssm, num_tokens)


def restore_snapshot(kv: PagedKV, slot: int, snap: StateSnapshot) -> PagedKV:
    """Write a snapshot (device or host arrays) into `slot`; kv is donated: use the returned one."""
    if len(snap.conv) != len(kv.conv) or any(a.shape != c.shape[1:] for a, c in zip(snap.conv, kv.conv)) \
            or any(a.shape != s.shape[1:] for a, s in zip(snap.ssm, kv.ssm)):
        raise ValueError("the snapshot does not match this model's state shapes")
    conv, ssm = to_device((snap.conv, snap.ssm), kv.conv[0])
    return _scatter_slot(kv, jnp.int32(slot), conv, ssm)
