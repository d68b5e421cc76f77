"""The engine: continuous batching over a paged KV pool. `step()` is schedule -> run -> postprocess.
One thread owns the device: `start()` runs the loop there, `submit()` and `Request.cancel()` are
safe from any thread, and events reach requests through their on_event callbacks."""
from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
import time
import traceback

import jax
import numpy as np

from .. import distributed, sharding
from ..loader import LoadedModel
from ..sharding import Parallel
from ..cache.block_manager import BlockManager, root_key
from ..cache.host_tier import GiB, HostTier
from .config import EngineConfig
from .plan import HYBRID_PREFILL_ROWS, MemoryPlan, params_bytes
from .request import Event, Request, Result
from .runner import STOP_WIDTH, Runner, StepOutput
from .constraints import Constraint, ll_tokenizer
from ..cache import cache_file
from . import shapes
from ..cache.prefix_cache import PrefixCache
from ..cache.ssd_tier import SSDTier
from .scheduler import Scheduler
from .steps import bucket
from ..cache.snapshots import SnapshotStore
from ..route import Route
from ..choices import MTP_DEPTH
from .sequence import Sequence, Status
from .spec.mtp import use_mtp
from .spec.policy import Speculator
from .stops import TextTracker

log = logging.getLogger("infernix.engine")


def _think_ids(tokenizer, eos_ids) -> tuple[int, int, tuple[int, ...]] | None:
    """(<think>, </think>, ids banned while thinking) when the vocabulary has thinking tokens."""
    if tokenizer is None:
        return None
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    if start is None or end is None:
        return None
    call = tokenizer.token_to_id("<tool_call>")
    return start, end, tuple(eos_ids) + (() if call is None else (call,))


def repeats(ids: list[int], min_period: int = 8, max_period: int = 128, times: int = 4) -> bool:
    """The tail of ids is one chunk of min_period..max_period tokens repeated `times` times."""
    a = np.asarray(ids[-max_period * times:], np.int64)
    for L in range(min_period, min(max_period, len(a) // times) + 1):
        tail = a[-L * times:]
        if np.array_equal(tail[L:], tail[:-L]):
            return True
    return False


# a thinking run-on: RUN_ON_WORDS or more words joined by hyphens, with no space between them, at the end
# of the text (a model that lost its way writes "then-check-the-file-and-then-..." without end; not
# periodic, so `repeats` misses it; real text rarely chains more than a handful: UUIDs have 5 parts)
RUN_ON_WORDS = 24
_RUN_ON = re.compile(r"(?:[^\s-]+-){%d,}[^\s-]*$" % (RUN_ON_WORDS - 1))


def runs_on(text: str) -> bool:
    return _RUN_ON.search(text) is not None


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, **settings):
        """config: the engine's settings (EngineConfig); keywords change single ones of it
        (`Engine(model, max_num_seqs=4)`), checked as the command line's are."""
        c = self.config = (config or EngineConfig()).replace(**settings)
        # the MTP head runs (and has a K/V layer in the pool) only where it drafts: spec/mtp.py
        model, mtp = use_mtp(model, c.speculative, c.kv_dtype)
        from ..models.kv_pool import check_kv_dtype
        check_kv_dtype(c.kv_dtype, model.cfg.head_dim, model.dtype)      # before the plan sizes a pool for it
        state_snapshots, parallel, kv_dtype, block_size = c.state_snapshots, c.parallel, c.kv_dtype, c.block_size
        max_num_seqs = c.max_num_seqs
        if distributed.several():
            if kv_dtype == "bf16p":
                raise ValueError("not supported across several hosts yet: --kv-dtype bf16p")
            distributed.check_mesh(parallel)
        self.kv_dtype = kv_dtype
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        on_gpu = jax.devices()[0].platform == "gpu"
        self.max_context = c.context(self.cfg)
        self.plan: MemoryPlan = c.plan(self.cfg, model.dtype, model.weights_format,
                                       self._weights_bytes(model, parallel))
        # Prefix keys start from a root that names what the blocks' contents depend on.
        dtype_name = np.dtype(model.dtype).name
        weights = cache_file.weights_identity(model.path) or model.name      # random weights: the name
        if model.weights_format:             # quantized projections compute other KV
            weights += f"|{model.weights_format}"
        # the matmul precision too: --lossless (full f32) and TF32 f32 matmuls leave different KV
        precision = jax.config.jax_default_matmul_precision or "default"
        if parallel:         # split products sum in another order: other KV bits
            precision += f"|tp{parallel.tensor}ep{parallel.expert}"
        self.fingerprint = cache_file.fingerprint(f"{weights}|{precision}|{model.cfg}", dtype_name,
                                                  kv_dtype or dtype_name, block_size, jax.devices()[0].device_kind)
        self.bm = BlockManager(self.plan.num_blocks, block_size, root=root_key(json.dumps(self.fingerprint)),
                               cache=c.prefix_cache)
        steps = c.decode_steps if c.decode_steps is not None else (8 if on_gpu else 4)
        # Without chunking a whole prompt must fit in one step's budget.
        budget = max(c.max_num_batched_tokens, max_num_seqs, 0 if c.chunked_prefill else self.max_context)
        self.hybrid = hybrid = bool(self.cfg.layer_types)
        # Hybrids: a state slot per running sequence; the rows feeding several tokens in one step are
        # capped (the linear layers pad each of them to the step's token count).
        self.max_prefill_rows = HYBRID_PREFILL_ROWS if hybrid else None
        # Hybrids with state_snapshots > 0: prefill chunks end on multiples of the snapshot interval
        # (whole blocks, whole GDN chunks), where the state is copied to host memory (see SnapshotStore);
        # so does a sequence that ends. The prefix cache resumes a hybrid only from a snapshot.
        if state_snapshots is None:
            state_snapshots = 16 if c.prefix_cache else 0
        self.snapshots = SnapshotStore(state_snapshots, math.lcm(block_size, 64)) \
            if hybrid and state_snapshots > 0 else None
        self.cache_file = None
        self.cache = self._prefix_cache()
        self.scheduler = Scheduler(self.bm, max_num_seqs, budget, c.chunked_prefill, steps,
                                   state_slots=max_num_seqs if hybrid else 0, max_prefill_rows=self.max_prefill_rows,
                                   align=self.snapshots.interval if self.snapshots is not None else 0,
                                   cache=self.cache, turn_s=c.fair_turn_s)
        if self.snapshots is not None:
            self.scheduler.on_release = lambda seq: self.snapshots.capture(seq, self.runner, self.bm)
        impl = c.attn_impl or ("pallas" if on_gpu else "reference")
        self.route = Route.named(impl, kv_dtype)       # how every step computes (route.py)
        self.runner = Runner(model, self.plan.num_blocks, block_size, self.route, state_slots=max_num_seqs,
                             max_context=self.max_context, parallel=parallel)
        # speculative decoding (spec/): drafts proposed before each schedule, verified in the mixed step
        self.spec_depth = c.num_speculative_tokens or (15 if on_gpu else 7)
        self.spec = None if c.speculative == "off" else Speculator(c.speculative, self.spec_depth, c.ngram_tree_nodes,
                                                                   mtp=mtp)
        # device-side rounds (spec_steps) for batches of decoding rows: KV formats that take any write,
        # n-gram drafts (the MTP head drafts in host rounds). A hybrid's rows enter them with the
        # tokens of their last round still to feed (steps.spec_steps).
        rounds_here = c.device_rounds if c.device_rounds is not None else on_gpu
        if self.spec is not None and rounds_here and steps > 1 and not mtp and kv_dtype != "bf16p":
            self.spec.loop = self.runner.loop = self.spec.loop_settings(steps)
            if hybrid and self.spec.loop is not None:
                self.scheduler.loop_pending = self.spec.loop.depth + 1
        if mtp:          # every step drafts with the head; the scheduler keeps slots ahead for its chain
            self.runner.mtp_depth = self.scheduler.lookahead = min(c.num_speculative_tokens or MTP_DEPTH,
                                                                   self.spec_depth)
        self.eos_ids = tuple(self.tokenizer.eos_ids if self.tokenizer else self.cfg.eos_token_ids)
        self.think_ids = _think_ids(self.tokenizer, self.eos_ids)
        self.runner.think_ids = self.think_ids
        self.runner.max_prefill_rows = self.max_prefill_rows
        self._rng = np.random.default_rng()
        self._inbox: queue.Queue[Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # warm-up (shapes.py): the step shapes earlier runs of this same engine met, kept beside JAX's
        # compilation cache; the server says it is ready once `warm_state` is done
        self.shape_limits = shapes.Limits(max_num_seqs, budget, block_size, self.max_context, steps,
                                          self.runner.table_width, self.runner.multi_bucket)
        identity = json.dumps([self.fingerprint, self.plan.num_blocks, max_num_seqs, budget, steps, self.max_context,
                               impl, kv_dtype, str(parallel), c.chunked_prefill])
        # shapes_dir: where that record lives (default: JAX's compilation cache directory, none when off)
        self.earlier_shapes = self.runner.shapes.attach(c.shapes_dir or jax.config.jax_compilation_cache_dir, identity)
        self._warm_queue: list[tuple] = []
        self.warmed_up = False         # warmup() or start() warmed it: nothing compiles on a request's path
        self._idle_keys: list[tuple] = []
        self._warm_t0 = 0.0
        self.ready = threading.Event()
        self.warm_state = {"done": 0, "total": 0, "seconds": 0.0}

    @staticmethod
    def _weights_bytes(model: LoadedModel, parallel: Parallel | None) -> int:
        """The bytes of the loaded weights one device holds."""
        if not parallel:
            return params_bytes(model.params)
        return sharding.bytes_per_device(model.params, sharding.param_specs(model.params, parallel.sizes, model.cfg),
                                         parallel.sizes)

    def _prefix_cache(self) -> PrefixCache | None:
        c = self.config
        if not c.prefix_cache:
            return None
        ram_gib, ssd_gib, path = c.prefix_cache_ram_gib, c.ssd_context_gib, c.prefix_cache_file
        if not distributed.is_leader():     # several hosts: the leader's tiers hold whole blocks; others
            ram_gib, ssd_gib, path = 0, 0, None     # only replay its device calls (distributed.py)
        if (ssd_gib > 0 or path) and ram_gib == 0:
            ram_gib = 1.0          # the SSD tier and the cache file work through the RAM tier
            log.info("prefix cache: a 1 GiB RAM tier for the SSD tier / cache file")
        host = HostTier(int(ram_gib * GiB), c.ram_resize) if ram_gib > 0 else None
        cfg, bs = self.cfg, self.bm.block_size
        ssd = None
        if ssd_gib > 0:
            from ..cache.device import host_block_layout
            from ..models.kv_pool import num_attention_layers
            k_shape, v_shape, block_dtype = host_block_layout(cfg, bs, self.model.dtype, self.kv_dtype)
            layout = None
            if self.hybrid:             # one snapshot: conv and ssm of each linear layer
                from ..models.qwen3_5 import state_shapes
                (cs, cd), (ss, sd) = state_shapes(cfg, 1, self.model.dtype)
                n_lin = cfg.num_layers - num_attention_layers(cfg)
                layout = ([(cs[1:], cd)] * n_lin, [(ss[1:], sd)] * n_lin)
            ssd = SSDTier(c.ssd_context_dir, int(ssd_gib * GiB), c.ssd_gib_per_hour, block_shape=k_shape,
                          v_shape=v_shape, dtype=block_dtype, state_layout=layout)
        cache = PrefixCache(self.bm, host, self.snapshots, self.hybrid,
                            block_bytes=self.plan.block_bytes, ssd=ssd)
        self.cache_file = path
        if path:
            n = cache.load(path, self.fingerprint, self.model.dtype, np.uint8 if self.kv_dtype else None)
            if n:
                log.info("prefix cache: %d blocks loaded from %s", n, path)
        return cache

    def follow(self) -> None:
        """Several hosts, on a process other than the leader: run the leader's steps until it ends."""
        self.runner.follow()

    def close(self) -> None:
        """Save the prefix cache (with --prefix-cache-file) and stop the SSD writer; on several hosts
        the leader then releases the followers (which replay the save's block reads). Idempotent."""
        try:
            self._close_cache()
        finally:
            self.runner.release()
            self.runner.shapes.save()

    def _close_cache(self) -> None:
        cache, path = self.cache, self.cache_file
        self.cache_file = None
        if cache is None:
            return
        if path:
            try:
                n = cache.save(path, self.fingerprint, self.runner,
                               cache.host.capacity if cache.host is not None else GiB)
                log.info("prefix cache: saved to %s (%.1f MiB)", path, n / 2**20)
            except OSError as e:
                log.error("prefix cache: could not save %s: %s", path, e)
        if cache.ssd is not None:
            cache.stop_reads()
            cache.ssd.flush()
            cache.ssd.close()
            cache.ssd = cache.host.on_drop = None

    def warmup(self, level: str = "full") -> int:
        """Compile the step shapes of a warm-up level now (shapes.py; synchronous: scripts and tests;
        the server warms up on its device thread, see start()): "basic", the shapes a first session
        meets; "full", every shape the limits allow (slow on the CPU for big models); "none".
        Returns how many."""
        keys = self.warm_keys(level)
        self.warmed_up = level != "none"
        for key in keys:
            self._warm_one(key)
        if keys:
            self._warmed()
        return len(keys)

    def _warmed(self) -> None:
        jax.random.key_data(jax.random.PRNGKey(0))        # (each request's seed key: add())
        ll_tokenizer(self.tokenizer, self.cfg.vocab_size, self.eos_ids)    # (a constrained request's)
        self.runner.done_warming()

    def warm_keys(self, level: str) -> list[tuple]:
        if level not in ("basic", "full", "none"):
            raise ValueError(f"unknown warm-up level {level!r}: basic, full or none")
        if level == "none":
            return []
        keys = shapes.every(self.shape_limits) if level == "full" else shapes.first_session(self.shape_limits)
        if self.cache is None:
            keys = [k for k in keys if k[0] != "copy"]
        return keys

    def _warm_one(self, key: tuple) -> None:
        try:
            self.runner.warm(key, run=shapes.worth_running(key, self.runner.block_size))
        except Exception as e:  # noqa: BLE001  (a shape that cannot run here: requests will say so)
            log.warning("warm-up: step shape %s failed: %s", key, e)
            self.runner.reset_kv()          # (a failed dispatch may have consumed the donated pool)
            if self.cache is not None:      # (... and with it the cached blocks' K/V)
                self.cache.reset()

    # ---- admission -----------------------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt < 1:
            raise ValueError("the prompt is empty")
        if n_prompt + max_tokens > self.max_context:
            raise ValueError(f"this model's context is {self.max_context} tokens; the prompt has {n_prompt} "
                             f"tokens and max_tokens is {max_tokens}: shorten the prompt or lower max_tokens")

    def add(self, req: Request) -> Sequence:
        """Queue a request (on the device thread, or in synchronous use)."""
        p = req.params
        p.validate()
        self.check_fits(len(req.prompt_ids), p.max_tokens)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        seq = Sequence(req, TextTracker(self.tokenizer, tuple(p.stop)), stop_ids)
        if p.grammar is not None:
            seq.constraint = Constraint(ll_tokenizer(self.tokenizer, self.cfg.vocab_size, self.eos_ids), p.grammar)
        seed = p.seed if p.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        seq.seed_key = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)), np.uint32)
        self.scheduler.add(seq)
        return seq

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        if self.cache is not None and self.cache.host is not None:
            self.cache.host.check_memory()       # at most once a second
        self._drop_cancelled()
        self._propose()
        plan, k = self.scheduler.schedule()
        if not plan:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head of the queue still cannot start: it never will.
                seq = self.scheduler.waiting[0]
                self._emit(seq, Event("error", message="the request does not fit in the KV pool"))
                self._finish(seq, "abort")
            return
        # (before the cache's device work: blocks the rounds take may evict cached ones, which the
        # cache copies to host memory in apply(), before anything overwrites them)
        rounds = self._rounds(plan, k)
        if k > 1 and not rounds and any(n > 1 for _, n in plan):
            k = 1          # (a hybrid's row feeding its last round's tokens again, without rounds: a mixed step)
        if self.cache is not None:
            self.cache.apply(self.runner)
        t = time.perf_counter()
        outs = self.runner.run(plan, k, rounds)      # waits for the step's tokens
        dt = time.perf_counter() - t
        if self.cache is not None and k == 1:
            self.cache.costs.prefill(sum(n for _, n in plan), dt)
        if self.spec is not None:
            self.spec.timings.record(plan, k, dt, sum(len(o.ids) for o in outs), rounds)
        self._fail_unpacked(plan)
        self._postprocess(plan, k, outs)

    def _rounds(self, plan, k: int) -> int:
        """Device-side speculation rounds for a dispatch of k > 1 plain decode steps (0: run those):
        spec/policy.py decides; each row then needs slots for every token the rounds may write."""
        seqs = [s for s, _ in plan]
        if k == 1 or not self._loop_ready(seqs) or any(n != s.num_pending for s, n in plan) \
                or not self.spec.use_loop(len(plan)):
            return 0
        return self.spec.loop.rounds if self.scheduler.grow_ahead(plan, self._span) else 0

    def _span(self, seq: Sequence) -> int:
        """The slots a dispatch of rounds may write for seq: every round's whole draft, but no more
        than its output can still take (writes past its blocks are dropped); from its first token
        without K/V (a hybrid's pending ones are fed again)."""
        loop = self.spec.loop
        return min(loop.span(), seq.tokens_left(self.max_context) + 1 + loop.tree_extra) + seq.num_pending - 1

    def _loop_ok(self, seqs) -> bool:
        """Whether these rows can run device-side rounds: a multi-step dispatch (scheduler), none
        with penalties (their token histories would change along a draft)."""
        return (self.spec is not None and self.spec.loop is not None and bool(seqs)
                and self.scheduler.multi_step_ok(seqs, self.scheduler.loop_pending)
                and not any(s.params.penalized for s in seqs)
                # (a hybrid's row feeds its last depth + 1 tokens each round: steps.spec_steps)
                and (not self.hybrid or all(len(s) > self.spec.loop.depth for s in seqs)))

    def _loop_ready(self, seqs) -> bool:
        """_loop_ok, and for auto on a warmed engine (the server's) the rounds' shape compiled: auto
        does not stall a request on a compile while plain decode steps (or host rounds) can run; the
        shape is queued to compile when the engine is next idle."""
        if not self._loop_ok(seqs):
            return False
        if self.spec.mode != "auto" or not self.warmed_up:
            return True
        loop = self.spec.loop
        M = self.runner.table_width(max(max(len(s.block_ids), self.bm.blocks_for(s.num_computed + self._span(s)))
                                        for s in seqs))
        key = shapes.spec(bucket(len(seqs), minimum=1), M, loop.rounds, loop.depth,
                          any(s.params.logprobs for s in seqs), loop.nodes)
        if key in self.runner.compiled:
            return True
        if key not in self._idle_keys:
            self._idle_keys.append(key)
        return False

    def _propose(self) -> None:
        """Drafts for the running sequences that decode (speculation on): spec/policy.py decides.
        None where the batch can run device-side rounds instead (every row decoding and free of
        grammars and penalties, nothing waiting: a dispatch of several decode steps)."""
        if self.spec is None:
            return
        running = self.scheduler.running
        if self._loop_ready(running):
            for seq in running:
                seq.draft = None
            return
        for seq in running:
            seq.draft = self.spec.propose(seq, len(running), seq.tokens_left(self.max_context)) \
                if self._can_draft(seq) else None

    def _can_draft(self, seq: Sequence) -> bool:
        """Decoding (hybrids: its accepted tokens of the last round fed again count as decoding),
        and no penalties (their token histories would change along a draft)."""
        return (seq.status is Status.RUNNING and bool(seq.out_ids) and seq.num_computed > 0
                and seq.num_pending <= 1 + self.spec_depth and not seq.params.penalized)

    def _fail_unpacked(self, plan) -> None:
        """--kv-dtype bf16p: a request whose K/V a step could not pack losslessly fails alone (its
        step's tokens are dropped: nothing of this step is cached for it); the others go on."""
        lost = self.runner.take_lost()
        if not lost:
            return
        for seq, _ in plan:
            if seq.status is Status.RUNNING and lost & set(seq.block_ids):
                log.warning("request %s: K/V not packable losslessly (bf16p); the request fails", seq.id)
                seq.state_dirty = True      # (a hybrid's state absorbed the step: no snapshot of it)
                self._emit(seq, Event("error", message=(
                    "this request's K/V cannot be stored losslessly with --kv-dtype bf16p (a block needed more "
                    "exponent escapes than it holds); run it on a server with another --kv-dtype")))
                self._finish(seq, "abort")

    def _drop_cancelled(self) -> None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.req.cancelled.is_set():
                self._finish(seq, "abort")

    def _postprocess(self, plan: list[tuple[Sequence, int]], k: int, outs: list[StepOutput]) -> None:
        for (seq, n), out in zip(plan, outs):
            if seq.status is not Status.RUNNING:
                continue
            draft, seq.draft, seq.mtp_next = seq.draft, None, None
            top = seq.params.prompt_logprobs or 0
            seq.prompt_lps += [(int(t), lp, tuple((int(a), float(b)) for a, b in zip(ids[:top], lps[:top])))
                               for t, lp, ids, lps in out.prompt_lps]
            if k == 1:
                seq.num_computed += n - (len(draft) if draft else 0)
                if seq.num_pending > 0:          # a prefill chunk that did not reach the end
                    self.bm.seal_full_blocks(seq)
                    continue
            # tokens it may still emit: where the device stopped a hybrid's state updates (runner._ends)
            rem = seq.tokens_left(self.max_context)
            taken, known = 0, len(seq)
            for j in range(len(out.ids)):
                if k > 1:      # (hybrids' rounds: their tokens past out.fed are not in the state: fed again)
                    seq.num_computed = known + (j if out.fed is None else min(j, out.fed))
                # Ending here drops the rest of the dispatch: KV slots are simply overwritten, but a
                # hybrid's recurrent state has absorbed the dropped tokens (no snapshot of it then)
                # unless the device saw the end too (a stop token or the length limit) and froze it.
                # (A verify row's state holds its known tokens only: never dirty.)
                device_end = (int(out.ids[j]) in seq.stop_ids and len(seq.stop_ids) <= STOP_WIDTH) or j + 1 >= rem
                seq.state_dirty = (k > 1 and j < len(out.ids) - 1 and not device_end) if out.fed is None \
                    else out.fed > j
                taken += 1
                if self._accept(seq, out, j):
                    # the loop guard injected </think>: a hybrid's state cannot be rewound, so the
                    # sequence is recomputed (rare; mostly out of the prefix cache).
                    if self.hybrid and seq.state_dirty and seq.status is Status.RUNNING:
                        self.scheduler.requeue(seq)
                    break
                if seq.status is not Status.RUNNING:
                    break
            if draft is not None:
                self._verified(seq, draft, out, taken)
            if out.rounds:
                self.spec.observe_rounds(seq, out.rounds)
            if out.mtp and taken == len(out.ids):      # the head drafted after the last token emitted
                seq.mtp_next = (len(seq), out.mtp)
            if seq.status is Status.RUNNING:
                seq.state_dirty = False
                self.bm.seal_full_blocks(seq)
        if self.snapshots is not None:
            for seq, n in plan:      # prefill chunks (a 1-token one may end on a boundary too)
                if seq.status is Status.RUNNING and k == 1 and (n > 1 or seq.num_computed <= len(seq.prompt_ids)):
                    self.snapshots.after_chunk(seq, self.runner, self.bm)

    def _verified(self, seq: Sequence, draft, out: StepOutput, taken: int) -> None:
        """After a verify row: the accepted draft tokens whose K/V sit where they belong count as
        computed (a chain's, and a tree's while its path follows the first branch); the rest is
        fed again next step (hybrids always: their state holds the known tokens only)."""
        self.spec.observe(seq, draft, out.accepted)
        if seq.status is not Status.RUNNING or self.hybrid:
            return
        in_place = 0
        while in_place < len(out.path) and out.path[in_place] == in_place:
            in_place += 1
        seq.num_computed += min(taken - 1, in_place)

    def _accept(self, seq: Sequence, out: StepOutput, j: int) -> bool:
        """Take token j of a step's output. True when the loop guard injected </think>: the rest of a
        multi-step dispatch was computed without it and is dropped."""
        t = int(out.ids[j])
        p = seq.params
        seq.out_ids.append(t)
        lp = None
        if p.logprobs:
            alts = tuple((int(i), float(v)) for i, v in zip(out.top_ids[j][:p.top_logprobs],
                                                           out.top_lps[j][:p.top_logprobs]))
            lp = (t, float(out.lps[j]), alts)
            seq.out_logprobs.append(lp)
        prompt = tuple(seq.prompt_lps) if p.prompt_logprobs is not None and len(seq.out_ids) == 1 else None
        if t in seq.stop_ids:
            if prompt is not None:      # (the prompt's logprobs go out even when the reply is empty)
                self._emit(seq, Event("delta", prompt_logprobs=prompt))
            self._finish(seq, "stop")
            return False
        if seq.constraint is not None:
            seq.constraint.consume(t)
        injected = self._track_thinking(seq, t)
        text = seq.tracker.push(t)
        if injected:
            text += seq.tracker.push(self.think_ids[1])
        if text or lp or prompt is not None:
            self._emit(seq, Event("delta", text=text, token_ids=(t,), logprobs=(lp,) if lp else (),
                                  prompt_logprobs=prompt))
        if seq.tracker.stopped or (seq.constraint is not None and seq.constraint.done):
            self._finish(seq, "stop")
        elif len(seq.out_ids) >= p.max_tokens or len(seq) >= self.max_context:
            self._finish(seq, "length")
        return injected

    def _track_thinking(self, seq: Sequence, t: int) -> bool:
        """Follow <think> / </think>; when an open block repeats itself, close it (append </think>)."""
        if self.think_ids is None:
            return False
        start, end, _ = self.think_ids
        if t == start and not seq.thinking:
            seq.thinking, seq.think_from = True, len(seq.out_ids)
        elif t == end:
            seq.thinking = False
        elif seq.thinking and seq.params.loop_guard and (len(seq.out_ids) - seq.think_from) % 16 == 0 \
                and len(seq.out_ids) < seq.params.max_tokens and (repeats(seq.out_ids[seq.think_from:])
                                                                  or self._runs_on(seq)):
            log.warning("request %s: thinking repeats itself or runs on; closing the thinking block", seq.id)
            seq.out_ids.append(end)
            seq.thinking = False
            return True
        return False

    def _runs_on(self, seq: Sequence) -> bool:
        """The open thinking block ends in a run-on of hyphen-joined words (runs_on)."""
        if self.tokenizer is None:
            return False
        tail = seq.out_ids[max(seq.think_from, len(seq.out_ids) - 4 * RUN_ON_WORDS):]
        return runs_on(self.tokenizer.decode(tail, skip_special_tokens=True))

    def _emit(self, seq: Sequence, ev: Event) -> None:
        if ev.kind == "delta":
            seq.text_parts.append(ev.text)
        if seq.req.on_event is not None:
            seq.req.on_event(ev)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if reason != "abort":
            tail = seq.tracker.finish()
            if tail:
                self._emit(seq, Event("delta", text=tail))
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._emit(seq, Event("done", finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                              completion_tokens=len(seq.out_ids), stop_sequence=seq.tracker.matched,
                              cached_tokens=seq.num_cached, speculative=tuple(
                                  (m, c.rounds, c.drafted, c.accepted) for m, c in seq.spec.counts.items())
                              if seq.spec is not None else ()))

    # ---- synchronous API (scripts, tests) ------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Result]:
        seqs = [self.add(r) for r in requests]
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return [Result(text="".join(s.text_parts), token_ids=s.out_ids, finish_reason=s.finish_reason or "abort",
                       prompt_tokens=len(s.prompt_ids), completion_tokens=len(s.out_ids),
                       logprobs=s.out_logprobs if s.params.logprobs else None, cached_tokens=s.num_cached,
                       prompt_logprobs=s.prompt_lps if s.params.prompt_logprobs is not None else None)
                for s in seqs]

    # ---- device thread (server) ----------------------------------------------------------------
    def start(self, warmup: str | bool = "basic") -> None:
        """Run the engine on its device thread. It warms up (`warmup`: a level of warmup(); True is
        "basic", False "none") whenever no request is waiting, one step shape at a time (a request
        that comes meanwhile waits for at most one), and sets `ready` once that level is warm; then,
        still only while idle, the shapes earlier runs met."""
        level = {True: "basic", False: "none"}.get(warmup, warmup)
        before = self.warm_keys(level)
        self.warmed_up = level != "none"
        self._warm_queue = list(before)
        self._idle_keys = [k for k in self.earlier_shapes if k not in set(before)] if level != "none" else []
        if self.spec is not None and level != "none":   # one stream's rounds and verify steps, after ready
            self._idle_keys += [k for k in self.runner.spec_keys() + self.runner.verify_keys(self.spec_depth)
                                if k not in set(self._idle_keys)]
        self.warm_state.update(done=0, total=len(before))
        if not before:
            self.ready.set()
        self._thread = threading.Thread(target=self._loop, name="infernix-device", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        self._inbox.put(req)

    def stop(self) -> None:
        if self._thread:
            self._inbox.put(None)
            self._thread.join(timeout=60)
            if self._thread.is_alive():      # still inside a step: its pool and files are not ours to touch
                log.error("the device thread did not stop within 60 s; prefix cache not saved")
                return
        self.close()

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                req = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if req is None:
                self._stopping = True
                return
            try:
                self.add(req)
            except ValueError as e:  # validated by the server already; belt and braces
                if req.on_event:
                    req.on_event(Event("error", message=str(e)))

    def _warm_while_idle(self) -> bool:
        """Warm one step shape if nothing waits (the start-up level first, then the shapes earlier
        runs met); False when there is nothing left to warm or work came in."""
        if not (self._warm_queue or self._idle_keys) or self.scheduler.has_work():
            return False
        self._take_inbox(block=False)
        if self.scheduler.has_work() or self._stopping:
            return False
        if self._warm_queue:
            if self.warm_state["done"] == 0:
                self._warm_t0 = time.perf_counter()
            self._warm_one(self._warm_queue.pop(0))
            w = self.warm_state
            w["done"] += 1
            w["seconds"] = round(time.perf_counter() - self._warm_t0, 1)
            if not self._warm_queue:
                self._warmed()
                log.info("warm-up: %d step shapes in %.1f s; ready", w["total"], w["seconds"])
                self.ready.set()
            elif w["done"] % 5 == 0:
                log.info("warm-up: %d of %d step shapes (%.0f s)", w["done"], w["total"], w["seconds"])
        else:
            self._warm_one(self._idle_keys[0])
            self._idle_keys.pop(0)           # (after: an empty list means nothing is compiling)
        return True

    def _loop(self) -> None:
        while not self._stopping:
            if self._warm_while_idle():
                continue
            if not self.scheduler.has_work():
                self.runner.shapes.save()          # (while idle: a new shape is remembered for next start)
            self._take_inbox(block=not self.scheduler.has_work())
            if self._stopping:
                break
            try:
                self.step()
            except Exception as e:  # the engine survives: the step's requests fail, others go on
                log.error("step failed: %s\n%s", e, traceback.format_exc())
                # the running ones, and any the failed schedule() had begun to admit (blocks taken)
                hit = [*self.scheduler.running, *(s for s in self.scheduler.waiting if s.block_ids)]
                for seq in hit:
                    if seq.req.on_event:
                        seq.req.on_event(Event("error", message=f"internal error: {type(e).__name__}: {e}"))
                    seq.state_dirty = True
                    self.scheduler.remove(seq)
                self.runner.reset_kv()  # a failed dispatch may have consumed the donated pool
                if self.cache is not None:
                    self.cache.reset()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(seq, "abort")
