"""The Llama family over the paged KV pool (models/kv_pool.py)."""
from __future__ import annotations

from ...config import ModelConfig
from ...route import Route
from ..kv_pool import PagedKV, paged_attend
from .model import decoder


def forward_paged(params, cfg: ModelConfig, tokens, positions, slots, kv: PagedKV, block_tables, kv_lens, cu_q,
                  route: Route, multi_rows=None, tree=None):
    """models.paged.forward_paged for this family: tokens, positions, slots [N] -> hidden [N, H], the pool."""
    attend, pools = paged_attend(kv, slots, block_tables, kv_lens, cu_q, route, multi_rows, tree)
    h = decoder(params, cfg, tokens[None], positions[None], attend, route=route)
    return h[0], kv.replace(**pools())
