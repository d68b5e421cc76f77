"""The decoder over a paged KV pool (kv_pool.py): a ragged batch of prefill chunks and decodes
flattened into one token axis, or a pure decode batch of one token per sequence, dispatched to the
model's family (llama/paged.py; hybrids, Qwen3-Next and Qwen3.5: qwen3_5/paged.py, which also keeps
their state pool)."""
from __future__ import annotations

from ..config import ModelConfig
from ..route import REFERENCE, Route
from .llama.paged import forward_paged as llama_forward_paged
from .kv_pool import PagedKV
from .qwen3_5.paged import hybrid_forward_paged


def forward_paged(params, cfg: ModelConfig, tokens, positions, slots, kv: PagedKV, block_tables, kv_lens,
                  cu_q=None, route: Route = REFERENCE, rows=None, multi_rows=None, tree=None):
    """tokens, positions, slots [N]. With cu_q [B + 1] the tokens form a ragged batch (prefill
    chunks and decodes); without it there is one token per sequence (N == B, decode).
    K/V of every token are written at its slot before attending. Hybrids take `rows`
    (qwen3_5.paged.StateRows: where each row's tokens and state are). multi_rows [Bp]: the rows that
    feed several tokens (padded with B; None: any may), for the reference attention's cost.
    route: the step's (route.py: kernels, KV format). tree: a verify step's draft trees (None, or
    (tree_lo [B], anc [N]): kv_pool.paged_attend). Returns hidden [N, H], the pool."""
    if cfg.layer_types:
        return hybrid_forward_paged(params, cfg, tokens, positions, slots, kv, block_tables, kv_lens, cu_q,
                                    route, rows, multi_rows, tree)
    return llama_forward_paged(params, cfg, tokens, positions, slots, kv, block_tables, kv_lens, cu_q, route,
                               multi_rows, tree)
