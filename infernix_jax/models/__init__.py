"""Model families as pure functions over pytrees of arrays.

`llama.py` serves Llama, Qwen2/2.5, Qwen3 dense and Qwen3-MoE: they differ only in flags of
`ModelConfig` (qkv bias, q/k norm, MoE layers) that select branches at trace time. `hybrid.py`
serves Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated attention). `forward` / `init_cache` pick
the family's contiguous-cache implementation."""
import jax.numpy as jnp

from . import hybrid, llama
from .llama import KVCache, logits_from_hidden
from .params import ParamSpec, abstract_params, declare_params, init_params


def forward(params, cfg, tokens, positions, cache):
    """Contiguous-cache forward of any family: tokens, positions [B, T] -> hidden [B, T, H], cache."""
    fn = hybrid.hybrid_forward if cfg.layer_types else llama.forward
    return fn(params, cfg, tokens, positions, cache)


def init_cache(cfg, batch: int, max_len: int, dtype=jnp.float32):
    if cfg.layer_types:
        return hybrid.init_hybrid_cache(cfg, batch, max_len, dtype)
    return llama.init_cache(cfg, batch, max_len, dtype)


__all__ = ["KVCache", "forward", "init_cache", "logits_from_hidden", "ParamSpec",
           "abstract_params", "declare_params", "init_params"]
