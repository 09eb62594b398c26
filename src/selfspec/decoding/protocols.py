"""The small interfaces the round loop is written against (as in HF's candidate generators: propose, observe).

* :class:`Drafter` proposes a candidate tree from the token history and is told
  how verification went.  A layer-skip drafter reads the skip set it was bound
  to; an n-gram drafter would read only ``history`` and ignore the model.
* :class:`SkipPolicy` chooses the layers a layer-skip drafter leaves out
  (static, ASD, SWIFT, S3D's gap) and observes acceptance.  Optional: a
  drafter that skips no layers needs none.
* :class:`RoundContext` is what a refining skip policy (SWIFT) sees before a round.

Verification and acceptance are plain functions (:mod:`.acceptance`): the full
model's forward and the greedy / speculative-sampling rules have no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..core.cache import KVCache
from ..core.sampling import Sampler
from ..core.skipset import SkipSet
from ..model.engine import SublayerCosine
from .trees import DraftTree


@dataclass
class DraftOutcome:
    tree: DraftTree
    chain_probs: list[float]  # draft probability of each drafted chain token
    leaf_probs: dict[int, float]  # node index -> draft probability, for the alternative leaves
    steps: int  # drafted tokens on the chain (= draft forward passes, unless ``passes`` says otherwise)
    passes: int | None = None  # draft forward passes, when one pass drafts several tokens (S3D)
    ridden: int = 0  # chain tokens drafted from guessed rows (drafters/layerskip.py ``ride``): the passes they saved
    # the full model's logits of every tree node, when the draft passes were the full model's own one-token steps
    # and only the head remained to verify them (a draft that skips nothing: drafters/layerskip.py)
    logits: Any = None
    verify_s: float = 0.0  # of the draft's time, the seconds that verified it (with ``logits``: the head's work)
    grammar: bool = False  # the tokens a grammar forces (decoding/grammar.py), drafted by the decoder itself


@runtime_checkable
class Drafter(Protocol):
    max_nodes: int  # most tokens one verification pass can hold (root included)

    def bind(self, model: Any, skip: SkipSet | None) -> None:
        """Before a prompt (and whenever the skip set changes)."""

    def propose(
        self,
        history: Sequence[int],
        *,
        model: Any,
        cache: KVCache,
        skip: SkipSet | None,
        budget: int,
        sampler: Sampler,
    ) -> DraftOutcome | None:
        """Candidates after ``history`` (prompt + new tokens; the last one is not in the cache yet), or None
        for a round without a draft.  Writes only beyond the cache's committed length.  ``sampler`` picks a
        layer-skip draft's tokens (and says whether the tree must carry the draft distributions)."""

    def observe(self, outcome: DraftOutcome | None, path: list[int], *, tokens: int, round_ms: float,
                draft_ms: float, verify_ms: float) -> None:  # fmt: skip
        """After verification: ``path`` holds the accepted nodes, root included."""

    def precision(self, model: Any) -> str | None:
        """The draft passes' precision name, for the statistics."""


@runtime_checkable
class SkipPolicy(Protocol):
    needs_cosine: bool  # whether ``propose`` reads the prefill's per-sublayer cosine (ASD)

    def propose(self, cosine: SublayerCosine | None, num_layers: int) -> SkipSet: ...

    def observe(self, drafted: int, accepted: int) -> None: ...

    # optional: bind(model, drafter), before_round(ctx: RoundContext) -> SkipSet, finish()


@dataclass(frozen=True)
class RoundContext:
    """What a skip policy sees before a round (SWIFT scores candidate skip sets on the generated text)."""

    model: Any
    cache: KVCache
    prompt_len: int
    generated: list[int]  # new tokens so far; the last one is pending (not in the cache yet)
    skip: SkipSet | None
