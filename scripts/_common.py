"""What every CLI shares: one-line errors with a non-zero exit instead of tracebacks."""
from __future__ import annotations

import os
import sys
from typing import Callable

from infernix_jax import choices
from infernix_jax.config import ConfigError
from infernix_jax.errors import ModelLoadError, TokenizerError

USER_ERRORS = (ModelLoadError, ConfigError, TokenizerError, FileNotFoundError, PermissionError,
               IsADirectoryError, ValueError)


def run(prog: str, main: Callable[[], int | None]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return main() or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def add_model_args(p, default_model: str | None = None, more_weights: tuple = ()):
    """--model, --dtype, --weights (WEIGHT_FORMATS and more_weights), --lossless."""
    from infernix_jax.hub import DEFAULT_MODEL
    p.add_argument("--model", default=default_model or DEFAULT_MODEL,
                   help="a Hugging Face model directory, a .gguf file, or an alias (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: a converted checkpoint's own, else float32: XLA's CPU bf16 "
                        "matmuls are slow)")
    p.add_argument("--weights", default=None, choices=(*choices.WEIGHT_FORMATS, *more_weights),
                   help="the projections' format: quantize them after loading (attention, MLP, linear attention, shared "
                        "and routed experts; embeddings, the LM head, norms and routers stay as loaded). On a GPU, decode "
                        "reads them through a fused dequantizing kernel; docs/quality.md says what each costs. "
                        "bf16p: lossless 12-bit packing of bfloat16 weights (bit-identical output; needs "
                        "--dtype bfloat16). gguf: a .gguf model's projections stay in the file's own blocks "
                        "(Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, IQ4_XS; values unchanged), other types are dequantized")
    add_compile_cache_arg(p)
    p.add_argument("--lossless", action="store_true",
                   help="the exact route: float32 activations, every matmul in full f32 (no TF32, no bf16), "
                        "the reference attention and dequantize-then-multiply: slower, the reference for "
                        "infernix-quality. Without it the GPU runs faster arithmetic (also deterministic)")


def add_compile_cache_arg(p):
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="JAX's persistent compilation cache: what one start compiles, the next reads back "
                        "(default: INFERNIX_COMPILE_CACHE, else ~/.cache/infernix/xla-cache); off: compile "
                        "every start")


def apply_route(a) -> None:
    """Settle how the model runs (call once, right after parsing, before any model is loaded): the
    dtype (a converted checkpoint's own unless --dtype says otherwise) and --lossless, checked
    against the other flags, with JAX set up for it. a.stored_weights: a converted checkpoint's
    weight format ("" otherwise); a command with --kv-dtype takes the checkpoint's default KV dtype
    when none is given (not under --lossless: quantized KV is a lossy route)."""
    from infernix_jax import compile_cache
    from infernix_jax.loader import stored_route
    a.compile_cache_dir = compile_cache.enable(getattr(a, "compile_cache", None))
    lossless = getattr(a, "lossless", False)
    check_lossless(a)
    stored_dtype, a.stored_weights, stored_kv = stored_route(a.model)
    if getattr(a, "kv_dtype", None) == "model":      # asked for exact KV, over a checkpoint's default
        a.kv_dtype = ""
    if a.dtype is None:
        a.dtype = "float32" if lossless else (stored_dtype or "float32")
    if hasattr(a, "kv_dtype") and a.kv_dtype is None and not lossless:
        a.kv_dtype = stored_kv or None
    if not lossless:
        return
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    a.attn_impl = "reference"


def check_lossless(a) -> None:
    """--lossless against the flags it excludes (no side effects: /configure checks saved settings
    with it too)."""
    if not getattr(a, "lossless", False):
        return
    if a.dtype not in (None, "float32"):
        raise ValueError(f"--lossless computes in float32: drop --dtype {a.dtype}")
    if getattr(a, "kv_dtype", None) not in (None, "", "model"):
        raise ValueError(f"--lossless keeps K and V in float32: drop --kv-dtype {a.kv_dtype}")
    if getattr(a, "attn_impl", None) not in (None, "reference"):
        raise ValueError(f"--lossless uses the reference attention: drop --attn-impl {a.attn_impl}")


def add_kv_dtype_arg(p):
    p.add_argument("--kv-dtype", default=None, choices=["model", *choices.KV_DTYPES],
                   help="store K and V quantized, one f32 scale per head and token (k8v4: 8-bit keys, 4-bit "
                        "values): about half (int8, fp8) or 40%% (k8v4) of bf16's KV bytes; bf16p: bfloat16 "
                        "packed losslessly in ~0.8x the bytes (bit-identical output; a request whose K/V cannot "
                        "be packed fails alone); model: in the model dtype (the default, unless a converted "
                        "checkpoint names another)")


def add_parallel_args(p):
    g = p.add_argument_group("several devices (JAX sharding)")
    g.add_argument("--tensor-parallel", "--tp", dest="tensor_parallel", type=int, default=1, metavar="N",
                   help="split attention heads, the MLP and the vocabulary over N devices (default %(default)s)")
    g.add_argument("--expert-parallel", "--ep", dest="expert_parallel", type=int, default=1, metavar="M",
                   help="split MoE experts over M groups of --tensor-parallel devices: N x M devices in all "
                        "(default %(default)s)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several hosts: process 0's address, which every process joins (jax.distributed); "
                        "process 0 serves, the others run its steps. Also INFERNIX_COORDINATOR")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="several hosts: how many processes in all (INFERNIX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="several hosts: this process's rank, 0 to N-1 (INFERNIX_PROCESS_ID)")


def init_distributed(a) -> bool:
    """Join a multi-host run where the flags or environment ask for one (before any device is used):
    whether there are several processes."""
    from infernix_jax import distributed
    several = distributed.initialize(getattr(a, "coordinator", None), getattr(a, "num_processes", None),
                                     getattr(a, "process_id", None))
    if several and getattr(a, "weights", None) == "bf16p":        # packing reads whole matrices on one host
        raise ValueError("not supported across several hosts yet: --weights bf16p")
    distributed.check_mesh(parallel_of(a))                        # before loading into a mesh
    return several


def parallel_of(a):
    """--tensor-parallel / --expert-parallel -> a sharding.Parallel over several devices, or None."""
    from infernix_jax.sharding import Parallel
    par = Parallel(getattr(a, "tensor_parallel", 1), getattr(a, "expert_parallel", 1))     # (checks them)
    return par if par else None


def add_engine_args(p):
    add_parallel_args(p)
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", "--max-batch", dest="max_num_seqs", type=int, default=8,
                   help="sequences running at once (default %(default)s)")
    g.add_argument("--max-model-len", "--max-context", dest="max_model_len", type=int, default=None,
                   help="cap on prompt + completion tokens (default: the model's context)")
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool size (default: a memory fraction on GPUs, up to 1 GiB on the CPU)")
    g.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of device memory for weights + KV pool + workspace (default %(default)s)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    add_kv_dtype_arg(g)
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step; longer prompts are prefilled in chunks (default %(default)s)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    g.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps per dispatch when no request needs the host (default 8 on GPU, 4 on CPU)")
    g.add_argument("--attn-impl", choices=choices.ATTN_IMPLS, default=None,
                   help="attention implementation (default: pallas on GPU, reference jnp on CPU)")
    g.add_argument("--fair-turn-s", type=float, default=1.0, metavar="S",
                   help="under KV pressure, running requests take turns of about S seconds of output so that "
                        "waiting ones are served too (0: the oldest runs to the end; default %(default)s)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=choices.SPECULATIVE, default="auto",
                   help="draft tokens and verify them in one step: auto (default) where measured round times and "
                        "acceptance say it pays (n-gram copies, and the MTP head where the checkpoint has one); ngram "
                        "whenever an n-gram of the text recurs; mtp: the checkpoint's multi-token prediction head "
                        "(Qwen3-Next, Qwen3.5); off. The output is the same token for token (greedy or seeded)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="the deepest draft a round verifies (default: n-gram drafts 7 on the CPU, 15 on a GPU; "
                        "the MTP head 3)")
    g.add_argument("--ngram-tree-nodes", type=int, default=0, metavar="N",
                   help="n-gram drafts as trees of up to N nodes: every earlier occurrence of the matched text "
                        "with another continuation (two versions of a file) verified in one round (default off)")
    g.add_argument("--device-rounds", choices=["auto", "on", "off"], default="auto",
                   help="n-gram drafts (chains or trees) drafted and verified round after round on the device, up "
                        "to --decode-steps rounds in one dispatch, for batches of decoding requests (not with the "
                        "MTP head or --kv-dtype bf16p); auto: on a GPU, where a dispatch costs several tokens' "
                        "time (default %(default)s)")
    g = p.add_argument_group("prefix cache")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep computed prefixes for reuse (every prompt is prefilled in full)")
    g.add_argument("--prefix-cache-ram-gib", type=float, default=0.0, metavar="N",
                   help="host RAM for KV blocks the device evicts, copied back instead of recomputed (default off)")
    g.add_argument("--ram-resize", choices=["auto", "off"], default="auto",
                   help="auto: shrink the RAM tier while less than 2 GiB of RAM is available, grow it back later")
    g.add_argument("--state-snapshots", type=int, default=None, metavar="N",
                   help="hybrid models: recurrent-state snapshots kept in host RAM, without which a cached prefix "
                        "cannot resume (default 16 with the prefix cache; a Qwen3.5-27B snapshot is 147 MiB)")
    g.add_argument("--ssd-context-gib", type=float, default=0.0, metavar="N",
                   help="opt-in SSD tier: what the RAM tier gives up is compressed into a scratch file of N GiB")
    g.add_argument("--ssd-context-dir", default=None, metavar="DIR", help="where the SSD tier's scratch file lives")
    g.add_argument("--ssd-context-gib-per-hour", type=float, default=8.0, metavar="N",
                   help="SSD write budget; past it blocks are dropped instead of written (default %(default)s)")
    g.add_argument("--prefix-cache-file", default=None, metavar="PATH",
                   help="save the prefix cache here at shutdown and load it at start (when it matches the model)")


def engine_config(a):
    """The EngineConfig of parsed engine flags (checked there: a bad value is a ValueError naming its flag)."""
    from infernix_jax.engine.config import EngineConfig
    return EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, kv_cache_gib=a.kv_cache_gib,
                        prefix_cache=not a.no_prefix_cache, prefix_cache_ram_gib=a.prefix_cache_ram_gib,
                        ram_resize=a.ram_resize, state_snapshots=a.state_snapshots,
                        ssd_context_gib=a.ssd_context_gib, ssd_context_dir=a.ssd_context_dir,
                        ssd_gib_per_hour=a.ssd_context_gib_per_hour, prefix_cache_file=a.prefix_cache_file,
                        fair_turn_s=a.fair_turn_s, kv_dtype=a.kv_dtype or "", memory_fraction=a.memory_fraction,
                        block_size=a.block_size, max_num_batched_tokens=a.max_num_batched_tokens,
                        chunked_prefill=not a.no_chunked_prefill, decode_steps=a.decode_steps,
                        attn_impl=a.attn_impl, parallel=parallel_of(a), speculative=a.speculative,
                        num_speculative_tokens=a.num_speculative_tokens, ngram_tree_nodes=a.ngram_tree_nodes,
                        device_rounds={"auto": None, "on": True, "off": False}[a.device_rounds])


class Progress:
    """Progress of a long run on stderr: a tqdm bar on a terminal; elsewhere (a log file, CI, a pipe)
    one plain line every `every` seconds and one at the end, e.g.
    `infernix-generate: 40/100 prompts (40%), 12 s, about 18 s left`."""

    def __init__(self, prog: str, total: int, unit: str, desc: str = "", every: float = 10.0):
        import time
        self.prog, self.total, self.unit, self.every = prog, total, unit, every
        self.n, self._clock = 0, time.monotonic
        self._t0 = self._last = self._clock()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc or prog, unit=unit)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._clock() - self._last >= self.every:
            self._line()

    def each(self, items):
        """items, counting each one done as the next is asked for (and at the end)."""
        for x in items:
            yield x
            self.update()

    def _line(self) -> None:
        self._last = now = self._clock()
        took = now - self._t0
        pct = f" ({100 * self.n // self.total}%)" if self.total else ""
        left = f", about {took / self.n * (self.total - self.n):.0f} s left" if 0 < self.n < self.total else ""
        print(f"{self.prog}: {self.n}/{self.total} {self.unit}s{pct}, {took:.0f} s{left}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.n or self.total:
            self._line()
            self.total = self.n = 0           # (once)
