"""The prefix cache's RAM tier: KV blocks the device evicted, kept in host memory under their
prefix keys and brought back in one bulk copy instead of being recomputed.

An evicted block is read off the device asynchronously (kv_blocks.read_blocks starts the copy) and
only turned into numpy when it is needed or at the next step, so the copy overlaps the device's
work. Entries are dropped least recently used first when the tier is over its limit. With
`resize="auto"`, `check_memory()` (called between steps, at most once a second) lowers the limit
while the machine has less than `reserve` bytes of RAM available, and raises it back to the
configured size once memory is free again; each change is logged."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import psutil

log = logging.getLogger("infernix.cache")
GiB = 1 << 30


class _Batch:
    """Blocks read off the device together: k, v [n, L, nKV, bs, hd] device arrays -> numpy."""

    def __init__(self, k, v):
        self._dev, self._host = (k, v), None

    def ready(self) -> bool:
        return self._host is not None or all(a.is_ready() for a in self._dev)

    def host(self):
        if self._host is None:
            self._host = tuple(np.asarray(a) for a in self._dev)
            self._dev = None
        return self._host


class HostEntry:
    __slots__ = ("key", "parent", "tokens", "_batch", "_col", "_k", "_v", "nbytes")

    def __init__(self, key: int, parent: int, tokens: tuple[int, ...], batch: _Batch, col: int, nbytes: int):
        self.key, self.parent, self.tokens = key, parent, tokens
        self._batch, self._col, self._k, self._v = batch, col, None, None
        self.nbytes = nbytes

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """k, v [L, nKV, bs, hd] of this block (waits for its copy from the device if still running)."""
        if self._k is None:
            k, v = self._batch.host()
            # copies (one memcpy each, rows are contiguous): a view would keep the whole piece alive
            self._k, self._v = k[self._col].copy(), v[self._col].copy()
            self._batch = None
        return self._k, self._v


class HostTier:
    def __init__(self, capacity_bytes: int, resize: str = "auto", reserve_bytes: int = 2 * GiB,
                 available=lambda: psutil.virtual_memory().available):
        if resize not in ("auto", "off"):
            raise ValueError(f"--ram-resize must be auto or off, not {resize!r}")
        self.capacity = capacity_bytes          # the configured size
        self.limit = capacity_bytes             # the size now (auto resize moves it)
        self.resize = resize
        self.reserve = reserve_bytes
        self._available = available
        self._last_check = 0.0
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()
        self.children: dict[int, set[int]] = {}     # parent key -> keys of entries below it
        self.used = 0
        self._fresh: list[HostEntry] = []           # entries whose arrays are still on their way
        self.captured = 0
        self.dropped = 0
        self.on_drop = None                         # callback(entry) when an entry leaves (the SSD tier)

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: int) -> HostEntry | None:
        e = self.entries.get(key)
        if e is not None:
            self.entries.move_to_end(key)
        return e

    def below(self, parent: int) -> list[HostEntry]:
        return [self.entries[k] for k in self.children.get(parent, ())]

    def add(self, metas, k, v, block_bytes: int) -> None:
        """Keep blocks read off the device: metas[i] describes row i of k, v."""
        batch = _Batch(k, v)
        for i, m in enumerate(metas):
            if m.key in self.entries or block_bytes > self.limit:
                continue
            e = HostEntry(m.key, m.parent, m.tokens, batch, i, block_bytes)
            self.entries[m.key] = e
            self.children.setdefault(m.parent, set()).add(m.key)
            self.used += block_bytes
            self._fresh.append(e)
            self.captured += 1
        self._shrink_to(self.limit)

    def put(self, key: int, parent: int, tokens: tuple, k: np.ndarray, v: np.ndarray) -> None:
        """Keep a block whose arrays are already in host memory (loaded from the cache file)."""
        nbytes = k.nbytes + v.nbytes
        if key in self.entries or self.used + nbytes > self.limit:
            return
        e = HostEntry(key, parent, tuple(tokens), None, 0, nbytes)
        e._k, e._v = np.array(k), np.array(v)        # own copies: not views of the loaded file
        self.entries[key] = e
        self.children.setdefault(parent, set()).add(key)
        self.used += nbytes

    def settle(self) -> None:
        """Turn device reads that have finished into numpy (and free their device buffers); the
        others are left for a later call, so this never waits for the device."""
        waiting = []
        for e in self._fresh:
            if e._batch is not None and e.key in self.entries:
                if e._batch.ready():
                    e.arrays()
                else:
                    waiting.append(e)
        self._fresh = waiting

    def _drop(self, key: int) -> None:
        e = self.entries.pop(key)
        kids = self.children[e.parent]
        kids.discard(key)
        if not kids:
            del self.children[e.parent]
        self.used -= e.nbytes
        self.dropped += 1
        if self.on_drop is not None:
            e.arrays()                 # here, on the device's thread: the SSD writer only reads numpy
            self.on_drop(e)

    def _shrink_to(self, limit: int) -> None:
        while self.used > limit and self.entries:
            self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key)

    def check_memory(self, now: float | None = None) -> None:
        """Auto resize: give memory back while the machine is short of it, take it again later."""
        now = time.monotonic() if now is None else now
        if self.resize != "auto" or now - self._last_check < 1.0:
            return
        self._last_check = now
        avail = self._available()
        if avail < self.reserve and self.limit > 0:
            new = max(0, min(self.limit, self.used) - (self.reserve - avail))
            if new < self.limit:
                log.warning("RAM tier: %.2f GiB available (< %.2f GiB): shrinking from %.2f to %.2f GiB",
                            avail / GiB, self.reserve / GiB, self.limit / GiB, new / GiB)
                self.limit = new
                self._shrink_to(new)
        elif avail > self.reserve and self.limit < self.capacity:
            new = min(self.capacity, self.limit + (avail - self.reserve))
            log.info("RAM tier: memory available again: growing from %.2f to %.2f GiB", self.limit / GiB, new / GiB)
            self.limit = new
