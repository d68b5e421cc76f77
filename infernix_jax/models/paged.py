"""The decoder over a paged KV pool: a ragged batch of prefill chunks and decodes flattened into
one token axis, or a pure decode batch of one token per sequence. Hybrids (Qwen3-Next, Qwen3.5)
also keep a state pool here: see hybrid_paged.py."""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import struct

from pallas_kernels import paged_attention as pa

from ..config import ModelConfig
from .llama import decoder


@struct.dataclass
class PagedKV:
    """The engine's device cache. k[j], v[j] [nKV, P, bs, hd]: one pair per attention layer (every
    layer, except in hybrids). Hybrids only, one per linear (Gated DeltaNet) layer, indexed by state
    slot (one per running sequence): conv[j] [S, K-1, C] in the model dtype, ssm[j] [S, Hv, dk, dv] fp32."""
    k: tuple
    v: tuple
    conv: tuple = ()
    ssm: tuple = ()

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]


def num_attention_layers(cfg: ModelConfig) -> int:
    return sum(not cfg.is_linear_layer(i) for i in range(cfg.num_layers))


def init_paged_kv(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, state_slots: int = 0) -> PagedKV:
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    n_attn = num_attention_layers(cfg)
    conv, ssm = (), ()
    if cfg.layer_types:
        from .hybrid import state_shapes
        (cs, cd), (ss, sd) = state_shapes(cfg, state_slots, dtype)
        n_lin = cfg.num_layers - n_attn
        conv = tuple(jnp.zeros(cs, cd) for _ in range(n_lin))
        ssm = tuple(jnp.zeros(ss, sd) for _ in range(n_lin))
    return PagedKV(k=tuple(jnp.zeros(shape, dtype) for _ in range(n_attn)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(n_attn)), conv=conv, ssm=ssm)


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    return 2 * num_attention_layers(cfg) * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def state_bytes_per_seq(cfg: ModelConfig, dtype) -> int:
    """Hybrids: the conv and SSM states of one sequence over all linear layers (0 otherwise)."""
    if not cfg.layer_types:
        return 0
    from .hybrid import state_shapes
    n_lin = cfg.num_layers - num_attention_layers(cfg)
    return n_lin * sum(math.prod(s) * jnp.dtype(d).itemsize
                       for s, d in state_shapes(cfg, 1, dtype))


def _attention_fns(impl: str):
    if impl in ("pallas", "pallas_interpret"):
        from functools import partial
        from pallas_kernels import paged_decode_attention as pdk, ragged_paged_attention as rpk
        interpret = impl == "pallas_interpret"
        return (partial(pdk.paged_decode_attention, interpret=interpret),
                partial(rpk.ragged_paged_attention, interpret=interpret))
    return pa.paged_decode_attention_reference, pa.ragged_paged_attention_reference


def paged_attend(new_k: list, new_v: list, slots, block_tables, kv_lens, cu_q, attn_impl: str):
    """-> attend(j, q, k, v): writes attention layer j's k/v [1, N, nKV, hd] into new_k[j] / new_v[j]
    at their slots and attends q [1, N, nH, hd] (ragged with cu_q, one token per row without)."""
    decode_fn, ragged_fn = _attention_fns(attn_impl)

    def attend(j, q, k, v):
        new_k[j], new_v[j] = pa.write_kv(new_k[j], new_v[j], k[0], v[0], slots)
        if cu_q is None:
            o = decode_fn(q[0], new_k[j], new_v[j], block_tables, kv_lens)
        else:
            o = ragged_fn(q[0], new_k[j], new_v[j], block_tables, kv_lens, cu_q)
        return o[None]
    return attend


def forward_paged(params, cfg: ModelConfig, tokens, positions, slots, kv: PagedKV, block_tables, kv_lens,
                  cu_q=None, attn_impl: str = "reference", rows=None):
    """tokens, positions, slots [N]. With cu_q [B + 1] the tokens form a ragged batch (prefill
    chunks and decodes); without it there is one token per sequence (N == B, decode).
    K/V of every token are written at its slot before attending. Hybrids take `rows`
    (hybrid_paged.StateRows: where each row's tokens and state are). Returns hidden [N, H], the pool."""
    if cfg.layer_types:
        from .hybrid_paged import hybrid_forward_paged
        return hybrid_forward_paged(params, cfg, tokens, positions, slots, kv, block_tables, kv_lens, cu_q,
                                    attn_impl, rows)
    new_k, new_v = list(kv.k), list(kv.v)
    attend = paged_attend(new_k, new_v, slots, block_tables, kv_lens, cu_q, attn_impl)
    h = decoder(params, cfg, tokens[None], positions[None], attend)
    return h[0], kv.replace(k=tuple(new_k), v=tuple(new_v))
