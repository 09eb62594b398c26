"""Draft & Verify's offline skip-set search: Bayesian optimisation of measured decoding speed.

    selfspec search --model smollm2-135m --dataset xsum --limit 8 --iterations 200 --out skips.json
    selfspec generate --method static --skip-set skips.json --prompt "..."     # or --method selfsd

The search space is D&V's: one variable in [0, 1] per attention and per MLP
sublayer (2L in all), a value above 0.5 meaning "skip".  The objective is the
decoding speed the skip set really gives: self-speculative decoding with it
on the calibration prompts, timed, divided by the speed of vanilla decoding
on the same prompts measured at the start of the run (so the objective reads
as a speedup).  Prefill time is left out of both: it is the same full-model
pass for every candidate.  Different points of the space often map to the
same skip set; a set already measured is not measured again.

Before the optimiser's own points, a few known-good starting points are
probed (:func:`seed_skip_sets`): SWIFT's uniform start, ASD's ADMG set, and
sparser sets ranked by the calibration prompts' per-sublayer cosine
similarity.  Then ``init_points`` random points, then the optimiser's
suggestions (upper confidence bound).

Every observation goes to a state file after it is made, so a search stopped
by Ctrl-C, a time budget or a crash resumes where it was (same model and
calibration data required).  The best skip set is written to ``out`` with
the model, the calibration data, the objective reached and the date.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from ..core.skipset import SkipSet
from ..datasets import PromptItem
from ..decoding.loop import Decoder, prefill
from ..errors import InvalidInputError
from ..io import atomic_write_text
from ..methods import build_policies
from ..model.engine import SublayerCosine
from ..model.models import Model
from ..policies.skip import admg

STATE_VERSION = 1


@dataclass(frozen=True)
class Observation:
    """One measured candidate."""

    iteration: int
    source: str  # "seed:<name>", "random", "bo"
    params: list[float]  # the optimiser's point: attention variables, then MLP variables
    attention: list[int]
    mlp: list[int]
    speedup: float  # the objective: candidate decode speed / vanilla decode speed
    tokens_per_second: float
    M: float
    acceptance_rate: float
    seconds: float  # wall time of the measurement
    measured: bool = True  # False: the same set was measured before (its figures reused), or it is empty

    @property
    def skip_set(self) -> SkipSet:
        return SkipSet.of(self.attention, self.mlp)


@dataclass
class SearchState:
    """Everything needed to resume a search, saved as JSON after every observation."""

    model: str
    num_layers: int
    calibration: dict[str, Any]
    vanilla_tokens_per_second: float | None = None
    observations: list[Observation] = field(default_factory=list)
    elapsed: float = 0.0  # seconds spent over all runs

    @property
    def best(self) -> Observation | None:
        return max(self.observations, key=lambda o: o.speedup, default=None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = STATE_VERSION
        return d

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")  # never a half-written state

    @classmethod
    def load(cls, path: Path) -> SearchState:
        try:
            data = json.loads(path.read_text())
            if data.pop("version", None) != STATE_VERSION:
                raise ValueError("unknown state version")
            data["observations"] = [Observation(**o) for o in data["observations"]]
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise InvalidInputError(f"search state {path} is unreadable ({exc}); delete it to start afresh") from None


@dataclass(frozen=True)
class SearchResult:
    best: SkipSet  # with meta: model, calibration, objective, date
    state: SearchState
    new_observations: int
    stop_reason: str  # "iterations", "time budget", "interrupted"


# -- the search space -------------------------------------------------------------------------


def param_names(num_layers: int) -> list[str]:
    width = len(str(num_layers - 1))
    return [f"attn{i:0{width}d}" for i in range(num_layers)] + [f"mlp{i:0{width}d}" for i in range(num_layers)]


def to_skip_set(values: Sequence[float], num_layers: int) -> SkipSet:
    """D&V's encoding: variable > 0.5 means the sublayer is skipped."""
    attention = [i for i in range(num_layers) if values[i] > 0.5]
    mlp = [i for i in range(num_layers) if values[num_layers + i] > 0.5]
    return SkipSet.of(attention, mlp)


def to_params(skip: SkipSet, num_layers: int) -> list[float]:
    """A point of the space that encodes ``skip`` (0.75 skipped, 0.25 kept)."""
    return [0.75 if i in skip.attention else 0.25 for i in range(num_layers)] + [
        0.75 if i in skip.mlp else 0.25 for i in range(num_layers)
    ]


def seed_skip_sets(num_layers: int, cosine: SublayerCosine | None) -> dict[str, SkipSet]:
    """Known-good starting points, probed before the optimiser's own.

    SWIFT's uniform start (every other layer, first and last kept) and the same
    on attention only; with the calibration prompts' prefill statistics, ASD's
    ADMG set (paper values) and sparser sets ranked by cosine similarity: the
    L/8, L/4 and L/2 attention sublayers, and the L/4 sublayers of either kind,
    whose output changes the hidden state least.  Sparse seeds matter on small
    models, where skipping half the layers leaves a draft that is never right.
    """
    inner = range(1, num_layers - 1)  # never the first and the last layer
    every_other = [i for i in inner if i % 2 == 1]
    seeds = {
        "swift-uniform": SkipSet.of(every_other, every_other),
        "attention-every-other": SkipSet.of(every_other, []),
    }
    if cosine is not None:
        seeds["asd-admg"] = admg(cosine, alpha=0.985, m=3, n=2)
        attention = sorted(inner, key=lambda i: -cosine.attention[i])
        for part in (8, 4, 2):
            k = max(1, num_layers // part)
            seeds[f"cosine-top-attention-L/{part}"] = SkipSet.of(attention[:k], [])
        ranked = sorted(
            [(cosine.attention[i], "attention", i) for i in inner] + [(cosine.mlp[i], "mlp", i) for i in inner],
            reverse=True,
        )[: max(1, num_layers // 4)]
        picked = {kind: [i for _, k, i in ranked if k == kind] for kind in ("attention", "mlp")}
        seeds["cosine-top-sublayers-L/4"] = SkipSet.of(picked["attention"], picked["mlp"])
    unique: dict[str, SkipSet] = {}
    for name, s in seeds.items():
        if not s.is_empty and s not in unique.values():
            unique[name] = s
    return unique


# -- measuring a candidate --------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    tokens_per_second: float  # new tokens / decode time (prefill excluded)
    M: float
    acceptance_rate: float
    seconds: float


class Calibration:
    """The calibration prompts, prefilled once, and the timed decoding of a method on all of them.

    Every candidate decodes from the same prefills (:class:`~selfspec.decoding.Prefill`): the
    prompt pass is the full model's whatever the skip set, so it is neither repeated nor timed.
    """

    def __init__(self, model: Model, prompts: Sequence[PromptItem], max_new_tokens: int, max_nodes: int) -> None:
        if not prompts:
            raise InvalidInputError("the search needs at least one calibration prompt")
        self.model = model
        self.max_new_tokens = max_new_tokens
        ids = [model.encode(item.prompt) for item in prompts]
        self.prefills = [
            prefill(model, p, max_new_tokens=max_new_tokens, max_nodes=max_nodes, cosine=True) for p in ids
        ]

    def cosine(self) -> SublayerCosine:
        """Mean per-sublayer cosine over the calibration prompts."""
        cosines = [pf.cosine for pf in self.prefills if pf.cosine is not None]
        n = len(cosines)
        return SublayerCosine(
            tuple(sum(c.attention[i] for c in cosines) / n for i in range(len(cosines[0].attention))),
            tuple(sum(c.mlp[i] for c in cosines) / n for i in range(len(cosines[0].mlp))),
        )

    def measure(self, method: str, **options: Any) -> Measurement:
        t0 = time.perf_counter()
        skip_policy, draft_policy = build_policies(method, options)  # a fresh draft-length state per candidate
        tokens = forwards = drafted = accepted = 0
        decode_time = 0.0
        for pf in self.prefills:
            decoder = Decoder(self.model, list(pf.prompt_ids), max_new_tokens=self.max_new_tokens, method=method,
                              skip_policy=skip_policy, draft_policy=draft_policy, prefill=pf)  # fmt: skip
            for _ in decoder:
                pass
            stats = decoder.stats
            tokens += stats.new_tokens - 1  # the prefill's token is not a decoding step's
            forwards += stats.forwards - 1
            drafted += stats.drafted
            accepted += stats.accepted
            decode_time += stats.total_time
        return Measurement(
            tokens_per_second=tokens / decode_time if decode_time > 0 else 0.0,
            M=tokens / forwards if forwards else 0.0,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            seconds=time.perf_counter() - t0,
        )


# -- the search -------------------------------------------------------------------------------

ProgressFn = Callable[[Observation, SearchState], None]

_DRAFT_OPTIONS = ("max_draft", "gamma", "draft_length", "draft_dtype")


def search_skip_set(
    model: Model,
    prompts: Sequence[PromptItem],
    *,
    iterations: int,
    out: str | Path,
    state_path: str | Path | None = None,
    calibration_info: dict[str, Any] | None = None,
    max_new_tokens: int = 32,
    init_points: int = 10,
    time_budget: float | None = None,
    seed: int = 0,
    draft_options: dict[str, Any] | None = None,
    progress: bool = False,
    on_observation: ProgressFn | None = None,
) -> SearchResult:
    """Search a skip set for ``model`` on ``prompts``; ``iterations`` counts all observations, resumed ones too.

    ``state_path`` (default ``<out>.state.json``) is resumed when it exists.
    ``time_budget`` (seconds, this run) stops the search early; so does Ctrl-C.
    ``draft_options`` (``max_draft``, ``gamma``, ``draft_length``) configure the
    draft length while measuring, and should match how the set will be used.
    """
    # 1. check the options (before the calibration prompts' prefills, which take time)
    draft_options, max_nodes = _check_options(iterations, init_points, time_budget, draft_options)
    out = Path(out)
    state_path = Path(state_path) if state_path is not None else out.with_name(out.name + ".state.json")
    calibration_info = {**(calibration_info or {}), "prompts": len(prompts), "max_new_tokens": max_new_tokens}
    # 2. prefill the calibration prompts, resume or start the state, replay it into the optimiser
    calib = Calibration(model, prompts, max_new_tokens, max_nodes)
    state = _load_or_start(state_path, model, calibration_info)
    run = _SearchRun(calib, state, draft_options, init_points, seed)
    # 3. the vanilla baseline, measured once per search (it is in the state)
    t_start = time.perf_counter()
    elapsed_before = state.elapsed
    if state.vanilla_tokens_per_second is None:
        state.vanilla_tokens_per_second = calib.measure("vanilla").tokens_per_second
        state.save(state_path)
    if len(state.observations) < iterations:
        run.queue_seeds()
    # 4. observe until the iterations, the time budget or Ctrl-C; the state is saved after each one
    bar = _progress_bar(iterations, len(state.observations)) if progress else None
    stop_reason = "iterations"
    new = 0
    try:
        while len(state.observations) < iterations:
            if time_budget is not None and time.perf_counter() - t_start >= time_budget:
                stop_reason = "time budget"
                break
            obs = run.observe_next()
            state.elapsed = elapsed_before + time.perf_counter() - t_start
            state.save(state_path)
            new += 1
            if state.best is obs:
                _write_best(state, out)
            if bar is not None:
                best = state.best
                bar.set_postfix_str(f"best {best.speedup:.3f}x ({len(best.attention)}a+{len(best.mlp)}m skipped)")
                bar.update(1)
            if on_observation is not None:
                on_observation(obs, state)
    except KeyboardInterrupt:
        stop_reason = "interrupted"
    finally:
        if bar is not None:
            bar.close()
        state.elapsed = elapsed_before + time.perf_counter() - t_start
        state.save(state_path)
    # 5. the best set, with its meta, to ``out``
    if state.best is None:
        raise InvalidInputError("the search made no observation (time budget too small?)")
    return SearchResult(_write_best(state, out), state, new, stop_reason)


def _check_options(
    iterations: int, init_points: int, time_budget: float | None, draft_options: dict[str, Any] | None
) -> tuple[dict[str, Any], int]:
    """The search's options checked; returns the draft options and the draft's most tree nodes."""
    if iterations < 1:
        raise InvalidInputError(f"iterations must be >= 1, got {iterations}")
    if init_points < 0:
        raise InvalidInputError(f"init_points must be >= 0, got {init_points}")
    if time_budget is not None and time_budget <= 0:
        raise InvalidInputError(f"time budget must be > 0 seconds, got {time_budget}")
    draft_options = dict(draft_options or {})
    unknown = sorted(set(draft_options) - set(_DRAFT_OPTIONS))
    if unknown:
        raise InvalidInputError(f"unknown draft option(s) {', '.join(unknown)}; valid: {', '.join(_DRAFT_OPTIONS)}")
    _, draft_policy = build_policies("static", {"skip_set": SkipSet(), **draft_options})  # checks the values
    return draft_options, draft_policy.max_nodes


def _load_or_start(state_path: Path, model: Model, calibration_info: dict[str, Any]) -> SearchState:
    """The saved state when it belongs to this search (same model and calibration data), else a new one."""
    if not state_path.exists():
        return SearchState(model.name, model.num_layers, calibration_info)
    state = SearchState.load(state_path)
    if (state.model, state.num_layers, state.calibration) != (model.name, model.num_layers, calibration_info):
        raise InvalidInputError(
            f"search state {state_path} belongs to another search (model {state.model}, "
            f"calibration {state.calibration}); pass another --state or delete it"
        )
    return state


def _progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=min(initial, total), file=sys.stderr, unit="set")


class _SearchRun:
    """The optimiser and the candidates: seeds first, then random points, then the optimiser's suggestions.

    A candidate whose skip set was measured before reuses its figures; an empty set is not measured.
    """

    def __init__(self, calib: Calibration, state: SearchState, draft_options: dict[str, Any], init_points: int,
                 seed: int) -> None:  # fmt: skip
        from bayes_opt import BayesianOptimization

        self.calib, self.state = calib, state
        self.draft_options, self.init_points = draft_options, init_points
        self.L = state.num_layers
        self.names = param_names(self.L)
        self.optimizer = BayesianOptimization(
            f=None, pbounds={n: (0.0, 1.0) for n in self.names}, random_state=seed, verbose=0,
            allow_duplicate_points=True,
        )  # fmt: skip
        for o in state.observations:
            self.optimizer.register(params=dict(zip(self.names, o.params, strict=True)), target=o.speedup)
        self.measured = {(tuple(o.attention), tuple(o.mlp)): o for o in state.observations if o.measured}
        self.seeds: list[tuple[str, SkipSet]] = []

    def queue_seeds(self) -> None:
        """The known-good starting points not yet tried (a resumed search has tried some)."""
        tried = {o.source for o in self.state.observations}
        seeds = seed_skip_sets(self.L, self.calib.cosine())
        self.seeds = [(f"seed:{n}", s) for n, s in seeds.items() if f"seed:{n}" not in tried]

    def next_candidate(self) -> tuple[str, list[float], SkipSet]:
        """(source, the optimiser's point, its skip set)."""
        if self.seeds:
            source, skip = self.seeds.pop(0)
            return source, to_params(skip, self.L), skip
        random_phase = sum(o.source == "random" for o in self.state.observations) < self.init_points
        point = self.optimizer.random_sample(1)[0] if random_phase else self.optimizer.suggest()
        params = [float(point[n]) for n in self.names]
        return ("random" if random_phase else "bo"), params, to_skip_set(params, self.L)

    def observe_next(self) -> Observation:
        """Measure the next candidate (or reuse its set's figures), register it and append it to the state."""
        index = len(self.state.observations)
        source, params, skip = self.next_candidate()
        key = (tuple(sorted(skip.attention)), tuple(sorted(skip.mlp)))
        if skip.is_empty:  # the draft would be the full model: never faster than vanilla, not worth measuring
            obs = Observation(index, source, params, [], [], 0.0, 0.0, 0.0, 0.0, 0.0, measured=False)
        elif key in self.measured:
            obs = replace(self.measured[key], iteration=index, source=source, params=params, seconds=0.0,
                          measured=False)  # fmt: skip
        else:
            m = self.calib.measure("static", skip_set=skip, **self.draft_options)
            vanilla_tps = self.state.vanilla_tokens_per_second
            speedup = m.tokens_per_second / vanilla_tps if vanilla_tps else 0.0
            obs = Observation(index, source, params, list(key[0]), list(key[1]), speedup, m.tokens_per_second, m.M,
                              m.acceptance_rate, m.seconds)  # fmt: skip
            self.measured[key] = obs
        self.optimizer.register(params=dict(zip(self.names, params, strict=True)), target=obs.speedup)
        self.state.observations.append(obs)
        return obs


def _write_best(state: SearchState, out: Path) -> SkipSet:
    best = state.best
    assert best is not None
    skip = SkipSet.of(
        best.attention,
        best.mlp,
        model=state.model,
        num_layers=state.num_layers,
        calibration=state.calibration,
        objective={
            "speedup_vs_vanilla_decode": round(best.speedup, 4),
            "tokens_per_second": round(best.tokens_per_second, 2),
            "vanilla_tokens_per_second": round(state.vanilla_tokens_per_second or 0.0, 2),
            "M": round(best.M, 3),
            "acceptance_rate": round(best.acceptance_rate, 4),
        },
        search={
            "method": "draft-and-verify bayesian optimisation",
            "observations": len(state.observations),
            "found_at": best.iteration,
            "source": best.source,
            "seconds": round(state.elapsed, 1),
        },
        date=datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    skip.save(out)
    return skip
