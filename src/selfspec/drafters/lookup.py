"""Prompt-lookup drafting (method ``pld``): the draft is what followed the text's last n tokens the last time
they occurred, in the prompt or the output so far.

Saxena's prompt lookup decoding (2023; transformers' ``prompt_lookup_num_tokens``) with two changes of ours:

* the draft length is priced: with the full model's measured pass cost over T tokens
  (:mod:`selfspec.cost.costs`) and the acceptance observed so far for each n-gram size,
  the drafter proposes the k that maximises expected tokens per unit of cost, and nothing
  at all where no k is expected to pay (a weak one-token match on a machine where a
  two-token verification costs 15% more than a step, say);
* matches are looked up in an index of every n-gram of the history for a ladder of sizes
  (1, 2, 3, 4, 6, 8, 12, 16 up to ``max_ngram``), kept up to date as the history grows,
  so a round costs a few dictionary lookups, not a scan of the history.  The longest
  matching size wins, and acceptance is learnt per size: a 16-token match (a passage being
  copied) earns long drafts, a one-token match short ones or none.

No model pass is made to draft, so the drafts cost nothing but verification slots: this
pays where the output copies its input (summaries, code edits, answers quoting a
document) and stays out of the way elsewhere.  Greedy and coupled-sampling output is
exactly vanilla's (the full model verifies every token by exact match); under rejection
sampling each drafted token is a draw from a point mass, which the rule min(1, p/q)
accepts with probability p: the output distribution stays exactly the model's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..core.sampling import Sampler
from ..decoding.protocols import DraftOutcome
from ..decoding.trees import DraftTree, point_masses
from ..errors import InvalidInputError

NGRAM_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # match lengths indexed (up to max_ngram), the longest tried first
PRIOR = {1: 0.3, 2: 0.5, 3: 0.6, 4: 0.6, 6: 0.65, 8: 0.65, 12: 0.7, 16: 0.7}  # acceptance before any is observed
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafted tokens
MIN_GAIN = 1.02  # draft only where the expected tokens per unit cost beat plain decoding by this much
# where the acceptance alone drafts nothing, the drafters try it plus this many standard deviations of its uncertainty
OPTIMISM = 1.0


def ngram_sizes(min_ngram: int, max_ngram: int, method: str) -> tuple[int, ...]:
    """The ladder's sizes from ``min_ngram`` up to ``max_ngram`` (which is always indexed)."""
    if not 1 <= min_ngram <= max_ngram:
        raise InvalidInputError(f"{method} needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
    ladder = {n for n in NGRAM_SIZES if n < max_ngram} | {max_ngram}
    return tuple(sorted(n for n in ladder if n >= min_ngram))


def smoothed_acceptance(n: int, accepted: float, drafted: float, optimism: float = 0.0) -> float:
    """Acceptance after n-gram matches of size n: what was observed, with the size's prior counted as
    ``PRIOR_WEIGHT`` drafted tokens (a size off the ladder, max_ngram=5, takes the prior of the next below).

    With ``optimism`` z: that estimate plus z standard deviations of its uncertainty (as a Beta posterior's,
    sqrt(a (1 - a) / (weight + 1))), what the drafters price a draft by where the estimate alone would draft
    nothing.  Deciding by the estimate alone locks a size out at its first unlucky drafts: it stops being
    drafted, so nothing corrects it (simulated, SmolLM2: one-token matches 0 of 4 early in a session, 0.15, never
    drafted again by ``auto``'s n-gram source, where ``suffix`` alone measured 0.42 over the same prompts).  The
    bonus shrinks as drafts are observed, so a size that keeps failing is tried less and less often."""
    prior = PRIOR[max(k for k in PRIOR if k <= n)]
    weight = drafted + PRIOR_WEIGHT
    a = (accepted + PRIOR_WEIGHT * prior) / weight
    return a + optimism * math.sqrt(max(a * (1.0 - a), 0.0) / (weight + 1.0))


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the token history (see the module docstring)."""

    needs_profile = True  # the draft length is priced with the measured verification costs

    def __init__(self, max_ngram: int = 16, min_ngram: int = 1, max_draft: int = 10,
                 draft_length: int | None = None) -> None:  # fmt: skip
        if max_draft < 1 or (draft_length is not None and draft_length < 1):
            raise InvalidInputError("pld: max_draft and draft_length must be at least 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.sizes = ngram_sizes(min_ngram, max_ngram, "pld")  # the n-gram sizes indexed
        self.max_draft = draft_length or max_draft
        self.fixed = draft_length
        self.max_nodes = 1 + self.max_draft
        self._index: dict[tuple[int, ...], int] = {}
        self._history: list[int] = []
        self._profile = None
        self._costs = None  # the verification cost curve, corrected by the rounds' measured times
        self._drafted = {n: 0.0 for n in self.sizes}
        self._accepted = {n: 0.0 for n in self.sizes}
        self._last_n = 0
        self.last_gain = 0.0  # the expected tokens per vanilla step of the last proposal

    # -- the Drafter protocol -------------------------------------------------------------------
    def bind(self, model, skip) -> None:
        from ..cost.costs import cost_profile
        from ..cost.economy import VerifyCurve

        profile = cost_profile(model) if self.fixed is None else None
        if profile is not self._profile:
            self._profile = profile
            self._costs = VerifyCurve(profile) if profile is not None else None
        self._index, self._history = {}, []

    def precision(self, model) -> str | None:
        return None

    def propose(self, history: Sequence[int], *, model, cache, skip, budget: int,
                sampler: Sampler) -> DraftOutcome | None:  # fmt: skip
        self._update_index(history)
        match = self._match(history)
        if match is None:
            return None
        n, start = match
        best, a = self._choice(n)
        k = min(best, budget, len(history) - start)
        if k < 1:
            return None
        self.last_gain = self._gain_at(a, k)
        draft = list(history[start : start + k])
        self._last_n = n
        q = point_masses(draft, model) if sampler.records_q else None
        tree = DraftTree.chain(int(history[-1]), draft, q)
        return DraftOutcome(tree, [1.0] * k, {}, k, passes=0)

    def match_value(self, history: Sequence[int], extra: Sequence[int]) -> tuple[float, float]:
        """(gain as :attr:`last_gain`, expected accepted tokens + 1) of the draft :meth:`propose` would make after
        ``history`` + ``extra``, looking ``extra``'s last n-grams up among those of ``history`` as :meth:`propose`
        last indexed it; (0, 0) where none matches or no length pays.  Changes nothing (``auto`` asks it after
        each token a layer-skip chain drafts, ``extra`` being that chain)."""
        if not extra or len(self._history) != len(history) or self._costs is None:
            return 0.0, 0.0
        match = self._match([*history[-self.sizes[-1] :], *extra])
        if match is None:
            return 0.0, 0.0
        best, a = self._choice(match[0])
        k = min(best, len(history) - match[1])
        if k < 1:
            return 0.0, 0.0
        gain = self._gain_at(a, k)
        return gain, gain * self._costs.ratio(k + 1)

    def guess(self, history: Sequence[int], extra: Sequence[int], most: int) -> tuple[list[int], list[float], int]:
        """(up to ``most`` tokens that followed the longest n-gram ending ``history`` + ``extra`` before, each
        one's chance of being kept, n) as :meth:`propose` last indexed ``history``; ([], [], 0) where nothing
        matches.  Changes nothing (``auto``'s guesses riding along on a layer-skip chain's passes)."""
        if len(self._history) != len(history) or most < 1:
            return [], [], 0
        match = self._match([*history[-self.sizes[-1] :], *extra])
        if match is None:
            return [], [], 0
        n, start = match
        tokens = [int(t) for t in history[start : start + most]]
        return tokens, [min(self.acceptance(n), 0.99)] * len(tokens), n

    def observe(self, outcome: DraftOutcome | None, path: list[int], *, tokens: int, round_ms: float,
                draft_ms: float, verify_ms: float) -> None:  # fmt: skip
        if self._costs is not None:
            self._costs.observe(len(outcome.tree) if outcome is not None else 1, verify_ms)
        if outcome is None or not outcome.steps:
            return
        n = self._last_n
        # each drafted token up to the first rejection was tried; the geometric model counts trials and successes
        tried = min(outcome.steps, len(path))
        self._drafted[n] += tried
        self._accepted[n] += len(path) - 1

    # -- internals ------------------------------------------------------------------------------
    def _match(self, text: Sequence[int]) -> tuple[int, int] | None:
        """The longest indexed n-gram ending ``text``: (n, where its continuation starts), or None."""
        for n in reversed(self.sizes):
            if n <= len(text) - 1:
                start = self._index.get(tuple(text[-n:]))
                if start is not None:
                    return n, start
        return None

    def _update_index(self, history: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token: n-gram -> where its continuation starts (the
        latest occurrence wins).  A history that is not a continuation of the indexed one is indexed afresh."""
        known = len(self._history)
        if known > len(history) or (known and history[known - 1] != self._history[-1]):
            self._index, self._history, known = {}, [], 0
        self._history.extend(history[known:])
        for end in range(max(1, known), len(history)):  # continuation starts at `end`, which must exist
            for n in self.sizes:
                if end - n >= 0:
                    self._index[tuple(history[end - n : end])] = end

    def acceptance(self, n: int, optimism: float = 0.0) -> float:
        """Estimated chance that a token drafted after an n-gram match is accepted (see smoothed_acceptance)."""
        return smoothed_acceptance(n, self._accepted[n], self._drafted[n], optimism)

    def _gain_at(self, a: float, k: int) -> float:
        """Expected tokens per vanilla step of a k-token draft whose tokens are each accepted with chance a (1:
        break-even)."""
        if self._costs is None:
            return float("inf")  # a fixed draft length: not priced
        a = min(a, 0.99)
        return (1 - a ** (k + 1)) / (1 - a) / self._costs.ratio(k + 1)

    def _length(self, n: int) -> int:
        """The draft length that maximises expected tokens per unit of cost (0: drafting does not pay)."""
        return self._choice(n)[0]

    def _choice(self, n: int) -> tuple[int, float]:
        """(the draft length after an n-gram match of size n, the acceptance it was priced with): by the size's
        estimate, or where that drafts nothing by the estimate with ``OPTIMISM``, so that a size the estimate would
        never draft again is tried until the evidence is clear (smoothed_acceptance)."""
        a = self.acceptance(n)
        if self.fixed is not None:
            return self.fixed, a
        k = self._best_length(a)
        if k or self._costs is None:
            return k, a
        a = self.acceptance(n, OPTIMISM)
        return self._best_length(a), a

    def _best_length(self, a: float) -> int:
        best_k, best = 0, MIN_GAIN
        for k in range(1, self.max_draft + 1):
            gain = self._gain_at(a, k)
            if gain > best:
                best_k, best = k, gain
        return best_k

