"""One engine's settings, frozen and checked in one place: the command line (scripts/_common.py),
a `--config` file and the /configure page all build an EngineConfig, and so can a library user
(`Engine(model, EngineConfig(max_num_seqs=4))`, or the same as keywords). The messages name the
command-line flags, since that is where a user meets them. No heavy imports here: `--help` and
`--plan` read this module before JAX starts."""
from __future__ import annotations

import dataclasses

from ..choices import MAX_DRAFT_NODES as MAX_NODES, SPECULATIVE
from ..route import Route


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8                 # sequences running at once
    max_model_len: int | None = None      # prompt + completion cap (None: the model's context)
    kv_cache_gib: float | None = None     # KV pool size (None: a memory fraction on GPUs, <= 1 GiB on the CPU)
    memory_fraction: float = 0.9          # device memory for weights + pool + workspace
    block_size: int = 16                  # tokens per KV block
    max_num_batched_tokens: int = 512     # one step's token budget
    chunked_prefill: bool = True          # longer prompts prefill in chunks of the budget
    decode_steps: int | None = None       # decode steps per dispatch (None: 8 on a GPU, 4 on the CPU)
    attn_impl: str | None = None          # None: pallas on a GPU, reference on the CPU
    kv_dtype: str = ""                    # "" (the model dtype) or one of choices.KV_DTYPES
    fair_turn_s: float = 1.0              # turns of output under KV pressure (0: oldest first)
    # speculative decoding (engine/spec): auto drafts where measured round times say it pays
    speculative: str = "auto"
    num_speculative_tokens: int | None = None   # the deepest draft (None: n-gram drafts 7 on the CPU, 15
                                                # on a GPU, a verify step of one stream is then 8 or 16
                                                # tokens; the MTP head choices.MTP_DEPTH)
    ngram_tree_nodes: int = 0             # > 0: n-gram drafts as trees of up to this many nodes
    device_rounds: bool | None = None     # n-gram chains drafted and verified round after round inside one
                                          # dispatch (steps.spec_steps); None: on a GPU, where a dispatch
                                          # costs several tokens' time (the CPU pays per token: host
                                          # rounds, which pick each draft's depth, do better there)
    # the prefix cache and its tiers
    prefix_cache: bool = True
    prefix_cache_ram_gib: float = 0.0
    ram_resize: str = "auto"
    state_snapshots: int | None = None    # hybrids (None: 16 with the prefix cache, else 0)
    ssd_context_gib: float = 0.0
    ssd_context_dir: str | None = None
    ssd_gib_per_hour: float = 8.0
    prefix_cache_file: str | None = None
    parallel: object = None               # sharding.Parallel, or None for one device
    shapes_dir: str | None = None         # where the warm-up's record of shapes lives (None: beside the
                                          # compilation cache)

    def __post_init__(self):
        self._check()

    def _check(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError("--kv-cache-gib must be > 0")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("--memory-fraction must be in (0, 1]")
        if self.decode_steps is not None and self.decode_steps < 1:
            raise ValueError("--decode-steps must be >= 1")
        if self.attn_impl is not None:
            Route.named(self.attn_impl)          # (raises the one-line error for an unknown name)
        # (--kv-dtype is checked against the model by models/kv_pool.check_kv_dtype, when the engine starts)
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE)} (got {self.speculative!r})")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= MAX_NODES - 1:
            raise ValueError(f"--num-speculative-tokens must be in 1..{MAX_NODES - 1}")
        if not 0 <= self.ngram_tree_nodes <= MAX_NODES:
            raise ValueError(f"--ngram-tree-nodes must be in 0..{MAX_NODES}")
        if self.fair_turn_s < 0:
            raise ValueError("--fair-turn-s must be >= 0")
        if self.prefix_cache_ram_gib < 0:
            raise ValueError("--prefix-cache-ram-gib must be >= 0")
        if self.ram_resize not in ("auto", "off"):
            raise ValueError(f"--ram-resize must be auto or off (got {self.ram_resize!r})")
        if self.ssd_context_gib < 0 or self.ssd_gib_per_hour <= 0:
            raise ValueError("--ssd-context-gib must be >= 0 and --ssd-context-gib-per-hour > 0")
        if self.ssd_context_gib > 0 and not self.ssd_context_dir:
            raise ValueError("--ssd-context-gib needs --ssd-context-dir DIR")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError("--state-snapshots must be >= 0")

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes` (checked again); an unknown name is a clear error."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def describe_prefix_cache(self) -> str:
        """One line for --plan and the start-up log."""
        if not self.prefix_cache:
            return "prefix cache:       off"
        tiers = ["device blocks"]
        if self.prefix_cache_ram_gib or self.ssd_context_gib or self.prefix_cache_file:
            tiers.append(f"RAM {self.prefix_cache_ram_gib or 1.0:g} GiB (resize {self.ram_resize})")
        if self.ssd_context_gib:
            tiers.append(f"SSD {self.ssd_context_gib:g} GiB in {self.ssd_context_dir} "
                         f"(at most {self.ssd_gib_per_hour:g} GiB/hour written)")
        if self.prefix_cache_file:
            tiers.append(f"saved to {self.prefix_cache_file}")
        return "prefix cache:       " + ", ".join(tiers)

    def plan(self, cfg, dtype, weights_format: str = "", weights_bytes: int | None = None):
        """The memory plan (engine/plan.py) of this engine for a model config: what --plan prints and
        what the engine allocates."""
        from .plan import make_plan
        return make_plan(cfg, dtype, max_model_len=self.context(cfg), max_num_seqs=self.max_num_seqs,
                         block_size=self.block_size, kv_cache_gib=self.kv_cache_gib,
                         memory_fraction=self.memory_fraction, max_num_batched_tokens=self.max_num_batched_tokens,
                         weights_format=weights_format, weights_bytes=weights_bytes, kv_dtype=self.kv_dtype,
                         parallel=self.parallel)

    def context(self, cfg) -> int:
        """The longest prompt + completion: max_model_len, capped by the model's context."""
        return min(self.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
