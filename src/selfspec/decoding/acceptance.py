"""Acceptance: which drafted tokens the full model keeps, and the token it adds.

Greedy decoding walks the token tree from the root: at each node the full
model's argmax is the next token; if a child of the node carries it, the walk
moves there, otherwise it stops and that argmax is the bonus token.  The
result is exactly what vanilla greedy decoding would produce.

Sampling walks the tree with speculative sampling (Leviathan et al. 2023;
Chen et al. 2023), extended to several candidates per node by recursive
rejection sampling (Jeon et al. 2024; SpecInfer's multi-step variant): at a
node with target distribution p whose children c1, c2, ... were drawn one
after the other *without replacement* from the draft distribution q,

* candidate c_i is accepted with probability min(1, p(c_i) / q_i(c_i)), where
  q_i is q with c_1..c_{i-1} removed and renormalised (the distribution c_i
  was really drawn from);
* on rejection, p becomes norm(max(0, p - q_i)) for the next candidate;
* when every candidate is rejected (or the node has none), the bonus token is
  drawn from the current p.

By induction over the candidates the emitted token is distributed exactly as
p, whatever q is, so the output is distributed exactly as vanilla sampling's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sampling import sample
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


def accept_sampling(tree: DraftTree, p: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """(accepted path, bonus token) by recursive rejection sampling; ``p`` ``[T, V]``: the full model's
    warped distribution after each node; ``tree.q[n]``: the draft distribution node n's children came from."""
    children = tree.children
    node, path = 0, [0]
    while True:
        p_cur = p[node]
        kids = children[node]
        nxt = None
        if kids:
            q_cur = tree.q[node].clone()
            for c in kids:  # in the order they were drawn
                x = tree.tokens[c]
                qx, px = float(q_cur[x]), float(p_cur[x])
                if qx <= 0.0:
                    raise ValueError(f"node {c}: token {x} has draft probability 0, it cannot have been drawn")
                u = float(torch.rand((), generator=generator, device=p.device))
                if u * qx < px:  # u < p/q, without dividing
                    nxt = c
                    break
                residual = (p_cur - q_cur).clamp_min_(0.0)
                mass = float(residual.sum())
                if mass > 0.0:  # (mass 0 means p == q: rejection had probability 0, float rounding aside)
                    p_cur = residual / mass
                q_cur[x] = 0.0
                left = float(q_cur.sum())
                if left > 0.0:
                    q_cur /= left
        if nxt is None:
            return path, sample(p_cur, generator)
        path.append(nxt)
        node = nxt
