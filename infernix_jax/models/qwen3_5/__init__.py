"""The hybrid family: Qwen3-Next and Qwen3.5 / 3.6 (dense and MoE), Gated DeltaNet layers beside gated
full-attention layers. model.py: the layers and the contiguous-cache forward; paged.py: the same over
the engine's paged KV and state pool; params.py: the Gated DeltaNet weights (the rest are the shared
decoder's, models/params.py)."""
from .model import hybrid_forward, init_hybrid_cache, state_shapes
from .paged import StateRows, hybrid_forward_paged

__all__ = ["StateRows", "hybrid_forward", "hybrid_forward_paged", "init_hybrid_cache", "state_shapes"]
