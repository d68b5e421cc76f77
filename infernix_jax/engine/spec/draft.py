"""A draft: the tokens a drafter proposes to follow a sequence, as a chain or a tree.

Nodes are in topological order (a parent before its children); parents[i] is -1 for a child of
the root (the sequence's last known token, whose logits check the first draft token) or the index
of its parent node. A chain is the tree whose node i has parent i - 1. The verify step (steps.py,
verify.py) feeds the nodes after the row's known tokens, in consecutive KV slots, at positions
of their depth; attention among them follows the ancestor bits (pallas_kernels/paged_attention)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ...choices import MAX_DRAFT_NODES as MAX_NODES     # (ancestor bits: one int32 per query)


@dataclasses.dataclass
class Draft:
    tokens: list[int]
    parents: list[int]
    method: str = "ngram"            # who proposed it (the counts are kept per method)
    kind: str = ""                   # the acceptance statistics' key (default: the method; the n-gram
                                     # drafter tells long matches from short ones)

    def __post_init__(self):
        self.kind = self.kind or self.method

    @classmethod
    def chain(cls, tokens, method: str = "ngram", kind: str = "") -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), method, kind)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def ancestors(self) -> np.ndarray:
        """Each node's ancestor bits [n] int32 (bit j: node j; its own bit set)."""
        bits: list[int] = []
        for i, p in enumerate(self.parents):
            bits.append((1 << i) | (bits[p] if p >= 0 else 0))
        return np.asarray(bits, np.uint32).view(np.int32)

    def truncated(self, n: int) -> "Draft | None":
        """The first n nodes (a tree still: parents come first); None when n <= 0."""
        if n <= 0:
            return None
        return Draft(self.tokens[:n], self.parents[:n], self.method, self.kind) if n < len(self) else self

    def path_tokens(self, i: int) -> list[int]:
        """The tokens from the root's first child down to node i."""
        out = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]


__all__ = ["Draft", "MAX_NODES"]
