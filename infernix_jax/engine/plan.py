"""What a start allocates: weights, the KV pool, per-token KV bytes, how many tokens fit.
Computed from the config alone (so `infernix-serve --plan` needs no weights), or from the loaded
weights' real size where the engine has them."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..models.kv_pool import kv_bytes_per_block, state_bytes_per_seq
from ..models.params import abstract_params

GiB = 1 << 30
HYBRID_PREFILL_ROWS = 4       # hybrids: rows feeding several tokens in one step (each padded to the step)


@dataclasses.dataclass
class MemoryPlan:
    weights_bytes: int
    kv_bytes_per_token: float
    block_size: int
    num_blocks: int
    workspace_bytes: int
    max_model_len: int
    max_num_seqs: int
    device_bytes: int | None
    state_bytes: int = 0          # hybrids: the state pool (conv + SSM states of max_num_seqs sequences)
    block_bytes: int = 0          # K and V bytes of one block (exact; kv_bytes_per_token may be fractional)
    kv_dtype: str = ""            # --kv-dtype ("": the model dtype)
    parallel: object = None       # sharding.Parallel over several devices: every size is one device's

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_tokens_in_cache(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        par = self.parallel
        lines = [
            *([f"devices:            {par.describe()}; the sizes below are per device"] if par else []),
            f"weights:            {gib(self.weights_bytes)}",
            f"KV per token:       {self.kv_bytes_per_token / 1024:.1f} KiB ({self.kv_dtype or 'model dtype'})",
            f"KV pool:            {gib(self.kv_pool_bytes)} = {self.num_blocks} blocks x {self.block_size} tokens",
            f"workspace (est.):   {gib(self.workspace_bytes)}",
            *([f"state pool:         {gib(self.state_bytes)} ({self.state_bytes // self.max_num_seqs / 2**20:.1f} "
               f"MiB per sequence, Gated DeltaNet layers)"] if self.state_bytes else []),
            f"max tokens cached:  {self.max_tokens_in_cache} "
            f"(~{self.max_tokens_in_cache / self.max_model_len:.1f} sequences at max_model_len {self.max_model_len})",
            f"max_num_seqs:       {self.max_num_seqs}",
        ]
        if self.device_bytes:
            lines.append(f"device memory:      {gib(self.device_bytes)}")
        return "\n".join(lines)


def device_memory_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU backends have no memory stats
        return None
    return stats.get("bytes_limit")


def params_bytes(params) -> int:
    """Bytes of a loaded model's arrays (quantized and packed matrices at their stored size)."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(params))


def make_plan(cfg: ModelConfig, dtype, *, max_model_len: int, max_num_seqs: int, block_size: int = 16,
              kv_cache_gib: float | None = None, memory_fraction: float = 0.9,
              max_num_batched_tokens: int = 2048, weights_format: str = "",
              weights_bytes: int | None = None, kv_dtype: str = "", parallel=None) -> MemoryPlan:
    """weights_bytes: the weights' real size where known (loaded params, or a GGUF file's blocks; one
    device's share with parallel); else planned from the config and weights_format. parallel
    (sharding.Parallel): several devices, each holding its share of the weights and of every KV
    block (the KV heads split over tensor parallelism where they divide): every size is per device."""
    from ..quant.apply import planned_bytes
    from ..sharding import units_of
    itemsize = jnp.dtype(dtype).itemsize
    sizes = parallel.sizes if parallel else None
    weights = weights_bytes if weights_bytes is not None else \
        planned_bytes(abstract_params(cfg, dtype), itemsize, weights_format, sizes, units_of(cfg))
    block_bytes = kv_bytes_per_block(cfg, dtype, kv_dtype, block_size) // (parallel.kv_split(cfg.num_kv_heads)
                                                                          if parallel else 1)
    per_tok = block_bytes / block_size
    # activations of the largest step: a few [tokens, max(H, I, vocab)] buffers
    widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts * cfg.moe_intermediate_size)
    workspace = 6 * max_num_batched_tokens * widest * 4 + 4 * max_num_seqs * cfg.vocab_size * 4
    if cfg.layer_types:   # the linear layers' padded prefill layout: conv inputs, gates, chunk matrices
        conv = 2 * cfg.lin_k_heads * cfg.lin_k_dim + cfg.lin_v_heads * cfg.lin_v_dim
        workspace += HYBRID_PREFILL_ROWS * max_num_batched_tokens * (3 * conv + 5 * cfg.lin_v_heads * 64) * 4
    if kv_dtype == "bf16p":   # a mixed step rebuilds its batch's blocks as BF16 (K and V of one layer)
        b = 1 << max(0, max_num_seqs - 1).bit_length()
        m = 1 << max(0, -(-(max_model_len + 16) // block_size) - 1).bit_length()
        workspace += 2 * b * m * block_size * cfg.num_kv_heads * cfg.head_dim * 2
    state = max_num_seqs * state_bytes_per_seq(cfg, dtype)
    device = device_memory_bytes()
    if kv_cache_gib is not None:
        pool = int(kv_cache_gib * GiB)
    elif device is not None:
        pool = int(device * memory_fraction) - weights - workspace - state
    else:  # CPU: every sequence at full length (plus decode look-ahead), capped at 1 GiB
        per_seq = -(-(max_model_len + 16) // block_size) * block_size
        pool = min(GiB, max_num_seqs * per_seq * per_tok)
    num_blocks = pool // block_bytes
    min_blocks = -(-max_model_len // block_size)
    if num_blocks < min_blocks:
        raise ValueError(f"the KV pool ({pool / GiB:.2f} GiB) cannot hold one sequence of max_model_len "
                         f"{max_model_len}: lower --max-model-len or raise --kv-cache-gib")
    return MemoryPlan(weights, per_tok, block_size, int(num_blocks), workspace, max_model_len, max_num_seqs, device,
                      state, block_bytes, kv_dtype, parallel if parallel else None)
