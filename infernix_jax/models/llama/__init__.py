"""The Llama family: Llama, Qwen2 / 2.5, Qwen3 dense and Qwen3-MoE, which differ only in flags of
`ModelConfig` (qkv bias, q/k norm, MoE layers) that select branches at trace time. model.py: the
decoder and its contiguous-cache forward; paged.py: the same decoder over the engine's paged KV.
Its weights are the shared decoder's (models/params.py)."""
from .model import KVCache, decoder, forward, init_cache, logits_from_hidden

__all__ = ["KVCache", "decoder", "forward", "init_cache", "logits_from_hidden"]
