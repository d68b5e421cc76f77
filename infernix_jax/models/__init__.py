"""Model families as pure functions over pytrees of arrays.

A family is a package: `llama/` serves Llama, Qwen2/2.5, Qwen3 dense and Qwen3-MoE; `qwen3_5/`
serves Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated attention). Each holds its contiguous forward
and its paged forward (and its own weights' declarations); what they share sits here: the layers,
MoE, the paged KV pool, the weight declarations (params.py, spec.py) and roles (roles.py).
`forward` / `init_cache` pick the family's contiguous-cache implementation, paged.py its paged one."""
import jax.numpy as jnp

from . import llama, qwen3_5
from .llama import KVCache, logits_from_hidden
from .params import ParamSpec, abstract_params, declare_params, init_params


def forward(params, cfg, tokens, positions, cache):
    """Contiguous-cache forward of any family: tokens, positions [B, T] -> hidden [B, T, H], cache."""
    fn = qwen3_5.hybrid_forward if cfg.layer_types else llama.forward
    return fn(params, cfg, tokens, positions, cache)


def init_cache(cfg, batch: int, max_len: int, dtype=jnp.float32):
    if cfg.layer_types:
        return qwen3_5.init_hybrid_cache(cfg, batch, max_len, dtype)
    return llama.init_cache(cfg, batch, max_len, dtype)


__all__ = ["KVCache", "forward", "init_cache", "logits_from_hidden", "ParamSpec",
           "abstract_params", "declare_params", "init_params"]
