"""Fixed-size KV blocks: a free list, reference counts, and the device tier of the prefix cache.

A block full of computed tokens is sealed under a key: the chained hash of its parent's key and
its tokens (the root key covers the model, dtype and KV format), so a key names a whole token
prefix. Sealed blocks stay cached after their sequences end (reference count 0, in an LRU); a new
sequence shares them read-only. When a sequence ends, its last, partly filled block is kept too,
under the key of its own tokens: the next turn of a conversation can copy it (copy-on-write) and
resume from the end of the previous reply. Cached blocks are reused for new data only when no free
block is left, least recently released first, and the last blocks of a sequence are released
first (leaves before their parents). Plain Python over ints; no JAX here."""
from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque

import numpy as np


def chain_key(parent: int, tokens) -> int:
    """The key of a token prefix: hash of the parent prefix's key and these tokens (128 bits, so a
    collision, which would mean wrong output, is out of reach)."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(np.asarray(tokens, np.int32).tobytes())
    return int.from_bytes(h.digest(), "little")


def root_key(fingerprint: str) -> int:
    return int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=16).digest(), "little")


@dataclasses.dataclass
class BlockMeta:
    key: int
    parent: int
    tokens: tuple[int, ...]       # block_size tokens, fewer in a partial block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root: int = 0, cache: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root = root
        self.cache = cache                        # keep blocks for reuse (the prefix cache's device tier)
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))          # blocks holding nothing worth keeping
        self.lru: OrderedDict[int, None] = OrderedDict()          # cached blocks nobody uses, oldest first
        self.meta: dict[int, BlockMeta] = {}      # cached block -> what it holds
        self.by_key: dict[int, int] = {}          # key -> cached block
        self.children: dict[int, set[int]] = {}   # parent key -> cached blocks below it (full or partial)
        self.on_evict = None                      # callback(block, meta) before a cached block is reused

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.meta)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_grow(self, seq, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(seq.block_ids) <= self.num_free

    def take(self) -> int:
        """A block for new data, ref 1: a free one, else the least recently used cached one."""
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.lru.popitem(last=False)
            meta = self._forget(b)
            if self.on_evict is not None:
                self.on_evict(b, meta)
        assert self.ref[b] == 0
        self.ref[b] = 1
        return b

    def grow(self, seq, n_tokens: int) -> None:
        """Make seq's blocks cover n_tokens slots. Caller checked can_grow."""
        for _ in range(self.blocks_for(n_tokens) - len(seq.block_ids)):
            seq.block_ids.append(self.take())

    # ---- the cache index -----------------------------------------------------------------------
    def _forget(self, b: int) -> BlockMeta:
        meta = self.meta.pop(b)
        del self.by_key[meta.key]
        kids = self.children[meta.parent]
        kids.discard(b)
        if not kids:
            del self.children[meta.parent]
        return meta

    def register(self, b: int, parent: int, tokens: tuple[int, ...], key: int | None = None) -> int:
        """Index block b as holding `tokens` after the prefix `parent`; returns its key. A key that is
        already cached (two sequences computed the same prefix) keeps its first block."""
        key = chain_key(parent, tokens) if key is None else key
        if self.cache and key not in self.by_key and b not in self.meta:
            self.meta[b] = BlockMeta(key, parent, tokens)
            self.by_key[key] = b
            self.children.setdefault(parent, set()).add(b)
        return key

    def share(self, b: int) -> None:
        """One more user of cached block b."""
        if self.ref[b] == 0:
            del self.lru[b]
        self.ref[b] += 1

    def unref(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0
        if self.ref[b] == 0:
            if b in self.meta:
                self.lru[b] = None
            else:
                self.free.append(b)

    def seal_full_blocks(self, seq) -> None:
        """Key and index seq's blocks that became full of computed tokens since the last call (only
        the new ones: this runs every step)."""
        bs = self.block_size
        j = seq.num_sealed
        while j < len(seq.block_ids) and (j + 1) * bs <= seq.num_computed:
            parent = seq.block_keys[j - 1] if j else self.root
            seq.block_keys.append(self.register(seq.block_ids[j], parent, tuple(seq.tokens(j * bs, (j + 1) * bs))))
            j += 1
        seq.num_sealed = j

    def tail_key(self, seq) -> int | None:
        """The key of seq's computed prefix (what a state snapshot taken now would be filed under)."""
        n, bs = seq.num_computed, self.block_size
        if n == 0 or seq.num_sealed * bs > n or len(seq.block_keys) < n // bs:
            return None
        if n % bs == 0:
            return seq.block_keys[n // bs - 1]
        parent = seq.block_keys[n // bs - 1] if n >= bs else self.root
        return chain_key(parent, seq.tokens(n // bs * bs, n))

    def release(self, seq, keep: bool = True) -> None:
        """Drop seq's blocks. With keep, its partly filled last block stays cached (the next turn of a
        conversation resumes from there); blocks whose last user this was go to the LRU."""
        bs = self.block_size
        n = seq.num_computed
        j = n // bs
        if keep:
            self.seal_full_blocks(seq)             # a sequence can end in the middle of a dispatch
        if keep and self.cache and seq.num_sealed == j and j < len(seq.block_ids) and n % bs:
            parent = seq.block_keys[j - 1] if j else self.root
            self.register(seq.block_ids[j], parent, tuple(seq.tokens(j * bs, n)))
        for b in reversed(seq.block_ids):
            self.unref(b)
        seq.block_ids = []
        seq.block_keys = []
        seq.num_computed = 0
        seq.num_sealed = 0

    def clear_cache(self) -> None:
        """Forget every cached block (the pool's contents were lost)."""
        for b in list(self.lru):
            self._forget(b)
            self.free.append(b)
        self.lru.clear()
        for b in list(self.meta):
            self._forget(b)
