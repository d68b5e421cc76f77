"""The prefix cache's RAM tier: KV blocks the device evicted, kept in host memory under their
prefix keys and brought back instead of being recomputed.

Blocks live in pieces: the blocks read off the device together (runner.read_blocks, cache/device.py), one JAX
array per piece in the host's pinned memory (host_memory.py). Reading them out and bringing
them back are then single asynchronous DMA copies, started on the device's thread without waiting
for them, and nothing is copied on the host in between. A piece's memory goes only with the piece,
so the tier evicts whole pieces, least recently used first (a lookup of any of its blocks counts as
a use of the piece), and `used` is the bytes of the pieces held. With `resize="auto"`,
`check_memory()` (called between steps, at most once a second) lowers the limit while the machine
has less than `reserve` bytes of RAM available, and raises it back to the configured size once
memory is free again; each change is logged."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np
import psutil

from .host_memory import put_host
from .device import exact_pieces

log = logging.getLogger("infernix.cache")
GiB = 1 << 30


class Piece:
    """Blocks that moved together: k, v [n, L, nKV, bs, hd] (host-memory JAX arrays or numpy)."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.nbytes = 0                    # set by the tier: its rows times the block's bytes
        self.keys: set[int] = set()        # its blocks still in the tier
        self._np = None                    # a numpy copy while serializers hold it (hold / release)
        self._holds = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            if self._holds <= 0:
                self._holds, self._np = 0, None

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """The piece as numpy (waits for its copy off the device): kept while held (the SSD writer
        serializes a piece's blocks one by one), else made for this call only."""
        with self._lock:
            if self._np is not None:
                return self._np
            out = (np.asarray(self.k), np.asarray(self.v))
            if self._holds:
                self._np = out
            return out


class HostEntry:
    __slots__ = ("key", "parent", "tokens", "piece", "row", "nbytes")

    def __init__(self, key: int, parent: int, tokens: tuple[int, ...], piece: Piece, row: int, nbytes: int):
        self.key, self.parent, self.tokens = key, parent, tokens
        self.piece, self.row, self.nbytes = piece, row, nbytes

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """k, v [L, nKV, bs, hd] of this block as numpy (views of its piece's copy)."""
        k, v = self.piece.numpy()
        return k[self.row], v[self.row]

    def hold(self) -> None:
        self.piece.hold()

    def release(self) -> None:
        self.piece.release()


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
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()    # oldest first
        self.pieces: OrderedDict[int, Piece] = OrderedDict()         # id -> piece, least recently used first
        self.children: dict[int, set[int]] = {}     # parent key -> keys of entries below it
        self.used = 0                               # bytes of the pieces held
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
            self.pieces.move_to_end(id(e.piece))
        return e

    def below(self, parent: int) -> list[HostEntry]:
        return [self.entries[k] for k in self.children.get(parent, ())]

    def add(self, metas, k, v, block_bytes: int) -> None:
        """Keep blocks read off the device: metas[i] describes row i of the piece k, v (host-memory
        arrays whose copy may still be running)."""
        self._keep(Piece(k, v), [(m.key, m.parent, m.tokens) for m in metas], block_bytes)

    def put_many(self, blocks: list) -> None:
        """Keep blocks whose arrays are numpy (loaded from the cache file): (key, parent, tokens, k,
        v), oldest first; stacked into pieces (one host copy each, not views of the file)."""
        for lo, hi in exact_pieces(len(blocks)):        # power-of-two pieces, as the device moves them
            part = blocks[lo:hi]
            k, v = put_host((np.stack([b[3] for b in part]), np.stack([b[4] for b in part])))
            self._keep(Piece(k, v), [(b[0], b[1], tuple(b[2])) for b in part], part[0][3].nbytes + part[0][4].nbytes)

    def _keep(self, piece: Piece, rows: list, block_bytes: int) -> None:
        piece.nbytes = len(rows) * block_bytes
        for i, (key, parent, tokens) in enumerate(rows):
            if key in self.entries:
                continue
            self.entries[key] = HostEntry(key, parent, tokens, piece, i, block_bytes)
            self.children.setdefault(parent, set()).add(key)
            piece.keys.add(key)
            self.captured += 1
        if piece.keys:
            self.pieces[id(piece)] = piece
            self.used += piece.nbytes
            self._shrink_to(self.limit)

    def _drop_piece(self, piece: Piece) -> None:
        del self.pieces[id(piece)]
        self.used -= piece.nbytes
        for key in sorted(piece.keys, key=lambda k: self.entries[k].row):
            e = self.entries.pop(key)
            kids = self.children[e.parent]
            kids.discard(key)
            if not kids:
                del self.children[e.parent]
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(e)        # the SSD writer reads its arrays on its own thread
        piece.keys.clear()

    def _shrink_to(self, limit: int) -> None:
        while self.used > limit and self.pieces:
            self._drop_piece(next(iter(self.pieces.values())))

    def clear(self) -> None:
        self._shrink_to(-1)

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
