"""Acceptance: which drafted tokens the full model keeps, and the token it adds.

Greedy decoding walks the token tree from the root: at each node the full
model's argmax is the next token; if a child of the node carries it, the walk
moves there, otherwise it stops and that argmax is the bonus token.  The
result is exactly what vanilla greedy decoding would produce.
"""

from __future__ import annotations

from collections.abc import Sequence

from .trees import DraftTree


def accept_greedy(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], int]:
    """(accepted path as node indices, root included; bonus token) given the full model's argmax per node."""
    children = tree.children
    node, path = 0, [0]
    while True:
        want = target[node]
        nxt = next((c for c in children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, int(want)
        path.append(nxt)
        node = nxt
