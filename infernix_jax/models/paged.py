"""The decoder over a paged KV pool: a ragged batch of prefill chunks and decodes flattened into
one token axis, or a pure decode batch of one token per sequence."""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from pallas_kernels import paged_attention as pa

from ..config import ModelConfig
from .llama import decoder


@struct.dataclass
class PagedKV:
    """Per-layer pools: k[i], v[i] are [nKV, P, bs, hd]."""
    k: tuple
    v: tuple

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]


def init_paged_kv(cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> PagedKV:
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return PagedKV(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def _attention_fns(impl: str):
    if impl in ("pallas", "pallas_interpret"):
        from functools import partial
        from pallas_kernels import paged_decode_attention as pdk, ragged_paged_attention as rpk
        interpret = impl == "pallas_interpret"
        return (partial(pdk.paged_decode_attention, interpret=interpret),
                partial(rpk.ragged_paged_attention, interpret=interpret))
    return pa.paged_decode_attention_reference, pa.ragged_paged_attention_reference


def forward_paged(params, cfg: ModelConfig, tokens, positions, slots, kv: PagedKV, block_tables, kv_lens,
                  cu_q=None, attn_impl: str = "reference"):
    """tokens, positions, slots [N]. With cu_q [B + 1] the tokens form a ragged batch (prefill
    chunks and decodes); without it there is one token per sequence (N == B, decode).
    K/V of every token are written at its slot before attending. Returns hidden [N, H] and the pool."""
    decode_fn, ragged_fn = _attention_fns(attn_impl)
    new_k, new_v = list(kv.k), list(kv.v)

    def attend(i, q, k, v):                                          # q [1, N, nH, hd]
        new_k[i], new_v[i] = pa.write_kv(new_k[i], new_v[i], k[0], v[0], slots)
        if cu_q is None:
            o = decode_fn(q[0], new_k[i], new_v[i], block_tables, kv_lens)
        else:
            o = ragged_fn(q[0], new_k[i], new_v[i], block_tables, kv_lens, cu_q)
        return o[None]

    h = decoder(params, cfg, tokens[None], positions[None], attend)
    return h[0], PagedKV(k=tuple(new_k), v=tuple(new_v))
