"""Model families as pure functions over pytrees of arrays.

`llama.py` serves Llama, Qwen2/2.5, Qwen3 dense and Qwen3-MoE: they differ only in flags of
`ModelConfig` (qkv bias, q/k norm, MoE layers) that select branches at trace time."""
from .llama import KVCache, forward, init_cache, logits_from_hidden
from .params import ParamSpec, abstract_params, declare_params, init_params

__all__ = ["KVCache", "forward", "init_cache", "logits_from_hidden", "ParamSpec",
           "abstract_params", "declare_params", "init_params"]
