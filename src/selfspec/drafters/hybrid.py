"""Hybrid drafting (method ``auto``): each round, the draft source expected to earn the most per unit of cost.

Two sources, complementary by the literature and by our measurements: prompt
lookup (:mod:`.lookup`: no draft pass; pays where the output copies its input,
e.g. summaries, RAG answers, code edits) and SWIFT's layer-skip self-draft
(:mod:`.layerskip` with :class:`~selfspec.policies.swift.SwiftPolicy`: a token
tree from the model with sublayers left out; pays on free text where a draft
step is cheap next to a full one).  Each round:

1. the lookup source looks for a match; its own pricing proposes the draft
   length with the best expected tokens per unit of verification cost (none
   where no length pays), from the acceptance it has observed per n-gram size;
2. that expected gain (in tokens per vanilla step), times its rounds' measured
   gain over their predicted gain, each a running sum (the calibration: the
   prediction leaves out per-round costs and over-trusts short matches; a
   running mean of each round's ratio would be biased up by rounds predicted
   low), is compared with
   the gain the layer-skip source has *measured* over its recent rounds (tokens
   per vanilla step's worth of round time, a running mean; it starts at
   ``PAYS``, 5% over break-even);
3. the better source drafts.  The layer-skip source may still decline (its
   cost-aware exit drafts nothing where not even one token pays, as on a
   quantised model where a draft step costs about what a full one does), and
   the round then decodes plainly; once its measured gain is below
   ``PAYS`` it sits out all but one in ``EXPLORE_EVERY`` rounds, and an exploring round that pays lets it
   draft again (its gain, a running mean, would otherwise stay below ``PAYS`` for several paying rounds, each
   one a longer wait apart: on a Q8_0 file of Qwen2.5-Coder 0.5B, whose 4-bit copies earned 1.3x alone, one hard
   prompt left ``auto`` decoding plainly through the next ones, 5-8% behind them on MT-Bench and translation).

While the layer-skip source drafts, the lookup source's guesses of what follows the chain ride along on its
draft passes as extra rows (:func:`~selfspec.drafters.layerskip.draft_round`'s ``ride``): a guess the draft
then drafts itself spares the chain a pass.  Each guess rides where its chance of being kept (the lookup's
estimate for its n-gram size, corrected by how the guesses after that size have fared) pays for the row it
adds to the pass (the cost profile's price of one more row).  The passes the guesses saved count as run where
the source's measured gain is updated: the guesses are the lookup source's text, and a chain that carried them
through a copied passage would otherwise draw the next rounds from the lookup source's one verification pass
(simulated, Gemma 3 translation: 2.31x without guesses, 2.06x counting their gain, 2.31x with this rule).

So a source whose drafts stop being accepted loses its gain and fades out;
one that starts paying again is noticed (the lookup source re-prices every
match, the layer-skip source explores every few idle rounds).  Both sources
are exact by themselves (greedy, coupled and rejection sampling), so the
hybrid is too: each round's tree comes from one source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..core.sampling import GREEDY_SAMPLER, Sampler
from ..decoding import batch_share
from ..decoding.protocols import DraftOutcome
from .layerskip import Drafter as LayerSkipDrafter
from .lookup import PromptLookupDrafter
from .suffix import SuffixDrafter

SMOOTHING = 0.2  # weight of the newest round in the layer-skip source's measured gain
EXPLORE_EVERY = 16  # a layer-skip source that loses time still drafts once in this many rounds it could have
MAX_BACKOFF = 8  # ... or, while its exploring rounds keep losing, in up to this many times as many
SWITCH_STEPS = 1.0  # vanilla steps an early end of a fully verified layer-skip chain costs (see _switch_steps)
CALIBRATION_WEIGHT = 0.1  # weight of the newest lookup round in the calibration's two running sums
CALIBRATION_PRIOR = 1.0  # both sums start here: one pseudo-round predicted as it turned out
CALIBRATION_RANGE = (0.25, 2.0)  # the calibration's bounds
# the layer-skip source drafts (beyond its exploring rounds) while its measured gain is at least this: rounds that
# only break even add the draft passes' variance and the round's Python for nothing (SmolLM2, whose 4-bit drafts
# cost 0.6 of a step: gains of 0.9-1.1 per round, auto 3-8% below its n-gram source alone)
PAYS = 1.05
RIDE_MOST = 4  # guesses riding along on one draft pass at most
RIDE_PRIOR = 4.0  # the lookup source's chance of a guess counts as this many guesses seen


@dataclass
class SourceStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    ms: float = 0.0  # draft + verification time of its rounds


class HybridDrafter:
    """Prompt lookup and layer-skip drafting, one source per round by expected gain (see the module docstring)."""

    needs_profile = True

    def __init__(self, lookup: PromptLookupDrafter | SuffixDrafter, layerskip: LayerSkipDrafter, *,
                 ride: bool = True) -> None:  # fmt: skip
        self.lookup, self.layerskip = lookup, layerskip
        self.ride = ride  # the lookup source's guesses ride along on layer-skip chains' passes
        layerskip.priced = True  # its rounds' gain is judged by measured costs, not the profile's (machines drift)
        self.skip_gain = PAYS  # layer-skip rounds' measured tokens per vanilla step (1: break-even); drafts from PAYS
        # the lookup source's gains are predictions (its acceptance per n-gram size and the cost curve), the
        # layer-skip source's are measured: lookup rounds' measured / predicted gain puts them on one footing
        self.lookup_calibration = 1.0
        self._measured_sum = self._predicted_sum = CALIBRATION_PRIOR  # running sums behind the calibration
        self._predicted = 0.0  # the lookup gain predicted for the current round
        self._step_ms: float | None = None  # a vanilla step by the cost profile, where the source has no economy
        self._source: str | None = None
        self._idle = 0  # rounds the losing layer-skip source sat out since it last drafted
        self._wait = EXPLORE_EVERY  # rounds it sits out before exploring again (doubles while exploring loses)
        self._exploring = False
        self.sources = {"lookup": SourceStats(), "layerskip": SourceStats()}
        self._rides: list[tuple[int, list[int], int]] = []  # this round's guesses: (chain length, guesses, n)
        self._ride_seen: dict[int, list[float]] = {}  # n -> [guesses tried, guesses the draft drafted too]

    # -- the Drafter protocol -------------------------------------------------------------------
    @property
    def max_nodes(self) -> int:
        return max(self.lookup.max_nodes, self.layerskip.max_nodes)

    def begin(self) -> None:
        """Before a generation: per-source statistics start afresh (what the sources learned stays); a losing
        layer-skip source explores at its first chance, as a new prompt may be where it pays, its wait back to
        ``EXPLORE_EVERY``."""
        self.sources = {name: SourceStats() for name in self.sources}
        self._idle = self._wait = EXPLORE_EVERY
        begin = getattr(self.lookup, "begin", None)  # the suffix source files the last output in its store
        if begin is not None:
            begin()

    def bind(self, model, skip) -> None:
        self.lookup.bind(model, skip)
        self.layerskip.bind(model, skip)
        if self.layerskip.economy is None:  # (a source without an economy: ours all keep one, since priced is set)
            from ..cost.costs import cost_profile

            self._step_ms = cost_profile(model).forward(1)

    def precision(self, model) -> str | None:
        return self.layerskip.precision(model)

    def torch_dtype(self, model):
        return self.layerskip.torch_dtype(model)

    def propose(self, history: Sequence[int], *, model, cache, skip, budget: int,
                sampler: Sampler = GREEDY_SAMPLER) -> DraftOutcome | None:  # fmt: skip
        outcome = self.lookup.propose(history, model=model, cache=cache, skip=skip, budget=budget, sampler=sampler)
        sits_out = self.skip_gain < PAYS and self._idle < min(self._wait, EXPLORE_EVERY * MAX_BACKOFF)
        # the lookup drafts where it beats the layer-skip source, and wherever that source sits out: its match
        # then competes with a plain step, and its own pricing proposed it as paying more than one
        if outcome is not None and (sits_out or self.lookup.last_gain * self.lookup_calibration >= self.skip_gain):
            self._source, self._predicted = "lookup", self.lookup.last_gain
            return outcome
        if sits_out:
            self._idle += 1  # layer-skip rounds have been losing time
            self._source = None
            return None
        self._exploring = self.skip_gain < PAYS
        self._idle = 0
        self._source = "layerskip"
        self._rides = []
        until, ride = self._lookup_wins_after(history), self._ride_along(history) if self.ride else None
        return self.layerskip.propose(history, model=model, cache=cache, skip=skip, budget=budget, sampler=sampler,
                                      until=until, ride=ride)  # fmt: skip

    def _ride_along(self, history: Sequence[int]):
        """The guesses riding on a layer-skip chain's passes (module docstring): after the chain drafted so far,
        the lookup source's continuation, each guess while its chance of being kept (all before it kept too) is
        at least what its row adds to the pass over what a kept guess spares (a draft step).  None where the
        source cannot guess or nothing prices a pass."""
        guess, econ = getattr(self.lookup, "guess", None), self.layerskip.economy
        if guess is None or getattr(econ, "profile", None) is None:
            return None
        forward = econ.profile.forward
        scale = 1.0 if econ.head_only else econ.draft_ms_predicted / forward(1)  # a row of the draft's pass

        def ride(drafted: list[int]) -> list[int]:
            tokens, chances, n = guess(history, drafted, RIDE_MOST)
            tried, kept = self._ride_seen.get(n, (0.0, 0.0))
            keep, take = 1.0, 0
            for i, chance in enumerate(chances):
                keep *= (kept + RIDE_PRIOR * chance) / (tried + RIDE_PRIOR)
                if keep * econ.draft_ms < scale * (forward(i + 2) - forward(i + 1)):
                    break
                take = i + 1
            if take:
                self._rides.append((len(drafted), tokens[:take], n))
            return tokens[:take]

        return ride

    def _learn_rides(self, outcome: DraftOutcome | None) -> None:
        """How this round's guesses fared: each one reached (every guess before it drafted) is a trial, kept
        where the chain drafted the same token."""
        rides, self._rides = self._rides, []
        if outcome is None or not rides:
            return
        chain = outcome.tree.tokens[1 : 1 + outcome.steps]
        for at, guesses, n in rides:
            seen = self._ride_seen.setdefault(n, [0.0, 0.0])
            for i, tok in enumerate(guesses):
                if at + i >= len(chain):
                    break  # the chain ended before this guess was read
                seen[0] += 1.0
                if chain[at + i] != tok:
                    break
                seen[1] += 1.0

    def _lookup_wins_after(self, history: Sequence[int]):
        """A layer-skip chain's stop rule: end it where the lookup source, after the tokens drafted so far, would
        draft E expected tokens at gain g (calibrated) that the layer-skip source makes at its gain s < g, and
        the vanilla steps saved, E (1/s - 1/g), pay for the extra round the cut costs (about one step: the
        chain's verification comes sooner).  None where the source cannot price a match."""
        probe = getattr(self.lookup, "match_value", None)
        if probe is None:
            return None

        def until(drafted: list[int]) -> bool:
            gain, tokens = probe(history, drafted)
            gain *= self.lookup_calibration
            s = max(self.skip_gain, 1.0)
            return gain > s and tokens * (1.0 / s - 1.0 / gain) >= self._switch_steps(len(drafted))

        return until

    def _switch_steps(self, drafted: int) -> float:
        """Vanilla steps that ending a layer-skip chain after ``drafted`` tokens adds: its verification, one round
        sooner.  A full pass (``SWITCH_STEPS``) where a pass verifies the chain; where the full head alone does (a
        draft that skips nothing, :func:`~selfspec.cost.economy.verifies_by_head`), the head over its rows, since
        the draft step over the last drafted token runs in either case (as that verification, or as the chain's
        next step)."""
        econ = self.layerskip.economy
        if econ is None or not econ.head_only:
            return SWITCH_STEPS
        return econ.profile.head(drafted + 1) / econ.profile.forward(1)

    def observe(self, outcome: DraftOutcome | None, path: list[int], *, tokens: int, round_ms: float,
                draft_ms: float, verify_ms: float) -> None:  # fmt: skip
        source = self._source
        if source is None:  # a plain round: what one token costs now, for both sources' pricing
            for drafter in (self.lookup, self.layerskip):
                drafter.observe(None, path, tokens=tokens, round_ms=round_ms, draft_ms=draft_ms, verify_ms=verify_ms)
            return
        drafter = self.lookup if source == "lookup" else self.layerskip
        drafter.observe(outcome, path, tokens=tokens, round_ms=round_ms, draft_ms=draft_ms, verify_ms=verify_ms)
        if source == "layerskip":
            self._learn_rides(outcome)
        self._source = None
        exploring, self._exploring = self._exploring, False
        if outcome is None or not outcome.steps:
            if exploring:  # it declined to draft: nothing pays yet
                self._wait = min(2 * self._wait, EXPLORE_EVERY * MAX_BACKOFF)
            return
        st = self.sources[source]
        st.rounds += 1
        st.drafted += outcome.steps
        st.accepted += len(path) - 1
        st.ms += draft_ms + verify_ms
        # a vanilla step: not this round's verification, which a head-only round (drafters/layerskip.py)
        # makes inside its draft (draft_ms + verify_ms holds the whole round either way)
        econ = self.layerskip.economy
        if source == "layerskip" and econ is not None and outcome.ridden:  # judged by its own chains: the passes
            draft_ms += outcome.ridden * econ.draft_ms  # its guessed rows saved count as run (module docstring)
        if econ is not None and batch_share.current().members > 1:  # beside other requests: priced as a share
            gain = econ.batch_gain(tokens, draft_ms, verify_ms, len(outcome.tree))
        else:
            step_ms = econ.verify_ms(1) if econ is not None else self._step_ms or verify_ms
            gain = tokens * step_ms / max(draft_ms + verify_ms, 1e-6)
        if source == "lookup" and 0 < self._predicted < float("inf"):
            self._measured_sum = (1 - CALIBRATION_WEIGHT) * self._measured_sum + CALIBRATION_WEIGHT * gain
            self._predicted_sum = (1 - CALIBRATION_WEIGHT) * self._predicted_sum + CALIBRATION_WEIGHT * self._predicted
            ratio = self._measured_sum / self._predicted_sum
            self.lookup_calibration = min(max(ratio, CALIBRATION_RANGE[0]), CALIBRATION_RANGE[1])
        if source == "layerskip":
            self.skip_gain = (1 - SMOOTHING) * self.skip_gain + SMOOTHING * gain
            if exploring and gain >= PAYS:  # it paid again: it drafts again, and its next rounds judge it afresh
                self.skip_gain = max(self.skip_gain, PAYS)
            if self.skip_gain >= PAYS:
                self._wait = EXPLORE_EVERY
            elif exploring and gain < PAYS:
                self._wait = min(2 * self._wait, EXPLORE_EVERY * MAX_BACKOFF)

    def source_stats(self) -> dict[str, dict]:
        return {name: asdict(st) for name, st in self.sources.items()}
