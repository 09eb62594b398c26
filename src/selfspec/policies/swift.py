"""SWIFT: on-the-fly optimisation of the skip set while generating (Xia et al., "SWIFT", ICLR 2025).

The skip policy of ``method="swift"``.  Before a decoding round it may take
one *optimisation step*: propose a candidate skip set and score it on text the
model has already generated; the best set found drafts the following rounds.
What it learns persists across the prompts of a :class:`~selfspec.Session`
and can be saved to / loaded from a JSON file (``state=PATH``).

The paper's mechanism, with its parameters as defaults:

* start from uniform skipping (every other layer; first and last layer never
  skipped); optimise once ``context_window`` (32) tokens of a response exist;
* propose by random search, and by Bayesian optimisation (``bayes_opt``, UCB
  kappa 2.5, GP noise 1e-2) every ``bo_interval`` (25) steps, over the
  2(L-2) sublayers of the inner layers, skipping ``skip_ratio`` of them;
* score by *matchness*: one teacher-forced pass of the candidate draft over
  the response's first ``context_window`` tokens, reusing the prompt's keys and
  values; the share of positions where its argmax is the real next token;
* keep the best; stop at a matchness above ``score_threshold`` (0.95), after
  ``patience`` (300) steps without improvement, or after ``max_steps`` (1000).

What we changed, and why (``search="paper"`` and ``objective="matchness"``
with a fixed ``skip_ratio`` restore the paper's behaviour):

* **The skip ratio adapts** (``skip_ratio="auto"``, the default): a candidate
  is scored by the speedup it predicts, from its matchness (as the per-token
  acceptance) and its draft cost measured by the model's cost profile
  (:mod:`selfspec.cost.costs`), maximised over the draft length.  A small model
  whose drafts collapse when half its layers go gets a sparse set; a large one
  a dense set; no number to guess per model.
* **Local proposals** (``search="local"``): the non-BO proposals mutate the
  best set (swap, add or drop one or two sublayers; or, one time in five and
  in the first three steps, keep a random part of it) instead of drawing a
  fresh random set; on a 135M model random sets at any fixed ratio score far
  below what a few mutations reach.
* **Fair comparisons**: the best set is re-scored on each new prompt's window,
  so a challenger is always compared on the same text.
* **An overhead budget** (``budget``, default 0.1): optimisation steps run only
  while their time stays below this share of the session's decoding time; on
  a 2-core CPU an optimisation step costs about a decoding step.  While no set
  scored so far is predicted to pay (speed objective), the share halves every
  quarter of ``give_up_after`` steps, down to an eighth: the evidence that
  nothing pays grows, and so does what the search has cost.
* **Domain shift**: after optimisation stopped, the best set is still scored
  on every new prompt's window; a drop of ``reopen_drop`` (0.1) in matchness
  below what it scored when optimisation stopped reopens the search.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core import clock
from ..core.skipset import SkipSet
from ..cost.economy import verifies_by_head
from ..errors import InvalidInputError
from ..io import atomic_write_text, read_json

STATE_VERSION = 1
NO_SET_PAYS = "no skip set pays"


@dataclass(frozen=True)
class SwiftConfig:
    context_window: int = 32
    skip_ratio: float | str = "auto"  # paper: 0.45 for 13B models
    objective: str = "speed"  # "speed" (predicted from matchness and measured costs) or "matchness" (paper)
    bo_interval: int = 25
    max_steps: int = 1000
    patience: int = 300
    score_threshold: float = 0.95
    search: str = "local"  # "local" (mutate the best) or "paper" (fresh random sets)
    budget: float = 0.1  # most optimisation time as a share of decoding time
    reopen_drop: float = 0.1
    give_up_after: int = 40  # objective speed: stop after this many steps when still no set is predicted to pay
    seed: int = 0

    def __post_init__(self) -> None:
        if self.context_window < 2:
            raise InvalidInputError(f"context_window must be >= 2, got {self.context_window}")
        if self.skip_ratio != "auto":
            try:
                ratio = float(self.skip_ratio)
            except (TypeError, ValueError):
                ratio = -1.0
            if not 0.0 < ratio < 1.0:
                raise InvalidInputError(f"skip_ratio must be 'auto' or a number in (0, 1), got {self.skip_ratio!r}")
            object.__setattr__(self, "skip_ratio", ratio)
        for name in ("bo_interval", "patience", "give_up_after"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps < 0:  # 0: no optimisation phase, the starting set drafts throughout (paper Table 8)
            raise InvalidInputError(f"max_steps must be >= 0, got {self.max_steps}")
        if not 0.0 < self.score_threshold <= 1.0:
            raise InvalidInputError(f"score_threshold must be in (0, 1], got {self.score_threshold}")
        if self.objective not in ("speed", "matchness"):
            raise InvalidInputError(f"objective must be 'speed' or 'matchness', got {self.objective!r}")
        if self.objective == "matchness" and self.skip_ratio == "auto":
            raise InvalidInputError("objective=matchness needs a fixed skip_ratio (the paper: 0.45)")
        if self.search not in ("local", "paper"):
            raise InvalidInputError(f"search must be 'local' or 'paper', got {self.search!r}")
        if not self.budget > 0.0:
            raise InvalidInputError(f"budget must be > 0 (a share of decoding time, e.g. 0.1), got {self.budget}")

    @property
    def adaptive(self) -> bool:
        return self.skip_ratio == "auto"


@dataclass
class SwiftState:
    """Everything the optimiser has learned (saved as JSON, keyed by model)."""

    num_layers: int
    best: dict[str, list[int]]  # {"attention": [...], "mlp": [...]}
    best_score: float | None = None  # objective of the best set on the current prompt's window
    best_matchness: float | None = None
    steps: int = 0
    steps_open: int = 0  # scoring passes (steps, new prompts' rescoring) since the search last (re)started
    since_improvement: int = 0
    done: bool = False
    stop_reason: str = ""
    matchness_at_stop: float | None = None
    observations: list[tuple[list[int], float]] = field(default_factory=list)  # (0/1 point, objective)
    optimise_seconds: float = 0.0
    decode_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)  # improvements: step, score, matchness, size

    @property
    def best_set(self) -> SkipSet:
        return SkipSet.of(self.best["attention"], self.best["mlp"])


def uniform_skip_set(num_layers: int) -> SkipSet:
    """SWIFT's start: every other layer's attention and MLP, never the first or the last layer."""
    odd = [i for i in range(1, num_layers - 1) if i % 2 == 1]
    return SkipSet.of(odd, odd)


class SwiftPolicy:
    needs_cosine = False

    @property
    def needs_profile(self) -> bool:
        """Whether binding will read the model's cost profile (so that it can be measured before timing)."""
        return self.config.objective == "speed"

    def __init__(self, config: SwiftConfig | None = None, *, state_path: str | Path | None = None) -> None:
        self.config = config or SwiftConfig()
        self.state_path = Path(state_path) if state_path is not None else None
        self.state: SwiftState | None = None
        self._model_key: str | None = None
        self._rng = random.Random(self.config.seed)
        self._optimizer = None
        self._window_prompt: tuple[int, ...] | None = None  # the prompt whose window the best set was scored on
        self._profile = None
        self._precision_name = "same"
        self._drafter = None  # the method's Drafter: its draft precision is the one to score candidates in
        self._head_only = False  # a draft skipping nothing would be verified by the head alone (priced so)
        self._last_round_end: float | None = None
        self._pass_seconds: float | None = None  # a scoring pass's measured duration (running mean)

    # -- persistence ---------------------------------------------------------------------------
    def bind(self, model, drafter=None) -> None:
        """Before a prompt: load the saved state for this model (once), learn the draft costs."""
        self._drafter = drafter
        if self._drafter is not None:
            self._precision_name = self._drafter.precision(model)
        dtype = drafter.torch_dtype(model) if hasattr(drafter, "torch_dtype") else None
        self._head_only = verifies_by_head(getattr(model, "engine", None), SkipSet(), dtype)
        if self.config.objective == "speed" and self._profile is None:
            from ..cost.costs import cost_profile

            self._profile = cost_profile(model)
        key = _model_key(model)
        if self.state is None or self._model_key != key:
            self._model_key = key
            self.state = self._load(key, model.num_layers) or self._fresh_state(model)
            self._optimizer = None
        self._last_round_end = None

    def _fresh_state(self, model) -> SwiftState:
        L = model.num_layers
        start = uniform_skip_set(L)
        # A draft skipping nothing is cheap and nearly always right when its weights are in a cheaper precision,
        # or when its head scores the draft vocabulary and the profile predicts it pays: start there.
        cheap_dtype = self._drafter is not None and self._drafter.torch_dtype(model) is not None
        if self.config.adaptive and (cheap_dtype or self._full_draft_pays()):
            start = SkipSet()
        return SwiftState(L, {"attention": sorted(start.attention), "mlp": sorted(start.mlp)})

    def _full_draft_pays(self) -> bool:
        """Whether the profile predicts a draft skipping nothing (its head over the draft vocabulary) to pay
        at the acceptance its precision agrees with the full model."""
        prof = self._profile
        if prof is None:
            return False
        name = self._precision_name if self._precision_name in prof.drafts else "same"
        return predicted_speedup(prof, SkipSet(), prof.drafts[name].agreement, name, head_only=self._head_only) > 1.0

    def _load(self, key: str, num_layers: int) -> SwiftState | None:
        if self.state_path is None or not self.state_path.is_file():
            return None
        try:
            data = json.loads(self.state_path.read_text())
            entry = data.get(key)
            if entry is None:
                return None
            if entry.pop("version", None) != STATE_VERSION:
                raise ValueError("unknown state version")
            entry["observations"] = [(list(p), float(t)) for p, t in entry["observations"]]
            state = SwiftState(**entry)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            msg = f"SWIFT state {self.state_path} is unreadable ({exc}); delete it or pass another"
            raise InvalidInputError(msg) from None
        if state.num_layers != num_layers:
            raise InvalidInputError(f"SWIFT state {self.state_path} is for a model with {state.num_layers} layers")
        return state

    def save(self, path: str | Path | None = None) -> None:
        """Write the state to ``path`` (default: the ``state`` option), keeping other models' entries."""
        path = Path(path) if path is not None else self.state_path
        if path is None or self.state is None or self._model_key is None:
            return
        data: dict[str, Any] = {}
        if path.is_file():  # a corrupt or foreign file is reported, never overwritten: it may be someone's work
            data = read_json(path, what="SWIFT state")
            if not isinstance(data, dict):
                raise InvalidInputError(f"SWIFT state {path} is not a SWIFT state file; delete it or pass another")
        entry = asdict(self.state)
        entry["version"] = STATE_VERSION
        data[self._model_key] = entry
        atomic_write_text(path, json.dumps(data) + "\n")

    def finish(self) -> None:
        """After a prompt: save the state when a path was given."""
        self.save()

    # -- the skip-policy protocol ------------------------------------------------------------------
    def propose(self, cosine, num_layers: int) -> SkipSet:
        assert self.state is not None, "SwiftPolicy.bind(model) comes first"
        return self.state.best_set.validate(num_layers)

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def before_round(self, ctx) -> SkipSet:
        """Maybe one optimisation step; returns the skip set to draft with."""
        state = self.state
        assert state is not None
        now = clock.now()
        if self._last_round_end is not None:
            state.decode_seconds += now - self._last_round_end
        W = self.config.context_window
        window_ready = len(ctx.generated) >= W + 1 and ctx.cache.capacity - ctx.cache.length >= W
        # every piece of work (rescoring the best set on a new prompt's window, a step) within the time budget,
        # the pass about to run included: a short one-off generation never pays for a search it cannot use
        optimising = self.config.max_steps > 0
        spent = state.optimise_seconds + self._pass_estimate()
        if optimising and window_ready and spent <= self._budget_share() * state.decode_seconds:
            prompt_key = (ctx.prompt_len, *ctx.generated[: W + 1])
            if prompt_key != self._window_prompt:
                self._window_prompt = prompt_key
                self._rescore_best(ctx)
            elif not state.done:
                self._step(ctx)
        self._last_round_end = clock.now()
        state.optimise_seconds += self._last_round_end - now
        return state.best_set

    def _budget_share(self) -> float:
        """The search's share of decoding time.  Under the speed objective, while no set it scored is predicted to
        pay, what more searching is worth shrinks with every scoring pass that found none (a step, or the best set
        scored on a new prompt): the share halves every quarter of ``give_up_after`` such passes since the search
        (re)opened, down to an eighth; a paying set restores it."""
        state, cfg = self.state, self.config
        if cfg.objective != "speed" or (state.best_score or 0.0) >= 1.0:
            return cfg.budget
        return cfg.budget / 2 ** min(3, state.steps_open // max(1, cfg.give_up_after // 4))

    # -- optimisation ------------------------------------------------------------------------------
    def _rescore_best(self, ctx) -> None:
        """A new prompt: score the best set on its window, so that challengers are compared fairly."""
        state = self.state
        m = self.matchness(ctx, state.best_set)
        state.best_score, state.best_matchness = self._objective(state.best_set, m), m
        if not state.done and (state.best_score or 0.0) < 1.0:
            state.steps_open += 1  # a scoring pass that found no paying set either: evidence, and time spent
        if state.done and state.matchness_at_stop is not None:
            drop = self.config.reopen_drop
            # the text changed: search again (a set that stopped paying, or none paid and drafting got easier)
            changed = m > state.matchness_at_stop + drop if state.stop_reason == NO_SET_PAYS else \
                m < state.matchness_at_stop - drop  # fmt: skip
            if changed:
                state.done, state.since_improvement, state.steps_open, state.stop_reason = False, 0, 0, ""

    def _step(self, ctx) -> None:
        state, cfg = self.state, self.config
        state.steps += 1
        state.steps_open += 1
        use_bo = state.steps % cfg.bo_interval == 0 and len(state.observations) >= 2
        candidate = self._bo_candidate() if use_bo else self._random_candidate()
        if candidate is None or candidate == state.best_set:
            candidate = self._random_candidate()
        m = self.matchness(ctx, candidate)
        score = self._objective(candidate, m)
        state.observations.append((self._point(candidate), score))
        if self._optimizer is not None:
            self._register(self._point(candidate), score)
        if state.best_score is None or score > state.best_score:
            state.best = {"attention": sorted(candidate.attention), "mlp": sorted(candidate.mlp)}
            state.best_score, state.best_matchness, state.since_improvement = score, m, 0
            state.history.append({"step": state.steps, "score": round(score, 4), "matchness": round(m, 4),
                                  "size": len(candidate), "source": "bo" if use_bo else cfg.search})  # fmt: skip
            if m > cfg.score_threshold:
                self._stop("score threshold")
        else:
            state.since_improvement += 1
        if not state.done and state.since_improvement > cfg.patience:
            self._stop("patience")
        if not state.done and state.steps >= cfg.max_steps:
            self._stop("max steps")
        if (not state.done and cfg.objective == "speed" and state.steps_open >= cfg.give_up_after
                and (state.best_score or 0.0) < 1.0):  # fmt: skip
            self._stop(NO_SET_PAYS)  # drafting would lose time whatever is skipped: spend no more on searching

    def _stop(self, reason: str) -> None:
        state = self.state
        state.done, state.stop_reason, state.matchness_at_stop = True, reason, state.best_matchness

    def _pass_estimate(self) -> float:
        """Seconds of one scoring pass: as measured, else the cost profile's full pass over the window."""
        if self._pass_seconds is not None:
            return self._pass_seconds
        if self._profile is not None:
            return self._profile.forward(self.config.context_window) / 1000.0
        return 0.0

    def matchness(self, ctx, skip: SkipSet) -> float:
        t0 = clock.now()
        m = self._matchness(ctx, skip)
        took = clock.now() - t0
        self._pass_seconds = took if self._pass_seconds is None else 0.5 * (self._pass_seconds + took)
        return m

    @torch.inference_mode()
    def _matchness(self, ctx, skip: SkipSet) -> float:
        """Share of the window's positions where the draft's argmax is the real next token (SWIFT eq. 4)."""
        W = self.config.context_window
        engine = ctx.model.engine
        S = ctx.prompt_len
        window = torch.tensor(ctx.generated[:W], dtype=torch.long, device=engine.device)
        target = torch.tensor(ctx.generated[1 : W + 1], dtype=torch.long, device=engine.device)
        positions = torch.arange(S, S + W, device=engine.device)
        # Written beyond the committed length (scratch), seeing only the prompt's entries of the full model.
        # In the model's own precision even when drafts use a cheaper one: half-precision products are fast
        # for one row on CPU but slow for 32 (376 vs 160 ms), and both precisions agree on ~99% of tokens.
        # prefill=True: a window of rows may take the quantised products' faster bulk path (a score, not output)
        guess = engine.forward(ctx.cache, window, ctx.cache.length, positions=positions, skip=skip, visible=S,
                               argmax_only=True, prefill=True, draft=True)  # fmt: skip
        return float((guess == target).float().mean())

    def _objective(self, skip: SkipSet, matchness: float) -> float:
        if self.config.objective == "matchness":
            return matchness
        return predicted_speedup(self._profile, skip, matchness, self._precision_name, head_only=self._head_only)

    # -- proposals ---------------------------------------------------------------------------------
    def _slots(self) -> list[tuple[str, int]]:
        L = self.state.num_layers
        inner = range(1, L - 1)
        return [("attention", i) for i in inner] + [("mlp", i) for i in inner]

    def _point(self, skip: SkipSet) -> list[int]:
        return [int(i in (skip.attention if kind == "attention" else skip.mlp)) for kind, i in self._slots()]

    def _from_slots(self, chosen) -> SkipSet:
        return SkipSet.of([i for k, i in chosen if k == "attention"], [i for k, i in chosen if k == "mlp"])

    def _target_size(self) -> int:
        n = len(self._slots())
        if not self.config.adaptive:
            return max(1, int(n * float(self.config.skip_ratio)))
        return len(self.state.best_set)

    def _random_candidate(self) -> SkipSet:
        slots = self._slots()
        if self.config.search == "paper":
            return self._from_slots(self._rng.sample(slots, self._target_size()))
        best = self.state.best_set
        chosen = {s for s in slots if s[1] in (best.attention if s[0] == "attention" else best.mlp)}
        if self.config.adaptive and chosen and (self.state.steps <= 3 or self._rng.random() < 0.2):
            # a size move: keep a random half (early on: find the scale fast) or 50-90% of the best set
            share = 0.5 if self.state.steps <= 3 else self._rng.uniform(0.5, 0.9)
            return self._from_slots(self._rng.sample(sorted(chosen), int(len(chosen) * share)))
        free = [s for s in slots if s not in chosen]
        moves = ["swap", "add", "drop"] if self.config.adaptive else ["swap"]
        for _ in range(self._rng.choice((1, 1, 2))):
            move = self._rng.choice(moves)
            if move in ("swap", "drop") and chosen:
                out = self._rng.choice(sorted(chosen))
                chosen.discard(out)
                free.append(out)
                if move == "drop":
                    continue
            if free:
                inn = self._rng.choice(free)
                free.remove(inn)
                chosen.add(inn)
        return self._from_slots(chosen)

    def _bo_candidate(self) -> SkipSet | None:
        """The optimiser's suggestion: the ``size`` sublayers with the largest suggested values are skipped."""
        if self._optimizer is None:
            self._make_optimizer()
        values = self._suggest()
        if values is None:
            return None
        k = self._target_size()
        if self.config.adaptive:
            k = max(0, k + self._rng.choice((-1, 0, 0, 1)))
        order = sorted(range(len(values)), key=lambda j: -values[j])[:k]
        slots = self._slots()
        return self._from_slots([slots[j] for j in order])

    def _names(self) -> list[str]:
        return [f"{kind[0]}{i:03d}" for kind, i in self._slots()]

    def _make_optimizer(self) -> None:
        from bayes_opt import BayesianOptimization, acquisition

        self._acquisition = acquisition.UpperConfidenceBound(kappa=2.5)
        self._optimizer = BayesianOptimization(
            f=None, pbounds={n: (0.0, 1.0) for n in self._names()}, acquisition_function=self._acquisition,
            random_state=self.config.seed, verbose=0, allow_duplicate_points=True,
        )  # fmt: skip
        self._optimizer.set_gp_params(alpha=1e-2)
        self._registered: set[tuple[int, ...]] = set()
        for point, target in self.state.observations:
            self._register(point, target)

    def _register(self, point: list[int], target: float) -> None:
        key = tuple(point)
        if key in self._registered:  # the same set scored on another window: the GP keeps the first score
            return
        self._registered.add(key)
        self._optimizer.register(params=dict(zip(self._names(), map(float, point), strict=True)), target=target)

    def _suggest(self) -> list[float] | None:
        opt = self._optimizer
        try:
            # bayes_opt's default search of the acquisition's maximum takes ~5 s here; 1000 random + 1 L-BFGS ~0.5 s
            x = self._acquisition.suggest(gp=opt._gp, target_space=opt._space, n_random=1000, n_smart=1)
            return [float(v) for v in x]
        except (AttributeError, TypeError):  # another bayes_opt version: its own (slower) suggestion
            point = opt.suggest()
            return [float(point[n]) for n in self._names()]
        except ValueError:  # e.g. a degenerate GP fit
            return None


def predicted_speedup(profile, skip: SkipSet, acceptance: float, precision: str = "same", max_draft: int = 16, *,
                      head_only: bool = False) -> float:  # fmt: skip
    """Speedup over vanilla of drafting with ``skip``, if each draft token is kept with ``acceptance``.

    Chain drafting with n tokens earns (1 - a^(n+1)) / (1 - a) tokens per round
    and costs n draft steps plus a verification over n+1 tokens, all in units
    of a one-token full pass (the profile's figures); the best n is taken.
    ``head_only``: a draft skipping nothing is verified by the head alone
    (:func:`~selfspec.cost.economy.verifies_by_head`), priced by
    :meth:`~selfspec.cost.costs.CostProfile.verify_curve` as ASD prices it.
    """
    if profile is None:
        return acceptance
    a = min(max(acceptance, 0.0), 0.999)
    name = precision if precision in profile.drafts else "same"
    step = profile.draft_step(skip, name)
    c = step / profile.forward(1)
    verify = profile.verify_curve(max_draft, step if head_only and skip.is_empty else None)
    best = 0.0
    for n, v in enumerate(verify, start=1):
        tokens = (1 - a ** (n + 1)) / (1 - a)
        best = max(best, tokens / (n * c + v))
    return best


def _model_key(model) -> str:
    return f"{model.name}|{model.hf.config.model_type}|{model.num_layers}"
