"""Is one more draft token, or one more tree leaf, worth its cost?  Decided from measurements.

A speculative round costs draft passes plus one verification pass whose cost
grows with the number of candidates (:class:`~selfspec.cost.costs.CostProfile`);
it earns the accepted tokens plus one.  An action (draft one more token, add
one more leaf to the tree) that is expected to earn ``g`` tokens for ``t`` ms
raises the rate tokens/ms exactly when ``g / t`` beats the rate already
achieved, i.e. when ``g * ms_per_token >= t``.  :class:`Economy` supplies the
three measured ingredients:

* ``ms_per_token``: the current cost of a token, a running mean over rounds
  (starts at one full-model step, i.e. vanilla's rate);
* the cost of a draft step and of verifying T candidates: the profile's
  figures, rescaled by running means of what the rounds really took (the
  machine's load changes; the profile's shape stays);
* :class:`Calibration`: the probability that the full model keeps a drafted
  token, as a function of the draft's own probability for it, learned online
  from every verification (separately for the drafted chain and for the
  alternative leaves).

One economy lives as long as its :class:`~selfspec.Session`, so what it learns
carries over between prompts.  In a batch of concurrent requests a token is worth the round's time shared
by its sequences, and verified rows cost what they add beside the others' (:mod:`selfspec.decoding.batch_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.skipset import SkipSet
from ..decoding import batch_share
from .costs import CostProfile, cost_profile


def verifies_by_head(engine: Any, skip: SkipSet | None, precision: Any) -> bool:
    """Whether a draft with ``skip`` in ``precision`` (a torch dtype; None: the model's own) is verified by the
    full LM head alone, without a verification pass (drafters/layerskip.py, ``draft_round``): it skips nothing
    in the model's own precision, so with a draft vocabulary (a smaller head) its passes are the full model's
    one-token steps; and its rounds are not verified in a server's batch (decoding/batch.py: the batch's pass
    verifies every member's round, so the draft is priced, and verified, as any other).  The one test both the
    draft loop and the pricing (:class:`Economy`, ASD's choice) read."""
    if skip is None or skip.attention or skip.mlp or precision is not None:
        return False
    return getattr(engine, "draft_vocab", None) is not None and not batch_share.batched()


def best_precision(model: Any) -> str:
    """The draft precision ``draft_dtype=auto`` means for ``model`` (:meth:`CostProfile.best_precision`, with
    head-only verification where its drafts that skip nothing in its own precision get it)."""
    return cost_profile(model).best_precision(verifies_by_head(getattr(model, "engine", None), SkipSet(), None))


@dataclass
class Calibration:
    """P(kept | draft probability p), per bin of p, with a weak prior that the draft is calibrated."""

    bins: int = 10
    prior: float = 2.0  # pseudo-observations per bin at the bin's centre
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.trials:
            self.trials = [self.prior] * self.bins
            self.hits = [self.prior * (b + 0.5) / self.bins for b in range(self.bins)]

    def _bin(self, p: float) -> int:
        if p != p:  # NaN (a draft pass in low precision overflowed): the lowest bin
            return 0
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def prob(self, p: float) -> float:
        b = self._bin(p)
        return self.hits[b] / self.trials[b]

    def update(self, p: float, kept: bool) -> None:
        b = self._bin(p)
        self.trials[b] += 1.0
        self.hits[b] += 1.0 if kept else 0.0


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class Economy:
    profile: CostProfile
    draft_ms_predicted: float  # the profile's figure for one draft step of the current draft model
    smoothing: float = 0.1
    chain: Calibration = field(default_factory=Calibration)
    leaves: Calibration = field(default_factory=Calibration)
    ms_per_token: float = 0.0
    draft_ms: float = 0.0
    verify_scale: float = 1.0
    draft_scale: float = 1.0  # measured / predicted ms of a draft step, whatever the skip set (kept on rebind)
    first_token_acceptance: float | None = None  # running mean: is drafting worth it at all?
    rounds: int = 0
    plain_round_ms: float | None = None  # running mean of a round without a draft (one token), as measured
    draft_gain: float | None = None  # running mean of drafting rounds' tokens per plain round's time
    draft_rounds: int = 0
    head_only: bool = False  # the draft's rounds are verified by the full head alone (:func:`verifies_by_head`)
    GAIN_SMOOTHING = 0.2  # weight of the newest drafting round in draft_gain

    def __post_init__(self) -> None:
        if self.ms_per_token <= 0:
            self.ms_per_token = self.profile.forward(1)
        if self.draft_ms <= 0:
            self.draft_ms = self.draft_ms_predicted

    def rebind(self, draft_ms_predicted: float, head_only: bool = False) -> None:
        """The draft model changed (another skip set): start from the profile's prediction for it."""
        self.head_only = head_only
        if abs(draft_ms_predicted - self.draft_ms_predicted) > 1e-9:
            self.draft_ms_predicted = draft_ms_predicted
            self.draft_ms = draft_ms_predicted

    def _verification(self, tokens: int) -> float:
        """The profile's price of verifying ``tokens`` nodes of this draft's round (:meth:`CostProfile.verification`:
        head-only rounds pay one more draft step and the full head, not a pass)."""
        return self.profile.verification(tokens, self.draft_ms_predicted if self.head_only else None)

    def verify_ms(self, tokens: int) -> float:
        """A verification over ``tokens`` rows (a head-only one: :attr:`head_only`); in a batch of concurrent
        requests (:mod:`selfspec.decoding.batch_share`) what those rows add beside the others' (the same for one
        row, so plain rounds keep their price)."""
        beside, forward = batch_share.current().rows_beside, self.profile.forward
        if beside == 0:
            return self.verify_scale * self._verification(tokens)
        return self.verify_scale * (forward(beside + tokens) - forward(beside + 1) + forward(1))

    @property
    def token_ms(self) -> float:
        """What a token is worth: a round's time per token, shared by the sequences of a batch."""
        return self.ms_per_token / batch_share.current().members

    def batch_gain(self, tokens: int, draft_ms: float, verify_ms: float, verified: int) -> float:
        """A round's tokens per plain round's worth of time, in a batch of concurrent requests
        (:mod:`selfspec.decoding.batch_share`): the batch's pass runs for every member whether this one drafts or
        not, so a plain round costs this sequence its share of the pass (``verify_ms``, the pass as this round
        waited for it, over the members) and earns one token; a drafting round costs that share, plus its draft
        steps (run alone while every other member waits) and what its extra rows add to the pass.  1 is
        break-even, as alone."""
        share = verify_ms / batch_share.current().members
        spent = share + draft_ms + self.verify_ms(verified) - self.verify_ms(1)
        return tokens * share / max(spent, 1e-6)

    def drafting_loses(self, rounds: int = 4) -> bool:
        """Whether drafting rounds, as measured over at least ``rounds`` of them, earn fewer tokens per unit
        of time than plain rounds do (the rounds' clock, not a model of it, has the last word)."""
        return self.draft_rounds >= rounds and self.draft_gain is not None and self.draft_gain < 1.0

    def cost_correction(self) -> float:
        """By how much the profile's draft-step ratio c is off, as the rounds measure it: what a draft step
        really costs next to its prediction, over the same for a full pass.  The profile times each pass alone;
        in a round the draft's own bookkeeping and the alternation with verification count too (SmolLM2: a
        draft skipping 4 of 60 sublayers, predicted at 0.74 of a step, took 0.9-1.0)."""
        return self.draft_scale / self.verify_scale

    # -- decisions ---------------------------------------------------------------------------
    def worth_drafting(self) -> bool:
        """Before a round: does a first draft token pay for itself (one draft step + one more verified token)?"""
        a = 0.5 if self.first_token_acceptance is None else self.first_token_acceptance
        return a * self.token_ms >= self.draft_ms + self.verify_ms(2) - self.verify_ms(1)

    def worth_another_draft(self, path_prob: float, next_acceptance: float, tree_size: int, horizon: int = 16) -> bool:
        """Draft on, the chain so far being kept with ``path_prob`` and each next token with ``next_acceptance``?

        Looks ahead: drafting on pays if drafting some number h of further
        tokens does, since the verification cost is not convex in the token
        count (on our CPU 3 tokens cost 30% more than 2, and 4 no more than 3).
        """
        gain = 0.0
        keep = path_prob
        base = self.verify_ms(tree_size)
        for h in range(1, horizon + 1):
            keep *= next_acceptance
            gain += keep
            cost = h * self.draft_ms + self.verify_ms(tree_size + h) - base
            if gain * self.token_ms >= cost:
                return True
        return False

    def worth_leaf(self, gain: float, tree_size: int) -> bool:
        """Verify one more leaf, expected to earn ``gain`` tokens?"""
        return gain * self.token_ms >= self.verify_ms(tree_size + 1) - self.verify_ms(tree_size)

    # -- learning ----------------------------------------------------------------------------
    def observe(
        self,
        *,
        tokens: int,
        round_ms: float,
        draft_steps: int,
        draft_ms: float,
        verified: int,
        verify_ms: float,
        first_kept: bool | None,
    ) -> None:
        """One round's outcome: tokens produced, and what its draft and verification passes took."""
        w = self.smoothing
        self.rounds += 1
        if tokens > 0 and round_ms > 0:
            self.ms_per_token = _ema(self.ms_per_token, round_ms / tokens, w)
        if draft_steps == 0 and verified == 1 and round_ms > 0:
            self.plain_round_ms = _ema(self.plain_round_ms, round_ms, w)
        if draft_steps > 0:
            self.draft_ms = _ema(self.draft_ms, draft_ms / draft_steps, w)
            if self.draft_ms_predicted > 0:
                self.draft_scale = _ema(self.draft_scale, draft_ms / draft_steps / self.draft_ms_predicted, w)
            if round_ms > 0:
                if batch_share.current().members > 1:
                    gain = self.batch_gain(tokens, draft_ms, verify_ms, verified)
                else:
                    gain = tokens * (self.plain_round_ms or self.verify_scale * self.profile.forward(1)) / round_ms
                self.draft_gain = _ema(self.draft_gain, gain, self.GAIN_SMOOTHING)
                self.draft_rounds += 1
        beside = batch_share.current().rows_beside
        predicted = self._verification(verified) if beside == 0 else self.profile.forward(beside + verified)
        if predicted > 0 and verify_ms > 0:
            self.verify_scale = _ema(self.verify_scale, verify_ms / predicted, w)
        if first_kept is not None:
            self.first_token_acceptance = _ema(self.first_token_acceptance, float(first_kept), w)


class VerifyCurve:
    """What a verification over T tokens costs next to a one-token round, as the rounds measure it.

    The profile's curve was timed at a 128-token context; at a long one every extra row's attention costs
    more (SmolLM2 after a 386-token article: a two-token round 1.28x a one-token one, the profile says 1.12x),
    so a draft priced with the profile alone can lose time.  Kept here: the running mean of a one-token
    round's ms, and the factor by which rounds of more tokens cost more than the profile says *beyond* one
    token; the profile keeps the curve's shape.
    """

    SLOPE_RANGE = (0.25, 4.0)

    def __init__(self, profile: CostProfile, smoothing: float = 0.1) -> None:
        self.profile, self.smoothing = profile, smoothing
        self.one_ms = profile.forward(1)
        self.slope = 1.0

    def observe(self, tokens: int, verify_ms: float) -> None:
        """One round's verification over ``tokens`` tokens (root included) took ``verify_ms``."""
        if verify_ms <= 0:
            return
        if tokens <= 1:
            self.one_ms = _ema(self.one_ms, verify_ms, self.smoothing)
            return
        extra = self.profile.forward(tokens) - self.profile.forward(1)
        if extra > 0:
            lo, hi = self.SLOPE_RANGE
            measured = min(max((verify_ms - self.one_ms) / extra, lo), hi)
            self.slope = _ema(self.slope, measured, self.smoothing)

    def ratio(self, tokens: int) -> float:
        """Cost of verifying ``tokens`` tokens in one-token rounds (1.0 for one).  In a batch of concurrent
        requests (:mod:`selfspec.decoding.batch_share`) a one-token round of this sequence is worth its share of
        the pass (the round's measured time over the members), what its extra rows are weighed against: they
        hold up every member."""
        if tokens <= 1:
            return 1.0
        share = self.one_ms / batch_share.current().members
        return 1.0 + self.slope * (self.profile.forward(tokens) - self.profile.forward(1)) / share
