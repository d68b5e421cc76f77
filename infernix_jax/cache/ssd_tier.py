"""The prefix cache's SSD tier (opt-in): blocks the RAM tier gives up are compressed (zstandard,
lossless) and written to one scratch file in a directory, and read back instead of recomputed.

The file is a ring of `capacity` bytes written front to back: a new record goes at the write head
and the records it overwrites leave the index (oldest first, which is what the RAM tier gave up
longest ago). Writes run on a background thread, off the request path, and go through a budget of
GiB per hour (a token bucket holding five minutes of budget): past it, blocks are dropped instead
of written, so an agent session cannot wear out the disk. A block still queued for writing is
served from memory. A read error is a miss. Every record is checked twice: a BLAKE2 checksum of its
header and tokens, and zstandard's frame checksum of its payload (the low 32 bits of its XXH64),
verified while it is decompressed (hashing the payload with BLAKE2 as well halved the read speed on an H200 host, whose
disk reads 1.7 GB/s). A record that does not check out is a miss, never wrong output.

Hybrid models' state snapshots (snapshots.py) that the RAM store gives up come here too, as records
of their own kind beside the blocks of the same prefix (index keys SNAP | prefix key)."""
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
SNAP_MAGIC = b"IXSS"
SNAP = 1 << 128                 # index keys of snapshot records: SNAP | the 128-bit prefix key
# magic, key, parent, number of tokens, payload bytes; then the tokens (int32), the BLAKE2 sum of
# header and tokens, and the payload (a zstandard frame with its content checksum)
HEADER = struct.Struct("<4s16s16sII")
SUM = 16


class DiskEntry:
    """A block read back from the SSD tier: the same interface as host_tier.HostEntry."""
    __slots__ = ("key", "parent", "tokens", "_k", "_v")

    def __init__(self, key, parent, tokens, k, v):
        self.key, self.parent, self.tokens, self._k, self._v = key, parent, tokens, k, v

    def arrays(self):
        return self._k, self._v


class _SnapEntry:
    """A state snapshot queued for writing."""
    __slots__ = ("key", "parent", "tokens", "snap", "nbytes")

    def __init__(self, key: int, snap):
        self.key, self.parent, self.tokens, self.snap, self.nbytes = SNAP | key, None, (), snap, snap.nbytes


class SSDTier:
    def __init__(self, directory: str, capacity_bytes: int, gib_per_hour: float = 8.0, *,
                 block_shape: tuple, dtype, v_shape: tuple | None = None, state_layout=None,
                 clock=time.monotonic):
        if capacity_bytes <= 0:
            raise ValueError("--ssd-context-gib must be > 0")
        if gib_per_hour <= 0:
            raise ValueError("--ssd-context-gib-per-hour must be > 0")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "infernix-prefix-cache.bin")
        self.capacity = int(capacity_bytes)
        # a block's k and v as the RAM tier holds them: [L, nKV, bs, hd] in the model dtype, or
        # quantized (--kv-dtype) [L, nKV, R] uint8 rows, K8V4's values narrower than its keys
        self.block_shape = tuple(block_shape)
        self.v_shape = tuple(v_shape or block_shape)
        self.dtype = np.dtype(dtype)
        # hybrids: ([(shape, dtype)] of conv, [(shape, dtype)] of ssm) of one snapshot
        self.state_layout = state_layout
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
        self._zc = zstandard.ZstdCompressor(level=1, write_checksum=True)
        self._thread = threading.Thread(target=self._writer, name="infernix-ssd", daemon=True)
        self._thread.start()

    # ---- writes (RAM tier -> here, on the writer thread) ---------------------------------------
    def put(self, entry) -> None:
        """Queue a block the RAM tier is giving up (its arrays are in host memory)."""
        with self._lock:
            if entry.key in self.index or entry.key in self._pending:
                return
            self._pending[entry.key] = entry
        if hasattr(entry, "hold"):      # its piece stays in numpy form until its blocks are written
            entry.hold()
        self._queue.put(entry)

    def budget_left(self) -> float:
        """Bytes the write budget allows now (what _take_budget would grant)."""
        with self._lock:
            self._take_budget(0)
            return self._bucket

    def _take_budget(self, n: int) -> bool:
        now = self._clock()
        self._bucket = min(self.bucket_max, self._bucket + (now - self._t) * self.rate)
        self._t = now
        if n > self._bucket:
            return False
        self._bucket -= n
        return True

    def put_snapshot(self, key: int, snap) -> None:
        """Queue a state snapshot the RAM store is giving up (key: its prefix key)."""
        if self.state_layout is not None:
            self.put(_SnapEntry(key, snap))

    def _record(self, entry) -> bytes:
        if isinstance(entry, _SnapEntry):          # no parent, no tokens: the count field holds its length
            arrays, magic, parent, toks = (*entry.snap.conv, *entry.snap.ssm), SNAP_MAGIC, 0, b""
            count = entry.snap.num_tokens
        else:
            arrays, magic, parent, count = entry.arrays(), MAGIC, entry.parent, len(entry.tokens)
            toks = np.asarray(entry.tokens, np.int32).tobytes()
        payload = self._zc.compress(b"".join(np.ascontiguousarray(np.asarray(a)).tobytes() for a in arrays))
        head = HEADER.pack(magic, (entry.key & (SNAP - 1)).to_bytes(16, "little"), parent.to_bytes(16, "little"),
                           count, len(payload)) + toks
        return head + hashlib.blake2b(head, digest_size=SUM).digest() + payload

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
            finally:
                if hasattr(entry, "release"):
                    entry.release()

    def _write(self, entry) -> None:
        with self._lock:        # out of budget even for a record compressed to half: skip the compression
            self._take_budget(0)
            room = self._bucket >= entry.nbytes // 2
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
            self._describe(entry.key, entry.parent, entry.tokens)
            self.written_bytes += len(rec)
            self._pending.pop(entry.key, None)

    def _describe(self, key: int, parent: int | None, tokens) -> None:
        if parent is not None:                         # a block (snapshots have no parent and no tokens)
            self.meta[key] = (parent, tuple(tokens))
            self.children.setdefault(parent, set()).add(key)

    def _forget(self, key: int, off: int | None = None, n: int | None = None) -> None:
        """Drop key from the index (only if it still names the record at off, when given)."""
        if key not in self.index or (off is not None and self.index[key] != (off, n)):
            return
        del self.index[key]
        if key & SNAP:
            return
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
            if isinstance(queued, _SnapEntry):
                return queued.snap
            return DiskEntry(key, queued.parent, tuple(queued.tokens), *(a.copy() for a in queued.arrays()))
        if loc is None:
            return None
        off, n = loc
        try:
            rec = os.pread(self._fd, n, off)
        except OSError as e:
            log.error("SSD tier: read failed (%s); treated as a miss", e)
            return None
        try:
            entry = self._parse(rec, key)
        except Exception:  # noqa: BLE001 - whatever a damaged record does, it is a miss
            entry = None
        if entry is None:
            self.corrupt += 1
            log.warning("SSD tier: a record failed its checksum; treated as a miss")
            with self._lock:
                self._forget(key, off, n)
        return entry

    def has_snapshot(self, key: int) -> bool:
        return (SNAP | key) in self

    def get_snapshot(self, key: int):
        """Read a state snapshot back (a StateSnapshot of numpy arrays); None as for get()."""
        return self.get(SNAP | key)

    def _parse(self, rec: bytes, key: int):
        if len(rec) < HEADER.size + SUM:
            return None
        magic, kb, pb, nt, npay = HEADER.unpack_from(rec)
        o = HEADER.size + (0 if magic == SNAP_MAGIC else 4 * nt)      # header and tokens, their sum, the payload
        if len(rec) != o + SUM + npay or hashlib.blake2b(rec[:o], digest_size=SUM).digest() != rec[o:o + SUM]:
            return None
        if magic != (SNAP_MAGIC if key & SNAP else MAGIC) or int.from_bytes(kb, "little") != key & (SNAP - 1):
            return None
        try:                                       # checks the payload's XXH64 as it decompresses
            raw = zstandard.ZstdDecompressor().decompress(rec[o + SUM:])
        except zstandard.ZstdError:
            return None
        if key & SNAP:
            return self._parse_snapshot(raw, nt)
        n = int(np.prod(self.block_shape)) * self.dtype.itemsize
        if len(raw) != n + int(np.prod(self.v_shape)) * self.dtype.itemsize:
            return None
        tokens = tuple(np.frombuffer(rec[HEADER.size:o], np.int32).tolist())
        k = np.frombuffer(raw[:n], self.dtype).reshape(self.block_shape)
        v = np.frombuffer(raw[n:], self.dtype).reshape(self.v_shape)
        return DiskEntry(key, int.from_bytes(pb, "little"), tokens, k, v)

    def _parse_snapshot(self, raw: bytes, num_tokens: int):
        from .snapshots import StateSnapshot
        conv_l, ssm_l = self.state_layout
        layout = (*conv_l, *ssm_l)
        sizes = [int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in layout]
        if len(raw) != sum(sizes):
            return None
        out, o = [], 0
        for (shape, dt), n in zip(layout, sizes):
            out.append(np.frombuffer(raw[o:o + n], dt).reshape(shape))
            o += n
        return StateSnapshot(tuple(out[:len(conv_l)]), tuple(out[len(conv_l):]), num_tokens)

    def state(self) -> dict:
        """The index, for the cache file (the records stay in the scratch file)."""
        self.flush()
        with self._lock:
            return {"path": self.path, "head": self.head,
                    "records": [[str(k), off, n, *((str(self.meta[k][0]), list(self.meta[k][1])) if k in self.meta
                                                     else (None, None))]
                                for k, off, n in self._order if self.index.get(k) == (off, n)]}

    def restore(self, state: dict) -> None:
        """Take back an index saved by state() (records that no longer check out are misses)."""
        if state.get("path") != self.path or os.path.getsize(self.path) == 0:
            return
        with self._lock:
            for k, off, n, parent, toks in state["records"]:
                k = int(k)
                if off + n <= self.capacity:
                    self.index[k] = (off, n)
                    self._describe(k, None if parent is None else int(parent), toks)
                    self._order.append((k, off, n))
            self.head = min(int(state["head"]), self.capacity)

    def get_many(self, keys: list[int]) -> list:
        """get() for several blocks, decompressed in parallel (zstandard releases the GIL)."""
        if len(keys) < 4:
            return [self.get(k) for k in keys]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:     # disks like a deep queue
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
