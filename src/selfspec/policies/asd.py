"""ASD that pays: ADMG's threshold and guards (alpha, m, n) chosen per model and machine by expected speedup.

The paper (Metel et al. 2024, Table 2) set alpha / m / n per model family by
hand; on our small models its values skip sublayers whose loss the drafts
cannot afford (acceptance ~0.2, ASD slower than vanilla).  The policy of
``method="asd"`` (``preset=auto``, the default) chooses instead, each round,
among a small family of ADMG configurations:

* **Candidates** (:func:`candidate_keys`): rule-1 periods m in {none, 6, 4, 3}
  crossed with rule-2 guards n in {2, 3, 4} and a cosine threshold alpha set
  at a quantile of the prompt's attention-cosine profile, so that a share
  s in {0, 1/8, 1/4, 1/2, 3/4} of the unguarded attention sublayers (those
  with the highest cosine) is skipped.  Share 0 without rule 1 skips nothing:
  a draft that runs every sublayer and saves only its head (the draft
  vocabulary's rows), a candidate where the profile prices it under a full
  pass (Qwen2.5 0.5B: c ~0.6, acceptance ~1).  A key (s, m, n) means the same rule on
  every prompt; its skip set follows each prompt's profile.  On a prompt the
  candidates are ordered from conservative (dear draft steps) to aggressive.
* **Costs**: c = the cost profile's draft step for the set / one full step,
  and the verification curve V_k = forward(k+1) / forward(1) (the profile of
  :mod:`selfspec.cost.costs`, the one SWIFT's speed objective reads); c is
  scaled by what the drafter's rounds measured (draft step against its
  prediction, over the same for verification: ``Economy.cost_correction``).
  The empty set, where its rounds are verified by the full head alone
  (:func:`~selfspec.cost.economy.verifies_by_head`: a draft vocabulary, the
  model's own precision, no server batch), makes no verification pass: its
  V_k = c + head(k+1) / forward(1), one more draft step and the full head
  over the k+1 nodes (:meth:`~selfspec.cost.costs.CostProfile.verify_curve`,
  the price the drafter's economy reads too).
* **Acceptance**, per candidate key: each drafted token up to the first
  rejection is a Bernoulli trial (a chain that is cut after ``accepted``
  tokens gave ``accepted`` hits in ``accepted + 1`` trials); counts decay by
  ``discount`` per observed round, so estimates follow drift.  Prior:
  a0 = min(0.95, agreement) * exp(-k * d), d = sum of (1 - cosine) over the
  skipped sublayers (the damage the prefill statistic predicts), k fitted
  online from every candidate observed so far (starts at 3).
  Estimate a = (hits + w0 * a0) / (trials + w0).
* **Expected speedup** (SWIFT's chain model, :func:`expected_speedup`):
  E(a, c) = max over k <= max_draft of (1 - a^(k+1)) / (1 - a) / (k c + V_k).
* **Draft length**: D&V's adaptive exit (the drafter's), but for the set
  that skips nothing: its draft is the full model's up to the draft
  vocabulary, kept whatever its confidence, so it drafts the k at which E
  peaks (:func:`best_draft_length`).
* **Choice**: the candidate with the best E at the estimate; among it and its
  ``reach`` neighbours in the order, the one with the best E at an upper
  confidence bound a + kappa * sqrt(a (1 - a) / (trials + w0)) drafts, if that
  bound predicts E >= 1 and the drafting rounds so far have not been measured
  to earn less per unit of time than plain ones (``Economy.drafting_loses``:
  the clock overrules the model).  Otherwise the round is plain decoding (the drafter's
  length policy is told not to draft: :class:`DraftGate`, the mechanism
  SWIFT's cost-aware exit uses), and after ``explore_every`` such rounds one
  round drafts anyway (the gap doubles, up to 8x, while drafting keeps
  losing), unless no candidate could pay even at acceptance 1.

What is learned lives in the policy object, so a Session or a bench run
carries it across prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.skipset import SkipSet
from ..cost.economy import verifies_by_head
from ..errors import InvalidInputError
from ..model.engine import SublayerCosine
from .skip import ASD_VARIANTS, admg

SHARES = (0.0, 0.125, 0.25, 0.5, 0.75)
PERIODS: tuple[int | None, ...] = (None, 6, 4, 3)
GUARDS = (2, 3, 4)
MAX_ACCEPTANCE = 0.95  # no prior promises more than this per token
# Skipping nothing, a draft saves only its head (the draft vocabulary's rows: core/draft_vocab.py); one priced at
# this share of a full pass or more saves nothing (no draft vocabulary) and is no candidate.
FULL_PASS = 0.98


@dataclass(frozen=True)
class AutoAsdConfig:
    """How the automatic ASD explores and forgets (defaults need no tuning per model)."""

    explore_every: int = 16  # idle rounds before a round drafts anyway
    prior_weight: float = 4.0  # w0: pseudo-trials of the prior
    damage_scale: float = 3.0  # k's starting value: a0 = 0.95 exp(-k d)
    kappa: float = 1.0  # width of the upper confidence bound
    reach: int = 2  # neighbours (in the conservative -> aggressive order) tried UCB-style
    discount: float = 0.98  # per observed round: acceptance counts fade, estimates follow drift
    rules: str = "all"  # the candidates' rules (RULES): all, or one row of Table 5

    def __post_init__(self) -> None:
        if self.explore_every < 1:
            raise InvalidInputError(f"explore_every must be >= 1, got {self.explore_every}")
        if not 0.0 < self.discount <= 1.0:
            raise InvalidInputError(f"discount must be in (0, 1], got {self.discount}")
        if self.prior_weight <= 0 or self.damage_scale < 0 or self.kappa < 0 or self.reach < 0:
            raise InvalidInputError("prior_weight must be > 0; damage_scale, kappa and reach >= 0")
        candidate_keys(self.rules)  # an unknown name fails here, before any model is loaded


@dataclass(frozen=True)
class CandidateKey:
    """One ADMG configuration: skip ``share`` of the unguarded attention sublayers by cosine, rule 1 every
    ``m``-th layer (None: no rule 1), rule 2 guarding the last ``n`` layers."""

    share: float
    m: int | None
    n: int

    def skip_set(self, cosine: SublayerCosine) -> SkipSet:
        """ADMG (:func:`~selfspec.policies.skip.admg`) with alpha at the profile's matching quantile."""
        L = len(cosine.attention)
        room = max(0, L - self.n)
        k = round(self.share * room)
        if k == 0 and self.m is None:
            return SkipSet()
        if k == 0:
            return admg(cosine, alpha=2.0, m=self.m, n=self.n, variant="r1+r2")
        alpha = sorted(cosine.attention[:room], reverse=True)[k - 1]
        if self.m is None:
            return admg(cosine, alpha=alpha, m=1, n=self.n, variant="cs+r2" if self.n else "cs")
        return admg(cosine, alpha=alpha, m=self.m, n=self.n, variant="admg")


# Which of ADMG's rules a family of candidates uses: one row of the paper's Table 5 (ASD_VARIANTS), or all.
RULES = ("all", *ASD_VARIANTS)


def candidate_keys(rules: str = "all") -> list[CandidateKey]:
    """The family: every share x period x guard (the empty set only once: share 0 without rule 1); or, for a
    row of Table 5, the candidates using exactly its rules (``cs``: shares without a guard)."""
    if rules not in RULES:
        raise InvalidInputError(f"unknown ASD rules '{rules}'; choose one of {', '.join(RULES)}")
    if rules == "cs":
        return [CandidateKey(s, None, 0) for s in SHARES if s > 0]
    keys = [CandidateKey(s, m, n) for s in SHARES for m in PERIODS for n in GUARDS]
    uses = {  # (CS thresholding, rule 1) per family
        "all": None, "cs+r2": (True, False), "r1+r2": (False, True), "admg": (True, True),
    }[rules]  # fmt: skip
    if uses is None:
        return [k for k in keys if not (k.share == 0 and k.m is None and k.n != GUARDS[0])]
    return [k for k in keys if (k.share > 0, k.m is not None) == uses]


def damage(skip: SkipSet, cosine: SublayerCosine) -> float:
    """What the prefill statistic says skipping costs: the sum of (1 - cosine) over the skipped sublayers."""
    return sum(1 - cosine.attention[i] for i in skip.attention) + sum(1 - cosine.mlp[i] for i in skip.mlp)


def _curve(option: Option, cost: float, verify: list[float], head_curve: HeadCurve | None) -> list[float]:
    """The verification curve of ``option`` at draft cost ``cost``: its head-only one if it has one, else ``verify``."""
    return head_curve(cost) if option.head_only and head_curve is not None else verify


def expected_speedup(acceptance: float, cost: float, verify: list[float]) -> float:
    """Speedup over vanilla of chain drafting (SWIFT's model, as :func:`~selfspec.policies.swift.predicted_speedup`).

    ``cost``: draft step / full step; ``verify[k-1]``: a full pass over k+1 tokens / a one-token pass.
    k drafted tokens earn (1 - a^(k+1)) / (1 - a) tokens for k c + V_k; the best k is taken.
    """
    return _best_chain(acceptance, cost, verify)[0]


def best_draft_length(acceptance: float, cost: float, verify: list[float]) -> int:
    """The k at which :func:`expected_speedup` peaks."""
    return _best_chain(acceptance, cost, verify)[1]


def _best_chain(acceptance: float, cost: float, verify: list[float]) -> tuple[float, int]:
    a = min(max(acceptance, 0.0), 0.999)
    best, best_k, tokens, power = 0.0, 1, 1.0, 1.0
    for k, v in enumerate(verify, start=1):
        power *= a
        tokens += power
        if tokens / (k * cost + v) > best:
            best, best_k = tokens / (k * cost + v), k
    return best, best_k


@dataclass(frozen=True)
class Option:
    """A candidate on the current prompt: its skip set, draft-cost ratio c and predicted damage d."""

    key: CandidateKey
    skip: SkipSet
    cost: float
    damage: float
    head_only: bool = False  # its rounds are verified by the full head alone (priced by the head curve)


# c -> V_1..V_max of a head-only round whose draft step costs c one-token passes (CostProfile.verify_curve)
HeadCurve = Callable[[float], list[float]]


@dataclass
class Record:
    """What was observed of one candidate key (discounted counts) and its damage when last used."""

    hits: float = 0.0
    trials: float = 0.0
    damage: float = 0.0


@dataclass(frozen=True)
class Choice:
    """The round's decision: ``pick`` (an index into the options) drafts if ``pays``."""

    pick: int
    pays: bool
    mean_speedup: float
    bound_speedup: float


class DraftGate:
    """A draft-length policy that drafts only in rounds its ``gate`` opens; otherwise ``inner`` decides.

    The automatic ASD policy holds the gate: a round it closes is a round of
    plain decoding (one verified token), as when SWIFT's cost-aware exit
    declines to draft (``begin_round`` False: the drafter proposes nothing).
    It has the interface of :class:`~selfspec.drafters.layerskip.LengthPolicy`
    (not imported: drafters sit above policies).
    """

    economy: Any = None  # set by the drafter like any length policy's; the inner policy keeps its own

    def __init__(self, inner: Any, gate: Callable[[], bool] | None = None) -> None:
        self.inner = inner
        self.gate = gate
        self.length: int | None = None  # set by the policy: draft exactly this many tokens (None: inner decides)

    @property
    def max_draft(self) -> int:
        return self.inner.max_draft

    def begin_round(self) -> bool:
        if self.gate is not None and not self.gate():
            return False
        return self.inner.begin_round()

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        if self.length is not None:
            return self.room(drafted) <= 0
        return self.inner.should_stop(drafted, top1_prob)

    def room(self, drafted: int) -> int:
        if self.length is not None:
            return min(self.length, self.inner.max_draft) - drafted
        return self.inner.room(drafted)

    def observe(self, drafted: int, accepted: int) -> None:
        self.inner.observe(drafted, accepted)


@dataclass
class Learner:
    """Per-candidate acceptance with a damage-based prior whose scale k is fitted from all observations."""

    config: AutoAsdConfig
    records: dict[CandidateKey, Record] = field(default_factory=dict)

    def scale(self) -> float:
        """k: the prior weight's k0 blended with -ln(a / 0.95) / d of every observed candidate."""
        w0 = self.config.prior_weight
        num, den = self.config.damage_scale * w0, w0
        for r in self.records.values():
            if r.trials > 0 and r.damage > 1e-6:
                a = min((r.hits + 0.5) / (r.trials + 1.0), MAX_ACCEPTANCE)
                num += r.trials * -math.log(a / MAX_ACCEPTANCE) / r.damage
                den += r.trials
        return num / den

    def estimate(self, option: Option, ceiling: float, scale: float) -> tuple[float, float]:
        """(mean, upper bound) of the per-token acceptance of ``option``."""
        w0 = self.config.prior_weight
        prior = min(MAX_ACCEPTANCE, ceiling) * math.exp(-scale * option.damage)
        r = self.records.get(option.key, Record())
        mean = (r.hits + w0 * prior) / (r.trials + w0)
        bound = mean + self.config.kappa * math.sqrt(max(mean * (1 - mean), 0.0) / (r.trials + w0))
        return mean, min(bound, 0.999)

    def observe(self, option: Option, drafted: int, accepted: int) -> None:
        """One verified chain drafted with ``option``: ``accepted`` hits, and a miss if it was cut."""
        for r in self.records.values():
            r.hits *= self.config.discount
            r.trials *= self.config.discount
        r = self.records.setdefault(option.key, Record())
        r.hits += accepted
        r.trials += accepted + (1 if accepted < drafted else 0)
        r.damage = option.damage


def choose(options: list[Option], estimates: list[tuple[float, float]], verify: list[float], reach: int,
           cost_scale: float = 1.0, head_curve: HeadCurve | None = None) -> Choice:  # fmt: skip
    """The best option by expected speedup at its mean acceptance, then UCB among it and its neighbours.

    ``options`` are ordered from conservative to aggressive; ``estimates`` are
    (mean, upper bound) acceptances; ``cost_scale`` corrects every option's c
    (what the rounds measured against the profile); ``verify`` is the curve of
    rounds verified by a pass, ``head_curve`` that of head-only options.
    ``pays``: the pick's bound predicts a speedup of at least 1 (otherwise the
    round should not draft).
    """
    costs = [o.cost * cost_scale for o in options]
    curves = [_curve(o, c, verify, head_curve) for o, c in zip(options, costs, strict=True)]
    means = [expected_speedup(m, c, v) for c, v, (m, _) in zip(costs, curves, estimates, strict=True)]
    best = max(range(len(options)), key=lambda i: means[i])
    near = range(max(0, best - reach), min(len(options), best + reach + 1))
    bounds = {i: expected_speedup(estimates[i][1], costs[i], curves[i]) for i in near}
    pick = max(near, key=lambda i: (bounds[i], means[i]))
    return Choice(pick, bounds[pick] >= 1.0, means[pick], bounds[pick])


class AutoAsdPolicy:
    """The skip policy of ``method="asd"`` (``preset=auto``): ADMG configured by expected speedup (module doc).

    Pair it with a drafter whose length policy is a :class:`DraftGate`
    (``methods.py`` does): :meth:`bind` connects the gate, so that rounds
    where no candidate is predicted to pay are plain decoding.  ``profile``:
    a :class:`~selfspec.cost.costs.CostProfile` to use instead of the
    model's measured one (tests, what-if studies).
    """

    needs_cosine = True

    def __init__(self, config: AutoAsdConfig | None = None, *, profile=None) -> None:
        self.config = config or AutoAsdConfig()
        self.profile = profile
        self._own_profile = profile is None  # measured per model at bind
        self.learner = Learner(self.config)
        self.options: list[Option] = []
        self.choice: Choice | None = None
        self._model_key: str | None = None
        self._precision = "same"
        self._verify: list[float] = []
        self._max_draft = 12
        self._head_only = False  # the empty set's rounds would be verified by the head alone
        self._can_pay = False  # some option would pay if its drafts were always kept
        self._idle = 0  # rounds without drafting since the last draft
        self._gap = self.config.explore_every
        self._open = False  # this round drafts
        self._current: int | None = None  # the option used this round
        self._drafter = None
        self._gate: DraftGate | None = None

    @property
    def needs_profile(self) -> bool:
        """Binding reads the model's cost profile (so that it can be measured before anything is timed)."""
        return self._own_profile

    def bind(self, model, drafter=None) -> None:
        """Before a prompt: the model's costs, the drafter's precision and draft limit, the gate.  Where the drafter
        is ``auto``'s hybrid, its layer-skip source's: this policy picks that source's skip set and draft length
        from its measured costs, as when ASD drafts alone, but the hybrid decides which rounds it drafts (by that
        source's measured gain; two gates, each exploring on its own schedule, would seldom open together)."""
        hybrid = getattr(drafter, "layerskip", None) is not None
        drafter = getattr(drafter, "layerskip", drafter)
        key = f"{model.name}|{model.hf.config.model_type}|{model.num_layers}"
        if key != self._model_key:  # another model: nothing learned applies
            self._model_key, self.learner = key, Learner(self.config)
            if self._own_profile:
                self.profile = None
        if self.profile is None:
            from ..cost.costs import cost_profile

            self.profile = cost_profile(model)
        precision = drafter.precision(model) if hasattr(drafter, "precision") else "same"
        self._precision = precision if precision in self.profile.drafts else "same"
        self._max_draft = max_draft = int(getattr(drafter, "max_draft", 12))
        self._verify = self.profile.verify_curve(max_draft)
        dtype = drafter.torch_dtype(model) if hasattr(drafter, "torch_dtype") else None
        self._head_only = verifies_by_head(getattr(model, "engine", None), SkipSet(), dtype)
        self._gate = drafter.length if isinstance(getattr(drafter, "length", None), DraftGate) else None
        if self._gate is not None:
            self._gate.gate = None if hybrid else self.drafting
        self._drafter = drafter  # its economy measures what draft steps and verifications really cost

    def drafting(self) -> bool:
        """The gate: whether the current round drafts."""
        return self._open

    # -- the skip-policy protocol ------------------------------------------------------------------
    def propose(self, cosine: SublayerCosine | None, num_layers: int) -> SkipSet:
        """A new prompt: its candidates from its cosine profile, and the first choice."""
        if cosine is None:
            raise InvalidInputError("ASD needs the prefill's cosine statistics")
        if self.profile is None:
            raise InvalidInputError("AutoAsdPolicy.bind(model) comes before propose")
        self._prepare(cosine, num_layers)
        self._rechoose()
        self._current = None
        # a new prompt changes what drafts earn (another task, another text): a gate closed by earlier prompts'
        # losing rounds opens for this one's first round and re-measures, its wait back to explore_every (in a
        # Spec-Bench run on Gemma 3 a gate closed in translation stayed closed through the next category's
        # prompts, where drafting paid 1.4x: asd drafted 146 tokens there against 387 in another run)
        self._idle = self._gap = self.config.explore_every
        return self._skip()

    def before_round(self, ctx) -> SkipSet:
        """Open the gate if the choice pays, or for an exploring round after enough idle ones."""
        choice = self.choice
        if choice is None:
            self._open = False
            return self._skip()
        if choice.pays:
            self._open, self._idle, self._gap = True, 0, self.config.explore_every
        else:
            self._idle += 1
            self._open = self._can_pay and self._idle >= self._gap
            if self._open:  # explore; while drafting keeps losing, wait longer before the next try
                self._idle, self._gap = 0, min(2 * self._gap, 8 * self.config.explore_every)
        self._current = choice.pick
        return self._skip()

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified draft of the current option: learn its acceptance, choose again."""
        if self._current is None or not self.options:
            return
        self.learner.observe(self.options[self._current], drafted, accepted)
        self._rechoose()

    # -- internals ---------------------------------------------------------------------------------
    def _skip(self) -> SkipSet:
        return self.options[self.choice.pick].skip if self.choice is not None else SkipSet()

    def _prepare(self, cosine: SublayerCosine, num_layers: int) -> None:
        """This prompt's options, deduplicated by skip set, ordered from conservative to aggressive."""
        profile, seen, options = self.profile, set(), []
        for key in candidate_keys(self.config.rules):
            skip = key.skip_set(cosine).validate(num_layers)
            cost = profile.draft_ratio(skip, self._precision)
            if skip in seen or (skip.is_empty and cost >= FULL_PASS):  # a draft that is the full pass never pays
                continue
            seen.add(skip)
            options.append(Option(key, skip, cost, damage(skip, cosine), skip.is_empty and self._head_only))
        options.sort(key=lambda o: (-o.cost, o.damage))
        self.options = options

    def _economy(self):
        """The drafter's economy, which measures what its rounds really cost (None: none, or another model's)."""
        econ = getattr(self._drafter, "economy", None)
        return econ if econ is not None and econ.profile is self.profile else None

    def _rechoose(self) -> None:
        if not self.options:
            self.choice = None
            return
        econ = self._economy()
        scale, cost_scale = self.learner.scale(), econ.cost_correction() if econ is not None else 1.0
        self._can_pay = any(expected_speedup(1.0, o.cost * cost_scale, self._curve(o, cost_scale)) >= 1.0
                            for o in self.options)  # fmt: skip
        # the agreement alone, not CostProfile.agreement: the learner sees the draft vocabulary's misses in the
        # acceptance it observes (with them in its prior too, Gemma 3's asd drafted shorter: 1.66x -> 1.59x,
        # simulated, 18 Spec-Bench prompts)
        ceiling = self.profile.drafts[self._precision].agreement
        estimates = [self.learner.estimate(o, ceiling, scale) for o in self.options]
        choice = choose(self.options, estimates, self._verify, self.config.reach, cost_scale, self._head_curve)
        if choice.pays and econ is not None and econ.drafting_loses():
            choice = replace(choice, pays=False)  # predicted to pay, measured to lose: explore only
        self.choice = choice
        if self._gate is not None:  # a draft skipping nothing is kept whatever its confidence: draft the best k
            pick = self.options[choice.pick]
            curve = self._curve(pick, cost_scale)  # a head-only empty set: its head-only price's best k
            best_k = best_draft_length(estimates[choice.pick][0], pick.cost * cost_scale, curve)
            self._gate.length = best_k if pick.skip.is_empty else None

    def _head_curve(self, cost: float) -> list[float]:
        """V_k of a head-only round whose draft step costs ``cost`` one-token passes (the profile's price)."""
        return self.profile.verify_curve(self._max_draft, cost * self.profile.forward(1))

    def _curve(self, option: Option, cost_scale: float) -> list[float]:
        return _curve(option, option.cost * cost_scale, self._verify, self._head_curve)
