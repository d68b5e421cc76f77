"""The prefix cache: on admission a sequence takes over the longest computed prefix of its tokens
that some tier still holds, instead of prefilling it.

Tiers: cached device blocks (shared read-only, block_manager), the RAM tier (host_tier: copied back
into fresh blocks), the SSD tier (ssd_tier: read, checked and copied back), and for hybrid models the recurrent-state snapshots (snapshots.py), without which
a hybrid cannot resume: a hybrid resumes at the deepest prefix that has a snapshot. The last,
partly matching block is copied (copy-on-write: the sequence writes into it). The prompt's last
token is always computed (its logits start the output).

The scheduler asks `lookup` (no side effects), `fetch`es the hit's SSD blocks when it is about to
admit the sequence (a record that fails its checksum ends the hit there), then `commit`s it;
the device work that implies (reading evicted blocks out, writing blocks back, block copies, state
restores) is queued and done by `apply` just before the step, in an order that keeps every read
ahead of the writes that could clobber it."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..models import kv_blocks
from . import cache_file
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
        return any(isinstance(e, OnDisk) for _, e, _ in self.full) or \
            (self.tail is not None and isinstance(self.tail[1], OnDisk))

    @property
    def device_blocks(self) -> int:
        return sum(b is not None for b, _, _ in self.full)


@dataclasses.dataclass
class OnDisk:
    """A block the SSD tier holds (read by fetch)."""
    key: int
    parent: int
    tokens: tuple


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
        self.snapshots = snapshots
        self.hybrid = hybrid
        self.block_bytes = block_bytes            # one block's K and V over all attention layers
        bm.on_evict = self._on_evict
        self._evicted: list = []                  # metas of cached blocks reused for new data
        self._uploads: list[tuple[int, HostEntry]] = []
        self._copies: list[tuple[int, int]] = []
        self._restores: list = []                 # (seq, snapshot)
        self.stats = {"queried": 0, "device": 0, "ram": 0, "ssd": 0}    # prompt tokens looked up / reused per tier

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
            if b is None and e is None and self.ssd is not None and key in self.ssd:
                e = OnDisk(key, parent, tuple(tokens[j * bs:(j + 1) * bs]))
            if b is None and e is None:
                break
            full.append((b, e, key))
            parent, j = key, j + 1
        want = tokens[j * bs:min((j + 1) * bs, cap)]
        tail = self._best_tail(parent, want)
        snap = None
        if self.hybrid:                            # resume only where a state snapshot exists
            full, tail, snap = self._deepest_snapshot(full, tail, want)
        return self._hit(full, tail, snap)

    def _hit(self, full, tail, snap) -> Hit | None:
        n = len(full) * self.bm.block_size + (tail[2] if tail else 0)
        if n == 0:
            return None
        ref = self.bm.ref
        pinned = sum(b is not None and ref[b] == 0 for b, _, _ in full)
        pinned += tail is not None and tail[0] is not None and ref[tail[0]] == 0
        return Hit(full, tail, snap, n, int(pinned))

    def _best_tail(self, parent: int, want) -> tuple | None:
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
                    best = (None, OnDisk(key, parent, toks), m)
        return best if best[2] else None

    def _deepest_snapshot(self, full, tail, want):
        snaps = self.snapshots
        if snaps is None:
            return [], None, None
        if tail is not None:
            b, e, m = tail
            key = self.bm.meta[b].key if b is not None else e.key
            toks = self.bm.meta[b].tokens if b is not None else e.tokens
            snap = snaps.get(key) if m == len(toks) else None    # the snapshot holds the whole block's tokens
            if snap is not None:
                return full, tail, snap
        for d in range(len(full), 0, -1):
            snap = snaps.get(full[d - 1][2])
            if snap is not None:
                return full[:d], None, snap
        return [], None, None

    def fetch(self, hit: Hit) -> Hit | None:
        """Read the hit's SSD blocks; the hit ends before the first one that cannot be read."""
        if not hit.on_disk:
            return hit
        want = [e.key for _, e, _ in hit.full if isinstance(e, OnDisk)]
        if hit.tail is not None and isinstance(hit.tail[1], OnDisk):
            want.append(hit.tail[1].key)
        read = dict(zip(want, self.ssd.get_many(want)))
        full, tail = [], hit.tail
        for b, e, key in hit.full:
            if isinstance(e, OnDisk):
                e = read[key]
                if e is None:
                    tail = None
                    break
            full.append((b, e, key))
        if tail is not None and isinstance(tail[1], OnDisk):
            e = read[tail[1].key]
            tail = None if e is None else (None, e, tail[2])
        snap = hit.snapshot
        if self.hybrid and (len(full) < len(hit.full) or (tail is None) != (hit.tail is None)):
            full, tail, snap = self._deepest_snapshot(full, tail, ())
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

    def apply(self, kv):
        """Do the queued device work; kv is donated: use the returned one."""
        host = self.host
        if host is not None:
            host.settle()
            if self._evicted:
                pieces = kv_blocks.read_blocks(kv, [b for b, _ in self._evicted])
                for p, (k, v) in enumerate(pieces):
                    metas = [m for _, m in self._evicted[p * kv_blocks.CHUNK:(p + 1) * kv_blocks.CHUNK]]
                    host.add(metas, k, v, self.block_bytes)
                self._evicted = []
        if self._uploads:
            ups = self._uploads
            kv = kv_blocks.write_blocks(kv, [b for b, _ in ups], lambda i: ups[i][1].arrays())
            self._uploads = []
        if self._copies:
            kv = kv_blocks.copy_blocks(kv, self._copies)
            for src, _ in self._copies:
                self.bm.unref(src)
            self._copies = []
        if self._restores:
            from ..models.hybrid_paged import restore_snapshot
            for seq, snap in self._restores:
                kv = restore_snapshot(kv, seq.state_slot, snap)
            self._restores = []
        return kv

    # ---- across restarts (cache_file) ----------------------------------------------------------
    def save(self, path: str, fp: dict, kv, cap_bytes: int) -> int:
        """Write the device's cached blocks, then the RAM tier's (newest first), up to cap_bytes."""
        blocks, used = [], 0
        dev = [b for b, m in self.bm.meta.items() if self.host is None or m.key not in self.host]
        dev = dev[:max(0, cap_bytes // max(1, self.block_bytes))]
        for p, (k, v) in enumerate(kv_blocks.read_blocks(kv, dev)):
            k, v = np.asarray(k), np.asarray(v)
            for i, b in enumerate(dev[p * kv_blocks.CHUNK:(p + 1) * kv_blocks.CHUNK]):
                m = self.bm.meta[b]
                blocks.append((m.key, m.parent, m.tokens, k[i], v[i]))
                used += self.block_bytes
        if self.host is not None:
            self.host.settle()
            for e in reversed(self.host.entries.values()):
                if used + e.nbytes > cap_bytes:
                    break
                blocks.append((e.key, e.parent, e.tokens, *e.arrays()))
                used += e.nbytes
        snaps = list(self.snapshots.items()) if self.snapshots is not None else []
        return cache_file.save(path, fp, blocks, snaps, self.ssd.state() if self.ssd is not None else None)

    def load(self, path: str, fp: dict, dtype) -> int:
        """Take back what save() wrote (into the RAM tier); returns the blocks loaded."""
        saved = cache_file.load(path, fp, dtype)
        if saved is None:
            return 0
        for key, parent, tokens, k, v in reversed(saved["blocks"]):      # the newest end up newest
            self.host.put(key, parent, tokens, k, v)
        if self.snapshots is not None:
            from ..models.hybrid_paged import StateSnapshot
            for key, n, conv, ssm in saved["snapshots"]:
                self.snapshots.put(key, StateSnapshot(conv, ssm, n))
        if self.ssd is not None and saved["ssd"]:
            self.ssd.restore(saved["ssd"])
        return len(saved["blocks"])

    def reset(self) -> None:
        """The device pool was lost: forget the device tier and the queued work."""
        for src, _ in self._copies:
            self.bm.unref(src)
        self._evicted, self._uploads, self._copies, self._restores = [], [], [], []
        self.bm.clear_cache()
