"""The prefix cache's SSD tier (opt-in): blocks the RAM tier gives up are compressed (zstandard,
lossless) and written to one scratch file in a directory, and read back instead of recomputed.

The file is a ring of `capacity` bytes written front to back: a new record goes at the write head
and the records it overwrites leave the index (oldest first, which is what the RAM tier gave up
longest ago). Writes run on a background thread, off the request path, and go through a budget of
GiB per hour (a token bucket holding five minutes of budget): past it, blocks are dropped instead
of written, so an agent session cannot wear out the disk. A block still queued for writing is
served from memory. A read error is a miss. Every record carries a BLAKE2 checksum of its header and payload: a record
that does not check out is a miss, never wrong output."""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import queue
import struct
import threading
import time

import numpy as np
import zstandard

log = logging.getLogger("infernix.cache")
GiB = 1 << 30
MAGIC = b"IXKV"
# magic, key, parent, number of tokens, payload bytes
HEADER = struct.Struct("<4s16s16sII")
SUM = 16


class DiskEntry:
    """A block read back from the SSD tier: the same interface as host_tier.HostEntry."""
    __slots__ = ("key", "parent", "tokens", "_k", "_v")

    def __init__(self, key, parent, tokens, k, v):
        self.key, self.parent, self.tokens, self._k, self._v = key, parent, tokens, k, v

    def arrays(self):
        return self._k, self._v


class SSDTier:
    def __init__(self, directory: str, capacity_bytes: int, gib_per_hour: float = 8.0, *,
                 block_shape: tuple, dtype, clock=time.monotonic):
        if capacity_bytes <= 0:
            raise ValueError("--ssd-context-gib must be > 0")
        if gib_per_hour <= 0:
            raise ValueError("--ssd-context-gib-per-hour must be > 0")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "infernix-prefix-cache.bin")
        self.capacity = int(capacity_bytes)
        self.block_shape = tuple(block_shape)          # [L, nKV, bs, hd] of k (and of v)
        self.dtype = np.dtype(dtype)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.rate = gib_per_hour * GiB / 3600.0        # bytes per second
        self.bucket_max = self.rate * 300
        self._bucket = self.bucket_max
        self._clock = clock
        self._t = clock()
        self.index: dict[int, tuple[int, int]] = {}    # key -> (offset, record length)
        self.meta: dict[int, tuple[int, tuple]] = {}   # key -> (parent, tokens)
        self.children: dict[int, set[int]] = {}
        self.head = 0
        self.written_bytes = 0
        self.dropped = 0
        self.corrupt = 0
        self._lock = threading.Lock()
        self._pending: dict[int, object] = {}            # key -> entry queued for writing
        self._order: collections.deque = collections.deque()     # (key, offset, length), oldest first
        self._queue: queue.Queue = queue.Queue()
        self._zc = zstandard.ZstdCompressor(level=1)
        self._thread = threading.Thread(target=self._writer, name="infernix-ssd", daemon=True)
        self._thread.start()

    # ---- writes (RAM tier -> here, on the writer thread) ---------------------------------------
    def put(self, entry) -> None:
        """Queue a block the RAM tier is giving up (its arrays are in host memory)."""
        with self._lock:
            if entry.key in self.index or entry.key in self._pending:
                return
            self._pending[entry.key] = entry
        self._queue.put(entry)

    def _take_budget(self, n: int) -> bool:
        now = self._clock()
        self._bucket = min(self.bucket_max, self._bucket + (now - self._t) * self.rate)
        self._t = now
        if n > self._bucket:
            return False
        self._bucket -= n
        return True

    def _record(self, entry) -> bytes:
        k, v = entry.arrays()
        payload = self._zc.compress(np.ascontiguousarray(k).tobytes() + np.ascontiguousarray(v).tobytes())
        toks = np.asarray(entry.tokens, np.int32).tobytes()
        head = HEADER.pack(MAGIC, entry.key.to_bytes(16, "little"), entry.parent.to_bytes(16, "little"),
                           len(entry.tokens), len(payload))
        body = head + toks + payload
        return body + hashlib.blake2b(body, digest_size=SUM).digest()

    def _writer(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            try:
                self._write(entry)
            except Exception as e:  # a full or failing disk must not take the engine down
                log.error("SSD tier: write failed: %s", e)
                with self._lock:
                    self._pending.pop(entry.key, None)

    def _write(self, entry) -> None:
        k, _ = entry.arrays()
        with self._lock:        # out of budget even for a record compressed to half: skip the compression
            self._take_budget(0)
            room = self._bucket >= k.nbytes
        if not room:
            with self._lock:
                self.dropped += 1
                self._pending.pop(entry.key, None)
            return
        rec = self._record(entry)
        with self._lock:
            ok = len(rec) <= self.capacity and self._take_budget(len(rec))
            if not ok:
                self.dropped += 1
                self._pending.pop(entry.key, None)
                return
            order = self._order                        # records by age; the oldest lie right after the head
            if self.head + len(rec) > self.capacity:   # wrap: the last lap's records past the head go
                while order and order[0][1] >= self.head:
                    self._forget(*order.popleft())
                self.head = 0
            lo, hi = self.head, self.head + len(rec)
            while order and order[0][1] < hi and order[0][1] + order[0][2] > lo:   # what the new one overwrites
                self._forget(*order.popleft())
            self.head = hi
        os.pwrite(self._fd, rec, lo)
        with self._lock:
            self.index[entry.key] = (lo, len(rec))
            self._order.append((entry.key, lo, len(rec)))
            self.meta[entry.key] = (entry.parent, tuple(entry.tokens))
            self.children.setdefault(entry.parent, set()).add(entry.key)
            self.written_bytes += len(rec)
            self._pending.pop(entry.key, None)

    def _forget(self, key: int, off: int | None = None, n: int | None = None) -> None:
        """Drop key from the index (only if it still names the record at off, when given)."""
        if key not in self.index or (off is not None and self.index[key] != (off, n)):
            return
        del self.index[key]
        parent, _ = self.meta.pop(key)
        kids = self.children[parent]
        kids.discard(key)
        if not kids:
            del self.children[parent]

    # ---- reads (scheduler) ---------------------------------------------------------------------
    def __contains__(self, key: int) -> bool:
        return key in self.index or key in self._pending

    def below(self, parent: int) -> list:
        """(key, tokens) of the blocks stored below a prefix (for partial matches)."""
        with self._lock:
            return [(k, self.meta[k][1]) for k in self.children.get(parent, ())]

    def get(self, key: int) -> DiskEntry | None:
        """Read a block back; None when it is not here or its record does not check out."""
        with self._lock:
            queued = self._pending.get(key)
            loc = self.index.get(key)
        if queued is not None and loc is None:         # not written yet: served from memory
            return DiskEntry(key, queued.parent, tuple(queued.tokens), *queued.arrays())
        if loc is None:
            return None
        off, n = loc
        try:
            rec = os.pread(self._fd, n, off)
        except OSError as e:
            log.error("SSD tier: read failed (%s); treated as a miss", e)
            return None
        entry = self._parse(rec, key)
        if entry is None:
            self.corrupt += 1
            log.warning("SSD tier: a record failed its checksum; treated as a miss")
            with self._lock:
                self._forget(key, off, n)
        return entry

    def _parse(self, rec: bytes, key: int) -> DiskEntry | None:
        if len(rec) < HEADER.size + SUM or hashlib.blake2b(rec[:-SUM], digest_size=SUM).digest() != rec[-SUM:]:
            return None
        magic, kb, pb, nt, npay = HEADER.unpack_from(rec)
        if magic != MAGIC or int.from_bytes(kb, "little") != key:
            return None
        o = HEADER.size
        tokens = tuple(np.frombuffer(rec[o:o + 4 * nt], np.int32).tolist())
        raw = zstandard.ZstdDecompressor().decompress(rec[o + 4 * nt:o + 4 * nt + npay])
        n = int(np.prod(self.block_shape)) * self.dtype.itemsize
        if len(raw) != 2 * n:
            return None
        k = np.frombuffer(raw[:n], self.dtype).reshape(self.block_shape)
        v = np.frombuffer(raw[n:], self.dtype).reshape(self.block_shape)
        return DiskEntry(key, int.from_bytes(pb, "little"), tokens, k, v)

    def state(self) -> dict:
        """The index, for the cache file (the records stay in the scratch file)."""
        self.flush()
        with self._lock:
            return {"path": self.path, "head": self.head,
                    "records": [[str(k), off, n, str(self.meta[k][0]), list(self.meta[k][1])]
                                for k, off, n in self._order if self.index.get(k) == (off, n)]}

    def restore(self, state: dict) -> None:
        """Take back an index saved by state() (records that no longer check out are misses)."""
        if state.get("path") != self.path or os.path.getsize(self.path) == 0:
            return
        with self._lock:
            for k, off, n, parent, toks in state["records"]:
                k, parent = int(k), int(parent)
                if off + n <= self.capacity:
                    self.index[k] = (off, n)
                    self.meta[k] = (parent, tuple(toks))
                    self.children.setdefault(parent, set()).add(k)
                    self._order.append((k, off, n))
            self.head = min(int(state["head"]), self.capacity)

    def get_many(self, keys: list[int]) -> list:
        """get() for several blocks, decompressed in parallel (zstandard releases the GIL)."""
        if len(keys) < 4:
            return [self.get(k) for k in keys]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return list(pool.map(self.get, keys))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is done."""
        t0 = time.monotonic()
        while self._pending and time.monotonic() - t0 < timeout:
            time.sleep(0.01)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)
        os.close(self._fd)
