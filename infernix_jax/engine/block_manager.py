"""Fixed-size KV blocks: a free list, reference counts, and chained hashes of full blocks' token
ids (hash of the parent block's hash and this block's tokens), so that a prefix cache can later
find the blocks of a shared prefix. Plain Python over ints; no JAX here."""
from __future__ import annotations

from collections import deque


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.block_hash: dict[int, int] = {}      # block id -> chained hash (full blocks only)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_grow(self, seq, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(seq.block_ids) <= len(self.free)

    def grow(self, seq, n_tokens: int) -> None:
        """Make seq's blocks cover n_tokens slots. Caller checked can_grow."""
        need = self.blocks_for(n_tokens) - len(seq.block_ids)
        for _ in range(need):
            b = self.free.popleft()
            assert self.ref[b] == 0
            self.ref[b] = 1
            seq.block_ids.append(b)

    def seal_full_blocks(self, seq) -> None:
        """Record chained hashes for seq's blocks that became full of computed tokens since the
        last call (only the new ones: this runs every step)."""
        bs = self.block_size
        j = seq.num_sealed
        parent = self.block_hash[seq.block_ids[j - 1]] if j else None
        while j < len(seq.block_ids) and (j + 1) * bs <= seq.num_computed:
            parent = chain_hash(parent, tuple(seq.tokens(j * bs, (j + 1) * bs)))
            self.block_hash[seq.block_ids[j]] = parent
            j += 1
        seq.num_sealed = j

    def release(self, seq) -> None:
        for b in reversed(seq.block_ids):
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                self.block_hash.pop(b, None)
                self.free.append(b)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_sealed = 0
