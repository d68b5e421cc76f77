"""The prefix cache: on admission a sequence takes over the longest computed prefix of its tokens
that some tier still holds, instead of prefilling it.

Tiers: cached device blocks (shared read-only, block_manager), the RAM tier (host_tier: copied back
into fresh blocks), the SSD tier (ssd_tier: read, checked and copied back), and for hybrid models the recurrent-state snapshots (snapshots.py), without which
a hybrid cannot resume: a hybrid resumes at the deepest prefix that has a snapshot. The last,
partly matching block is copied (copy-on-write: the sequence writes into it). The prompt's last
token is always computed (its logits start the output).

The scheduler asks `lookup` (no side effects); when it is about to admit a sequence whose hit has
blocks on the SSD, `start_fetch` reads them on a background thread (other sequences keep stepping)
and the sequence is looked up again once they are staged on it (a record that fails its checksum
ends the hit there); then the scheduler `commit`s the hit;
the device work that implies (reading evicted blocks out, writing blocks back, block copies, state
restores) is queued and done by `apply` just before the step, in an order that keeps every read
ahead of the writes that could clobber it, through the engine's runner (the one caller of the
device: engine/runner.py, cache/device.py)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import cache_file
from .device import stack_pieces
from .block_manager import BlockManager, chain_key
from .host_tier import HostEntry, HostTier


@dataclasses.dataclass
class Hit:
    full: list            # per reused full block: (device block or None, HostEntry or None, key)
    tail: tuple | None    # the partly reused block: (device block or None, HostEntry or None, tokens reused)
    snapshot: object      # hybrids: the state after `tokens` tokens
    tokens: int           # tokens reused
    pinned_free: int      # device blocks of the hit that sit in the free LRU now (not free once taken)

    @property
    def on_disk(self) -> bool:
        return any(isinstance(e, OnDisk) for _, e, _ in self.full) or isinstance(self.snapshot, OnDisk) or \
            (self.tail is not None and isinstance(self.tail[1], OnDisk))

    @property
    def device_blocks(self) -> int:
        return sum(b is not None for b, _, _ in self.full)


@dataclasses.dataclass
class OnDisk:
    """A block (or, with parent None, a state snapshot) the SSD tier holds (read by start_fetch)."""
    key: int
    parent: int
    tokens: tuple


class Costs:
    """Whether reading blocks off the SSD beats computing them: running means of the SSD tier's
    read speed (bytes/s, from its reads) and of prefill speed (tokens/s, from the engine's steps).
    Until both are known, read. A decision to compute is revisited every `retry_s` seconds with a
    real read (the disk, or what the page cache holds of it, may have become faster)."""

    def __init__(self, retry_s: float = 600.0, clock=time.monotonic):
        self.read_bps = self.prefill_tps = None
        self.retry_s, self._clock, self._last_read = retry_s, clock, clock()

    @staticmethod
    def _mean(old, new):
        return new if old is None else 0.7 * old + 0.3 * new

    def disk_read(self, nbytes: int, seconds: float) -> None:
        self._last_read = self._clock()
        if nbytes > 0 and seconds > 0:
            self.read_bps = self._mean(self.read_bps, nbytes / seconds)

    def prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 256 and seconds > 0:            # long enough to be about compute, not overhead
            self.prefill_tps = self._mean(self.prefill_tps, tokens / seconds)

    def disk_pays(self, nbytes: int, tokens: int) -> bool:
        if self.read_bps is None or self.prefill_tps is None:
            return True
        if self._clock() - self._last_read > self.retry_s:
            return True
        return nbytes / self.read_bps < tokens / self.prefill_tps


def _common(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ne = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(ne[0]) if ne.size else n


class PrefixCache:
    def __init__(self, bm: BlockManager, host: HostTier | None = None, snapshots=None, hybrid: bool = False,
                 block_bytes: int = 0, ssd=None):
        self.bm = bm
        self.host = host
        self.ssd = ssd
        if ssd is not None:
            host.on_drop = ssd.put                 # what the RAM tier gives up goes down to the SSD
            if snapshots is not None:
                snapshots.on_drop = ssd.put_snapshot
        self.snapshots = snapshots
        self.hybrid = hybrid
        self.block_bytes = block_bytes            # one block's K and V over all attention layers
        bm.on_evict = self._on_evict
        self._evicted: list = []                  # metas of cached blocks reused for new data
        self._uploads: list[tuple[int, HostEntry]] = []
        self._copies: list[tuple[int, int]] = []
        self._restores: list = []                 # (seq, snapshot)
        self.stats = {"queried": 0, "device": 0, "ram": 0, "ssd": 0,      # prompt tokens looked up / reused per tier
                      "ssd_skipped": 0}                               # ... found on the SSD but computed (costs)
        self.costs = Costs()
        self._reader = None                        # the thread that reads the SSD tier for admissions

    # ---- lookup and commit (scheduler, at admission) -------------------------------------------
    def lookup(self, seq) -> Hit | None:
        bm, bs, host = self.bm, self.bm.block_size, self.host
        tokens = seq.all_ids
        cap = len(tokens) - 1                      # the last token is always computed
        full, parent, j = [], bm.root, 0
        while (j + 1) * bs <= cap:
            key = chain_key(parent, tokens[j * bs:(j + 1) * bs])
            b = bm.by_key.get(key)
            e = host.get(key) if b is None and host is not None else None
            if b is None and e is None:
                e = self._disk(seq, key, parent, tokens[j * bs:(j + 1) * bs])
            if b is None and e is None:
                break
            full.append((b, e, key))
            parent, j = key, j + 1
        want = tokens[j * bs:min((j + 1) * bs, cap)]
        tail = self._best_tail(seq, parent, want)
        snap = None
        if self.hybrid:                            # resume only where a state snapshot exists
            full, tail, snap = self._deepest_snapshot(seq, full, tail)
        return self._hit(full, tail, snap)

    def _hit(self, full, tail, snap) -> Hit | None:
        n = len(full) * self.bm.block_size + (tail[2] if tail else 0)
        if n == 0:
            return None
        ref = self.bm.ref
        pinned = sum(b is not None and ref[b] == 0 for b, _, _ in full)
        pinned += tail is not None and tail[0] is not None and ref[tail[0]] == 0
        return Hit(full, tail, snap, n, int(pinned))

    def _disk(self, seq, key: int, parent: int, tokens):
        """A block the SSD tier holds: read for seq already (its entry; None if the read failed),
        or OnDisk, to read (only once per sequence: after a read, what is still on disk is a miss)."""
        if seq.staged is not None:
            return seq.staged.get(key)
        if self.ssd is not None and key in self.ssd:
            return OnDisk(key, parent, tuple(tokens))
        return None

    def _best_tail(self, seq, parent: int, want) -> tuple | None:
        """The cached block below `parent` sharing the longest start with `want`: (block, entry, m)."""
        best = (None, None, 0)
        if not want:
            return None
        for b in self.bm.children.get(parent, ()):
            m = _common(self.bm.meta[b].tokens, want)
            if m > best[2]:
                best = (b, None, m)
        if self.host is not None:
            for e in self.host.below(parent):
                m = _common(e.tokens, want)
                if m > best[2]:
                    best = (None, e, m)
        if self.ssd is not None and best[2] < len(want):
            for key, toks in self.ssd.below(parent):
                m = _common(toks, want)
                if m > best[2]:
                    e = self._disk(seq, key, parent, toks)
                    if e is not None:
                        best = (None, e, m)
        return best if best[2] else None

    def _snapshot(self, seq, key: int, disk: bool):
        """The snapshot after the prefix `key`: in RAM, read for seq already, or OnDisk (if disk)."""
        snap = self.snapshots.get(key)
        if snap is None and seq.staged is not None:
            snap = seq.staged.get(("snap", key))
        elif snap is None and disk and self.ssd is not None and self.ssd.has_snapshot(key):
            snap = OnDisk(key, None, ())
        return snap

    def _deepest_snapshot(self, seq, full, tail, disk: bool = True):
        if self.snapshots is None:
            return [], None, None
        snaps = lambda key: self._snapshot(seq, key, disk)  # noqa: E731
        if tail is not None:
            b, e, m = tail
            key = self.bm.meta[b].key if b is not None else e.key
            toks = self.bm.meta[b].tokens if b is not None else e.tokens
            snap = snaps(key) if m == len(toks) else None    # the snapshot holds the whole block's tokens
            if snap is not None:
                return full, tail, snap
        for d in range(len(full), 0, -1):
            snap = snaps(full[d - 1][2])
            if snap is not None:
                return full[:d], None, snap
        return [], None, None

    def start_fetch(self, seq, hit: Hit, without: Hit | None) -> bool:
        """Start reading the hit's SSD blocks in the background (True), unless reading them is
        expected to be slower than computing them (False: the caller takes `without`, the hit
        without them: drop_disk). When the read is done, seq.staged holds what it got and lookup
        finds it there."""
        want = [e.key for _, e, _ in hit.full if isinstance(e, OnDisk)]
        if hit.tail is not None and isinstance(hit.tail[1], OnDisk):
            want.append(hit.tail[1].key)
        snap = hit.snapshot.key if isinstance(hit.snapshot, OnDisk) else None
        if want:    # (a snapshot alone is a small read that saves a whole prefix: always worth it)
            saved = hit.tokens - (without.tokens if without else 0)
            if not self.costs.disk_pays(len(want) * self.block_bytes, saved):
                return False
        if self._reader is None:
            from concurrent.futures import ThreadPoolExecutor
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infernix-ssd-read")
        seq.fetching = self._reader.submit(self._read, want, snap)
        return True

    def _read(self, keys: list[int], snap: int | None) -> dict:
        t = time.perf_counter()
        got = dict(zip(keys, self.ssd.get_many(keys)))
        self.costs.disk_read(sum(e is not None for e in got.values()) * self.block_bytes, time.perf_counter() - t)
        if snap is not None:
            got[("snap", snap)] = self.ssd.get_snapshot(snap)
        return got

    def take_fetched(self, seq) -> None:
        """The read started for seq is done: stage what it got (a failed read is all misses)."""
        try:
            seq.staged = seq.fetching.result()
        except Exception:  # noqa: BLE001 - a failing disk is a miss, never a dead engine
            seq.staged = {}
        seq.fetching = None

    def stop_reads(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    def drop_disk(self, seq, hit: Hit) -> Hit | None:
        """The hit up to its first block (or snapshot) on the SSD."""
        full, tail = [], hit.tail
        for b, e, key in hit.full:
            if isinstance(e, OnDisk):
                tail = None
                break
            full.append((b, e, key))
        if tail is not None and isinstance(tail[1], OnDisk):
            tail = None
        snap = hit.snapshot
        if self.hybrid:
            full, tail, snap = self._deepest_snapshot(seq, full, tail, disk=False)
        return self._hit(full, tail, snap)

    def commit(self, seq, hit: Hit) -> None:
        bm = self.bm
        for b, _, _ in hit.full:                   # pin what is on the device before taking blocks
            if b is not None:
                bm.share(b)
        src = hit.tail[0] if hit.tail else None
        if src is not None:
            bm.share(src)
        parent = bm.root
        for b, e, key in hit.full:
            if b is None:
                b = bm.take()
                bm.register(b, parent, e.tokens, key)
                self._uploads.append((b, e))
                self.stats[self._tier(e)] += bm.block_size
            else:
                self.stats["device"] += bm.block_size
            seq.block_ids.append(b)
            seq.block_keys.append(key)
            parent = key
        seq.num_sealed = len(hit.full)
        if hit.tail is not None:
            _, e, m = hit.tail
            dst = bm.take()
            seq.block_ids.append(dst)
            if src is not None:
                self._copies.append((src, dst))
                self.stats["device"] += m
            else:
                self._uploads.append((dst, e))
                self.stats[self._tier(e)] += m
        if hit.snapshot is not None:
            self._restores.append((seq, hit.snapshot))
        seq.num_computed = hit.tokens
        if not seq.admitted:                       # usage reports the first admission's hit
            seq.num_cached = hit.tokens

    def _tier(self, e) -> str:
        return "ram" if self.host is not None and isinstance(e, HostEntry) else "ssd"

    def count_query(self, seq) -> None:
        self.stats["queried"] += len(seq.all_ids)

    # ---- device work (engine, before each step) ------------------------------------------------
    def _on_evict(self, b: int, meta) -> None:
        if self.host is not None and meta.key not in self.host:
            self._evicted.append((b, meta))

    def apply(self, runner) -> None:
        """Do the queued device work through runner (engine/runner.py). Nothing here waits for the
        device: copies out and in are started and overlap the step that follows."""
        if self.host is not None and self._evicted:
            ev = self._evicted
            for k, v, lo, hi in runner.read_blocks([b for b, _ in ev]):
                self.host.add([m for _, m in ev[lo:hi]], k, v, self.block_bytes)
            self._evicted = []
        if self._uploads:
            self._upload(runner, self._uploads)
            self._uploads = []
        if self._copies:
            runner.copy_blocks(self._copies)
            for src, _ in self._copies:
                self.bm.unref(src)
            self._copies = []
        if self._restores:
            for seq, snap in self._restores:
                runner.restore_snapshot(seq.state_slot, snap)
            self._restores = []

    @staticmethod
    def _upload(runner, ups: list) -> None:
        """Write (device block, entry) pairs: RAM-tier blocks one transfer per piece they lie in,
        blocks read from the SSD stacked into pieces first."""
        by_piece, loose = {}, []
        for b, e in ups:
            if isinstance(e, HostEntry):
                by_piece.setdefault(id(e.piece), (e.piece, [], []))
                _, rows, dst = by_piece[id(e.piece)]
                rows.append(e.row)
                dst.append(b)
            else:
                loose.append((b, e.arrays()))       # read from the SSD
        for piece, rows, dst in by_piece.values():
            if 2 * len(rows) >= piece.k.shape[0]:          # most of the piece: send it whole
                runner.write_rows(piece.k, piece.v, rows, dst)
            else:                                           # a few rows: not the whole piece to the device
                k, v = piece.numpy()
                loose += [(b, (k[r], v[r])) for r, b in zip(rows, dst)]
        for k, v, lo, hi in stack_pieces([a for _, a in loose]):
            runner.write_rows(k, v, list(range(hi - lo)), [b for b, _ in loose[lo:hi]])

    # ---- across restarts (cache_file) ----------------------------------------------------------
    def save(self, path: str, fp: dict, runner, cap_bytes: int) -> int:
        """Write the device's cached blocks (read through runner), then the RAM tier's (newest
        first), up to cap_bytes."""
        blocks, used = [], 0
        dev = [b for b, m in self.bm.meta.items() if self.host is None or m.key not in self.host]
        dev = dev[:max(0, cap_bytes // max(1, self.block_bytes))]
        for k, v, lo, hi in runner.read_blocks(dev):
            k, v = np.asarray(k), np.asarray(v)
            for i, b in enumerate(dev[lo:hi]):
                m = self.bm.meta[b]
                blocks.append((m.key, m.parent, m.tokens, k[i], v[i]))
                used += self.block_bytes
        if self.host is not None:
            held = {}                              # one numpy copy per piece, not one per block
            for e in reversed(self.host.entries.values()):
                if used + e.nbytes > cap_bytes:
                    break
                if id(e.piece) not in held:
                    held[id(e.piece)] = e.piece
                    e.piece.hold()
                blocks.append((e.key, e.parent, e.tokens, *(a.copy() for a in e.arrays())))
                used += e.nbytes
            for piece in held.values():
                piece.release()
        snaps = list(self.snapshots.items()) if self.snapshots is not None else []
        return cache_file.save(path, fp, blocks, snaps, self.ssd.state() if self.ssd is not None else None)

    def load(self, path: str, fp: dict, dtype, block_dtype=None) -> int:
        """Take back what save() wrote (into the RAM tier); returns the blocks loaded. dtype: the
        model's (hybrids' conv states); block_dtype: the blocks' (default dtype; uint8 bytes for
        quantized KV)."""
        saved = cache_file.load(path, fp, dtype, block_dtype)
        if saved is None:
            return 0
        if self.ssd is not None and saved["ssd"]:        # first: what the RAM store gives up below goes there
            self.ssd.restore(saved["ssd"])
        self.host.put_many(saved["blocks"][::-1])        # oldest first: the newest end up newest
        if self.snapshots is not None:
            from .snapshots import StateSnapshot
            for key, n, conv, ssm in saved["snapshots"]:
                self.snapshots.put(key, StateSnapshot(conv, ssm, n))
        return len(saved["blocks"])

    def reset(self) -> None:
        """The device pool was lost: forget the device tier and the queued work."""
        for src, _ in self._copies:
            self.bm.unref(src)
        self._evicted, self._uploads, self._copies, self._restores = [], [], [], []
        self.bm.clear_cache()
