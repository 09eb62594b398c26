"""Lookahead decoding (method ``lookahead``, Fu et al., ICML 2024): n-grams from the model's own Jacobi
iterations, verified in the same forward pass that produces the next iteration.

The peer that SWIFT's paper compares with (its Table 2: 1.2-1.4x on an A100); no draft model, no data store,
no skipped layer.  Each round one full-model pass holds, after the last accepted token (the root):

* the *lookahead branch*: a window of ``W`` columns and ``N - 1`` levels of guesses.  Level 0 is a chain
  from the root (columns 1..W-1 at positions +1..+W-1); the guess at level j of column i hangs below level
  j-1 of the same column (position +i+j).  So every guess sees the root and the guesses of the positions
  before it along its column's Jacobi trajectory, as in the paper's attention mask; the model's token after
  each guess of the last level is the next iteration's guess one position further;
* the *verification branch*: up to ``G`` n-grams from the pool whose first token is the root, each a chain
  of its ``N - 1`` continuation tokens.

Both branches are one token tree (siblings with the same token are one node: same parent, same position,
same computation), verified like any other tree: the longest path the full model agrees with is accepted,
so the output is exactly vanilla's (greedy and coupled sampling, which accept by exact match; the rejection
scheme needs draft distributions that Jacobi guesses do not have, and is refused).  After the pass, each
column's trajectory (its level-0..N-2 guesses and the new one) enters the pool as an n-gram keyed by its
first token (the latest ``G`` distinct ones per key), and the window moves on: the levels shift up and the
new guesses become the last level; for each further accepted token they shift once more, the last level
refilled from the first (as the reference implementations do).

Nothing is priced: every round verifies the full window, which is what the method is.  Its cost per round,
``1 + (W - 1) + W (N - 2) + G (N - 1)`` tokens, pays on hardware with compute to spare (a GPU), far less on
a CPU, where a pass over 20 tokens costs several one-token steps (README).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..core.sampling import Sampler
from ..decoding.protocols import DraftOutcome
from ..decoding.trees import DraftTree
from ..errors import InvalidInputError

# (window W, n-gram size N, guesses G) where none is given.  The paper's setting for 7B models on an A100 (and
# llama.cpp's example): a pass over 1 + 14 + 45 + 60 = 120 tokens, cheap on a GPU.  On our 2-core CPU a pass over
# T tokens costs more with every token; a sweep over 12 Spec-Bench prompts (SmolLM2, README) gave 1.01x for
# (3, 2, 3), 0.92x (5, 2, 5), 0.90x (2, 3, 3), 0.78x (4, 3, 2), 0.77x (2, 4, 2), 0.68x (5, 3, 5).
PAPER_WINDOW = (15, 5, 15)
CPU_WINDOW = (3, 2, 3)


class LookaheadDrafter:
    """Jacobi lookahead window and n-gram pool (see the module docstring)."""

    needs_profile = False

    def __init__(self, window: int | None = None, ngram: int | None = None, guesses: int | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        self._given = (window, ngram, guesses)
        self.W, self.N, self.G = self._resolved("cpu")
        self.seed = seed
        # the cache is sized before the drafter learns the device: room for the larger of the two windows
        self.max_nodes = max(self._nodes_needed(*self._resolved(d)) for d in ("cpu", "other"))
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> latest distinct continuations
        self._levels: list[list[int]] | None = None  # [N - 1][W] guesses; level 0, column 0 is the root
        self._nodes: list[list[int]] = []  # the last tree's node of each guess, [N - 1][W]
        self._tree: DraftTree | None = None

    # -- the Drafter protocol -------------------------------------------------------------------
    def begin(self) -> None:
        """Before a generation: a new window, an empty pool (the method learns from this text only)."""
        self.pool, self._levels, self._tree = {}, None, None

    def bind(self, model, skip) -> None:
        """The window's sizes: those given, the rest sized for the model's device."""
        W, N, G = self._resolved(model.engine.device.type)
        if (W, N, G) != (self.W, self.N, self.G):
            self.W, self.N, self.G = W, N, G
            self.begin()

    def precision(self, model) -> str | None:
        return None

    def propose(self, history: Sequence[int], *, model, cache, skip, budget: int,
                sampler: Sampler) -> DraftOutcome | None:  # fmt: skip
        if sampler.records_q:
            raise InvalidInputError(
                "lookahead verifies its guesses by exact match and has no draft distributions: use greedy "
                "decoding or the coupled sampling scheme (the default), not scheme=rejection"
            )
        if self._levels is None:
            self._levels = self._initial_window(history)
        root = int(history[-1])
        tokens, parents, kids = [root], [-1], [{}]

        def node(parent: int, tok: int) -> int:
            child = kids[parent].get(tok)
            if child is None:
                child = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                kids.append({})
                kids[parent][tok] = child
            return child

        for gram in reversed(self.pool.get(root, ())):  # verification branch, the latest n-grams first
            at = 0
            for tok in gram:
                at = node(at, tok)
        levels, W = self._levels, self.W
        nodes = [[0] * W for _ in levels]
        for i in range(1, W):  # level 0: a chain from the root
            nodes[0][i] = node(nodes[0][i - 1], levels[0][i])
        for j in range(1, len(levels)):
            for i in range(W):
                nodes[j][i] = node(nodes[j - 1][i], levels[j][i])
        self._nodes = nodes
        self._tree = DraftTree(tuple(tokens), tuple(parents))
        return DraftOutcome(self._tree, [], {}, self._tree.depth, passes=0)

    def verified(self, outcome: DraftOutcome | None, choices: Sequence[int], path: list[int]) -> None:
        """After verification: ``choices[n]``, the full model's token after node n; ``path``, the accepted
        nodes (root included)."""
        if outcome is None or outcome.tree is not self._tree or self._levels is None:
            return
        levels, nodes = self._levels, self._nodes
        new = [int(choices[nodes[-1][i]]) for i in range(self.W)]
        root = outcome.tree.tokens[0]
        for f in range(self.W):  # each column's Jacobi trajectory: an n-gram after its first token
            first = root if f == 0 else levels[0][f]
            self._remember(first, (*(levels[j][f] for j in range(1, len(levels))), new[f]))
        levels = [*levels[1:], new]
        for _ in range(len(path) - 1 if len(levels) > 1 else 0):  # each further accepted token moves the
            levels = levels[1:]  # window once more (a single level stays as it is)
            levels.append(list(levels[0]))
        self._levels = levels

    def observe(self, outcome: DraftOutcome | None, path: list[int], *, tokens: int, round_ms: float,
                draft_ms: float, verify_ms: float) -> None:  # fmt: skip
        pass

    # -- internals ------------------------------------------------------------------------------
    def _resolved(self, device: str) -> tuple[int, int, int]:
        defaults = CPU_WINDOW if device == "cpu" else PAPER_WINDOW
        W, N, G = (d if g is None else g for g, d in zip(self._given, defaults, strict=True))
        if W < 1 or N < 2 or G < 0 or W + N < 4:
            raise InvalidInputError(
                "lookahead needs window >= 1, ngram_size >= 2, guesses >= 0 and a window of at least one guess "
                f"(window >= 2 or ngram_size >= 3); got window={W}, ngram_size={N}, guesses={G}"
            )
        return W, N, G

    @staticmethod
    def _nodes_needed(W: int, N: int, G: int) -> int:
        return 1 + (W - 1) + W * (N - 2) + G * (N - 1)

    def _initial_window(self, history: Sequence[int]) -> list[list[int]]:
        """Guesses drawn from the prompt (seeded: the same prompt gives the same rounds)."""
        rng = random.Random(self.seed)
        pick = list(history) or [0]
        return [[int(rng.choice(pick)) for _ in range(self.W)] for _ in range(self.N - 1)]

    def _remember(self, first: int, gram: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(first, [])
        if gram in grams or not self.G:
            return
        grams.append(gram)
        if len(grams) > self.G:
            del grams[0]
