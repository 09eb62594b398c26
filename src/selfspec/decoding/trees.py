"""Token trees: the candidates of one speculative round, linearised for one verification pass.

A :class:`DraftTree` holds node 0, the *root* (the last accepted token, whose
keys and values are not in the cache yet), and the drafted tokens below it.
A chain is the tree in which every node has at most one child.  SWIFT's
dynamic verification adds, at each depth of the drafted chain, the draft's
next-best tokens as extra leaves (siblings of the chain's node).

The nodes are stored in linear order (every parent before its children), so
the tree is verified by one forward over ``tokens`` at positions
``start + depth`` with :meth:`DraftTree.attention_mask`: each node attends to
its ancestors and itself.

For speculative sampling a node may also carry ``q``, the draft distribution
its children were sampled from (``None`` under greedy decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1; parents[i] < i for i > 0
    q: tuple[torch.Tensor | None, ...] = field(default=(), repr=False)  # per node: children's draft distribution

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (node 0, parent -1)")
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come first")
        for node, kids in enumerate(self.children):
            toks = [self.tokens[k] for k in kids]
            if len(set(toks)) != len(toks):
                raise ValueError(f"node {node} has two children with the same token")

    @classmethod
    def chain(cls, root: int, draft: list[int] | tuple[int, ...], q: list | None = None) -> DraftTree:
        n = len(draft)
        return cls((root, *draft), tuple(range(-1, n)), tuple(q) if q is not None else ())

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    @property
    def depths(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i, p in enumerate(self.parents[1:], start=1):
            d[i] = d[p] + 1
        return d

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (the drafted chain's length)."""
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to ``node``, both included."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def attention_mask(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """``[T, T]`` boolean: node i sees node j iff j is i or an ancestor of i (None for a chain: causal)."""
        if self.is_chain:
            return None
        T = len(self.tokens)
        mask = torch.eye(T, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask.to(device)

    def positions(self, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.long, device=device) + start


def point_masses(draft: Sequence[int], model) -> list[torch.Tensor | None]:
    """Per node of a chain drafted without a distribution (an n-gram lookup, a grammar's forced tokens), the draft
    distribution its child was drawn from as the rejection scheme reads it: a point mass on that token."""
    masses: list[torch.Tensor | None] = []
    for tok in draft:
        q = torch.zeros(model.adapter.vocab_size, device=model.engine.device)
        q[tok] = 1.0
        masses.append(q)
    return masses + [None]
