"""Hybrid models' state snapshots at block boundaries, in host memory.

A Gated DeltaNet layer keeps one state per sequence, overwritten as the sequence advances, so a
shared prefix cannot be resumed from KV blocks alone: it also needs the state as it was right
after that prefix. With snapshots on, prefill chunks end on multiples of `interval` tokens (whole
KV blocks and whole GDN chunks), and after such a chunk the sequence's state is copied to host
memory, keyed by the chained hash of the prefix's last block: the key under which the prefix cache
finds the KV blocks of the same prefix, so a cached prefix is resumable where both exist."""
from __future__ import annotations

from collections import OrderedDict

from ..models.hybrid_paged import StateSnapshot, take_snapshot


class SnapshotStore:
    def __init__(self, capacity: int, interval: int):
        self.capacity = capacity          # snapshots kept; the least recently used go first
        self.interval = interval
        self._snaps: OrderedDict[int, StateSnapshot] = OrderedDict()
        self.taken = 0

    def after_chunk(self, seq, kv, bm) -> None:
        """Called after a step fed seq a chunk (its blocks sealed): snapshot on a boundary."""
        n = seq.num_computed
        if n == 0 or n % self.interval or seq.state_slot is None:
            return
        key = bm.block_hash.get(seq.block_ids[n // bm.block_size - 1])
        if key is None:
            return
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return
        self._snaps[key] = take_snapshot(kv, seq.state_slot, n).to_host()
        self.taken += 1
        while len(self._snaps) > self.capacity:
            self._snaps.popitem(last=False)

    def get(self, block_hash: int) -> StateSnapshot | None:
        snap = self._snaps.get(block_hash)
        if snap is not None:
            self._snaps.move_to_end(block_hash)
        return snap

    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._snaps.values())
