"""The only caller of jitted code: packs a scheduled batch into bucketed int32 arrays, runs one
step (or several decode steps in one dispatch), and brings the sampled tokens back in one transfer."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from ..models.hybrid_paged import StateRows
from ..models.paged import PagedKV, init_paged_kv
from ..quant.apply import with_impl
from .. import distributed, sharding
from . import steps
from .sampler import Penalties, SamplingArrays, ThinkGuard
from .sequence import Sequence


class StepOutput:
    """Per scheduled row: sampled ids [k], logprobs [k], and top ids/logprobs [k, TOP] if asked."""

    def __init__(self, ids, lps, top_ids=None, top_lps=None):
        self.ids, self.lps, self.top_ids, self.top_lps = ids, lps, top_ids, top_lps


log = logging.getLogger("infernix.engine")

STOP_WIDTH = 8        # stop token ids per row the device checks (a fixed width: no recompiles)


_any = jax.jit(jnp.any)


class Runner:
    def __init__(self, model, num_blocks: int, block_size: int, attn_impl: str = "reference", state_slots: int = 0,
                 max_context: int = 0, kv_dtype: str = "", parallel: sharding.Parallel | None = None):
        # several devices: the weights and the KV pool split over a mesh (sharding.py), every step
        # traced and run on it; None or one device: nothing changes
        self.mesh = sharding.make_mesh(parallel) if parallel else None
        self.cfg = model.cfg
        self.params = with_impl(model.params, attn_impl)     # quantized weights: the kernels of this impl
        if self.mesh is not None:
            self.params = sharding.shard_params(self.params, self.mesh, self.cfg)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.attn_impl = attn_impl
        self.dtype = model.dtype
        self.kv_dtype = kv_dtype
        self.think_ids = None      # (<think>, </think>, banned ids) when the model has thinking tokens
        self.hybrid = bool(self.cfg.layer_types)
        self.state_slots = state_slots if self.hybrid else 0
        self.max_context = max_context or self.cfg.max_position_embeddings     # outputs end there (_ends)
        self._op_reset_kv()
        # several hosts (distributed.py): the leader's device calls go to every other process, which
        # replays them (follow); all built the same engine first
        self.channel = distributed.Channel() if distributed.several() else None
        if self.channel is not None:
            self.channel.agree((num_blocks, block_size, self.state_slots, kv_dtype, attn_impl, parallel,
                                str(self.cfg)), "engine")

    # ---- device calls: each one runs here and, on several hosts, on every process ---------------
    def _device(self, op: str, *args, **kw):
        """Run device op `op` (method _op_<op>) with these host arguments; the leader of several
        hosts sends it to the followers first (they replay it in order)."""
        if self.channel is not None and distributed.is_leader():
            self.channel.send((op, args, kw))
        return getattr(self, "_op_" + op)(*args, **kw)

    def follow(self) -> None:
        """A follower's life: replay the leader's device calls until it releases us. A call that
        fails here is logged and the next one taken (the leader's recovery, a pool reset, follows)."""
        while (msg := self.channel.receive()) is not None:
            op, args, kw = msg
            try:
                getattr(self, "_op_" + op)(*args, **kw)
            except Exception as e:  # noqa: BLE001  (stay in step with the leader)
                log.error("replaying %s failed: %s", op, e)

    def release(self) -> None:
        """The leader's last word to the followers (their follow() returns). Idempotent."""
        if self.channel is not None and distributed.is_leader():
            self.channel.send(None)
            self.channel = None

    def _op_mixed(self, *args, **kw):
        with sharding.use(self.mesh):
            out, self.kv = steps.mixed_step(self.params, self.cfg, self.kv, *args, **kw)
        return out

    def _op_decode(self, *args, **kw):
        with sharding.use(self.mesh):
            out, self.kv = steps.decode_steps(self.params, self.cfg, self.kv, *args, **kw)
        return out

    def _op_copy_blocks(self, pairs):
        from ..models.kv_blocks import copy_blocks
        self.kv = copy_blocks(self.kv, pairs)
        return self.kv

    def copy_blocks(self, kv, pairs) -> PagedKV:
        """The prefix cache's copy-on-write of blocks in pool kv (this runner's, or the one the
        cache's uploads just made of it; donated)."""
        self.kv = kv
        return self._device("copy_blocks", pairs)

    def reset_kv(self) -> None:
        self._device("reset_kv")

    def _op_reset_kv(self) -> None:
        self.kv: PagedKV = sharding.make_sharded(
            lambda: init_paged_kv(self.cfg, self.num_blocks, self.block_size, self.dtype, self.state_slots,
                                  self.kv_dtype), sharding.kv_specs, self.mesh)

    def take_lost(self) -> set[int]:
        """--kv-dtype bf16p: the blocks a step could not pack losslessly (kv_bf16p), cleared as they
        are read; empty for every other KV format (and then free: no transfer)."""
        if self.kv.lost is None or not bool(_any(self.kv.lost)):
            return set()
        ids = np.flatnonzero(np.asarray(self.kv.lost))
        self.kv = self.kv.replace(lost=jnp.zeros_like(self.kv.lost))
        return set(int(i) for i in ids)

    def _state_rows(self, plan, B: int, N: int) -> StateRows | None:
        """Hybrids: the two layouts of the linear layers (one-token rows, several-token rows)."""
        if not self.hybrid:
            return None
        S = self.state_slots
        dec_tok, dec_slot, dec_fresh = np.full((B,), N, np.int32), np.full((B,), S, np.int32), np.zeros((B,), bool)
        multi, off = [], 0
        for i, (s, n) in enumerate(plan):
            if n == 1:
                dec_tok[i], dec_slot[i], dec_fresh[i] = off, s.state_slot, s.num_computed == 0
            else:
                multi.append((off, n, s))
            off += n
        if not multi:
            return StateRows(dec_tok, dec_slot, dec_fresh)
        Bp = steps.bucket(len(multi), minimum=1)
        pre_tok = np.full((Bp, N), N, np.int32)
        pre_len, pre_slot, pre_fresh = np.zeros((Bp,), np.int32), np.full((Bp,), S, np.int32), np.zeros((Bp,), bool)
        for r, (o, n, s) in enumerate(multi):
            pre_tok[r, :n] = np.arange(o, o + n)
            pre_len[r], pre_slot[r], pre_fresh[r] = n, s.state_slot, s.num_computed == 0
        return StateRows(dec_tok, dec_slot, dec_fresh, pre_tok, pre_len, pre_slot, pre_fresh)

    def _sampling(self, seqs: list[Sequence], B: int) -> tuple[SamplingArrays, np.ndarray]:
        temp = np.zeros((B,), np.float32)
        top_p = np.ones((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        min_p = np.zeros((B,), np.float32)
        keys = np.zeros((B, 2), np.uint32)
        st = np.zeros((B,), np.int32)
        for i, s in enumerate(seqs):
            p = s.params
            temp[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
            keys[i] = s.seed_key
            st[i] = len(s.out_ids)
        return SamplingArrays(keys=keys, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p), st

    def _penalties(self, seqs: list[Sequence], B: int) -> Penalties | None:
        """Token histories of the rows that ask for penalties (None when none does: no extra work)."""
        if not any(s.params.penalized for s in seqs):
            return None
        V = self.cfg.vocab_size
        hist = [np.unique(np.asarray(s.out_ids, np.int32), return_counts=True) if s.params.penalized
                else (np.zeros(0, np.int32), np.zeros(0, np.int64)) for s in seqs]
        seen = [np.unique(np.asarray(s.all_ids, np.int32)) if s.params.repetition_penalty != 1 else
                np.zeros(0, np.int32) for s in seqs]
        L = steps.bucket(max(len(h[0]) for h in hist), minimum=16)
        Lp = steps.bucket(max(len(x) for x in seen), minimum=16)
        out_ids = np.full((B, L), V, np.int32)
        out_counts = np.zeros((B, L), np.int32)
        seen_ids = np.full((B, Lp), V, np.int32)
        pres, freq, rep = np.zeros((B,), np.float32), np.zeros((B,), np.float32), np.ones((B,), np.float32)
        for i, s in enumerate(seqs):
            ids, cnt = hist[i]
            out_ids[i, :len(ids)], out_counts[i, :len(ids)] = ids, cnt
            seen_ids[i, :len(seen[i])] = seen[i]
            p = s.params
            pres[i], freq[i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        return Penalties(out_ids, out_counts, seen_ids, pres, freq, rep)

    def _guard(self, seqs: list[Sequence], B: int) -> ThinkGuard | None:
        """The end-in-thinking guard (for every batch of a model with thinking tokens, enabled on the
        rows that ask for it: one compiled variant, whatever the mix)."""
        if self.think_ids is None:
            return None
        start, end, banned = self.think_ids
        enabled = np.zeros((B,), bool)
        is_open = np.zeros((B,), bool)
        for i, s in enumerate(seqs):
            enabled[i] = s.params.think_guard
            is_open[i] = s.params.think_guard and s.thinking
        return ThinkGuard(open=is_open, enabled=enabled, banned=np.asarray(banned, np.int32),
                          start=np.int32(start), end=np.int32(end))

    def _allowed(self, plan, B: int) -> np.ndarray | None:
        """Token bitmasks of constrained rows that sample this step (None when no row is constrained)."""
        if not any(s.constraint is not None for s, _ in plan):
            return None
        mask = np.full((B, (self.cfg.vocab_size + 31) // 32), -1, np.int32)
        for i, (s, n) in enumerate(plan):
            if s.constraint is not None and s.num_computed + n == len(s):     # this row samples a token
                s.constraint.fill(mask, i)
        return mask

    def _block_table(self, seqs: list[Sequence], B: int) -> np.ndarray:
        M = steps.bucket(max(len(s.block_ids) for s in seqs), minimum=1)
        bt = np.zeros((B, M), np.int32)
        for i, s in enumerate(seqs):
            bt[i, :len(s.block_ids)] = s.block_ids
        return bt

    def run(self, plan: list[tuple[Sequence, int]], num_steps: int) -> list[StepOutput]:
        seqs = [s for s, _ in plan]
        want_top = any(s.params.logprobs for s in seqs)
        if num_steps > 1:
            return self._decode(seqs, num_steps, want_top)
        return self._mixed(plan, want_top)

    def _mixed(self, plan, want_top: bool) -> list[StepOutput]:
        seqs = [s for s, _ in plan]
        n_real = sum(n for _, n in plan)
        N = steps.bucket(n_real)
        B = steps.bucket(len(plan), minimum=1)
        bs = self.block_size
        tokens = np.zeros((N,), np.int32)
        positions = np.zeros((N,), np.int32)
        slots = np.full((N,), self.num_blocks * bs, np.int32)       # out of range: dropped
        kv_lens = np.zeros((B,), np.int32)
        cu_q = np.full((B + 1,), n_real, np.int32)
        logits_idx = np.zeros((B,), np.int32)
        off = 0
        for i, (s, n) in enumerate(plan):
            pos = np.arange(s.num_computed, s.num_computed + n)
            tokens[off:off + n] = s.tokens(s.num_computed, s.num_computed + n)
            positions[off:off + n] = pos
            blocks = np.asarray(s.block_ids, np.int32)
            slots[off:off + n] = blocks[pos // bs] * bs + pos % bs
            cu_q[i] = off
            kv_lens[i] = s.num_computed + n
            logits_idx[i] = off + n - 1
            off += n
        sampling, st = self._sampling(seqs, B)
        out = self._device("mixed", tokens, positions, slots, self._block_table(seqs, B), kv_lens, cu_q, logits_idx,
                           st, sampling, attn_impl=self.attn_impl, want_top=want_top,
                           penalties=self._penalties(seqs, B), allowed=self._allowed(plan, B),
                           guard=self._guard(seqs, B), rows=self._state_rows(plan, B, N))
        out = jax.device_get(out)
        return [StepOutput(*(a[i:i + 1] for a in out)) for i in range(len(plan))]

    def _decode(self, seqs: list[Sequence], k: int, want_top: bool) -> list[StepOutput]:
        B = steps.bucket(len(seqs), minimum=1)
        tokens = np.zeros((B,), np.int32)
        positions = np.zeros((B,), np.int32)
        valid = np.zeros((B,), bool)
        for i, s in enumerate(seqs):
            tokens[i] = s.out_ids[-1]
            positions[i] = len(s) - 1
            valid[i] = True
        sampling, st = self._sampling(seqs, B)
        out = self._device("decode", tokens, positions, self._block_table(seqs, B), valid, st, sampling,
                           num_steps=k, attn_impl=self.attn_impl, want_top=want_top,
                           penalties=self._penalties(seqs, B), guard=self._guard(seqs, B),
                           rows=self._state_rows([(s, 1) for s in seqs], B, B), **self._ends(seqs, B))
        out = jax.device_get(out)                                   # each [k, B] (or [k, B, TOP])
        return [StepOutput(*(a[:, i] for a in out)) for i in range(len(seqs))]

    def _ends(self, seqs: list[Sequence], B: int) -> dict:
        """Where each row's output ends on the device (decode_steps writes no K/V past it and freezes
        a hybrid's state there): its stop token ids and the tokens it may still emit (max_tokens,
        the context). Stop strings are found on the host: their rows run to the dispatch's end."""
        stop_ids, remaining = np.full((B, STOP_WIDTH), -1, np.int32), np.zeros((B,), np.int32)
        for i, s in enumerate(seqs):
            ids = sorted(s.stop_ids)[:STOP_WIDTH]     # (more: the engine treats its state as dirty)
            stop_ids[i, :len(ids)] = ids
            remaining[i] = s.tokens_left(self.max_context)
        return {"stop_ids": stop_ids, "remaining": remaining}

    def warmup(self, max_num_seqs: int, token_budget: int, max_blocks_per_seq: int, decode_steps: int,
               max_prefill_rows: int | None = None) -> int:
        """Compile every bucketed shape the scheduler can produce under these limits, so that serving
        never compiles. Returns the number of shapes visited."""
        bucket = steps.bucket
        Ns = _pow2_range(16, bucket(token_budget))
        Bs = _pow2_range(1, bucket(max_num_seqs, minimum=1))
        Ms = _pow2_range(1, bucket(max_blocks_per_seq, minimum=1))
        dropped = self.num_blocks * self.block_size
        n = 0
        for B in Bs:
            sampling = SamplingArrays.greedy(B)
            zeros_b = np.zeros((B,), np.int32)
            for M in Ms:
                bt = np.zeros((B, M), np.int32)
                for N in (N for N in Ns if N >= B):
                    for rows in self._warmup_rows(B, N, max_prefill_rows or max_num_seqs):
                        self._device(
                            "mixed", np.zeros((N,), np.int32), np.zeros((N,), np.int32),
                            np.full((N,), dropped, np.int32), bt, np.ones((B,), np.int32),
                            np.arange(B + 1, dtype=np.int32), zeros_b, zeros_b, sampling, attn_impl=self.attn_impl,
                            want_top=False, penalties=None, allowed=None, guard=self._guard([], B), rows=rows)
                        n += 1    # (the same keywords as run(): jit keys its cache on them)
                if decode_steps > 1:
                    self._device(
                        "decode", zeros_b, zeros_b, bt, np.zeros((B,), bool), zeros_b,
                        sampling, num_steps=decode_steps, attn_impl=self.attn_impl, want_top=False,
                        penalties=None, guard=self._guard([], B), rows=self._warmup_rows(B, B, 0)[0],
                        **self._ends([], B))
                    n += 1
        jax.block_until_ready(self.kv.k[0])
        return n

    def _warmup_rows(self, B: int, N: int, max_prefill_rows: int) -> list:
        """Every StateRows shape a step of B rows over N tokens can have (all padding: no state moves)."""
        if not self.hybrid:
            return [None]
        S = self.state_slots
        dec = (np.full((B,), N, np.int32), np.full((B,), S, np.int32), np.zeros((B,), bool))
        out = [StateRows(*dec)]
        for Bp in _pow2_range(1, steps.bucket(min(B, max_prefill_rows), minimum=1)) if max_prefill_rows else ():
            out.append(StateRows(*dec, np.full((Bp, N), N, np.int32), np.zeros((Bp,), np.int32),
                                 np.full((Bp,), S, np.int32), np.zeros((Bp,), bool)))
        return out


def _pow2_range(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out
