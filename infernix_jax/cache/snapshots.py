"""Hybrid models' state snapshots at block boundaries, in host memory.

A Gated DeltaNet layer keeps one state per sequence, overwritten as the sequence advances, so a
shared prefix cannot be resumed from KV blocks alone: it also needs the state as it was right
after that prefix. With snapshots on, prefill chunks end on multiples of `interval` tokens (whole
KV blocks and whole GDN chunks), and after such a chunk the sequence's state is copied to host
memory, keyed by the prefix's key (block_manager.chain_key): the key under which the prefix cache
finds the KV blocks of the same prefix, so a cached prefix is resumable where both exist. A
sequence that ends (or is preempted) leaves a snapshot of where it got to as well, beside its
partly filled last block: the next turn of the conversation resumes there."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
from flax import struct


@struct.dataclass
class StateSnapshot:
    """One sequence's recurrent state after its first num_tokens tokens: conv[j] [K-1, C] and
    ssm[j] [Hv, dk, dv] fp32 per linear layer, as arrays in host memory (device.take_snapshot: the
    copy runs in the background) or numpy (loaded from a file); device.restore_snapshot takes
    either. The attention layers' K/V of the same prefix are ordinary blocks, found by the block
    hashes: a snapshot pairs with the hash of its last block."""
    conv: tuple
    ssm: tuple
    num_tokens: int = struct.field(pytree_node=False)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (*self.conv, *self.ssm))


class SnapshotStore:
    def __init__(self, capacity: int, interval: int):
        self.capacity = capacity          # snapshots kept; the least recently used go first
        self.interval = interval
        self._snaps: OrderedDict[int, StateSnapshot] = OrderedDict()
        self.taken = 0
        self.on_drop = None               # callback(key, snapshot) for those given up (the SSD tier)

    def after_chunk(self, seq, runner, bm) -> None:
        """Called after a step fed seq a chunk (its blocks sealed): snapshot on a boundary."""
        if seq.num_computed % self.interval == 0:
            self.capture(seq, runner, bm)

    def capture(self, seq, runner, bm) -> None:
        """Snapshot seq's state (which holds its num_computed tokens) under its prefix key, taken
        by runner (engine/runner.py: take_snapshot)."""
        n = seq.num_computed
        if n == 0 or seq.state_slot is None or seq.state_dirty or self.capacity <= 0:
            return
        key = bm.tail_key(seq)
        if key is None:
            return
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return
        self._snaps[key] = runner.take_snapshot(seq.state_slot, n)
        self.taken += 1
        self._trim()

    def put(self, key: int, snap: StateSnapshot) -> None:
        self._snaps[key] = snap
        self._snaps.move_to_end(key)
        self._trim()

    def _trim(self) -> None:
        while len(self._snaps) > self.capacity:
            key, snap = self._snaps.popitem(last=False)
            if self.on_drop is not None:
                self.on_drop(key, snap)

    def items(self) -> list:
        return list(self._snaps.items())

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
