"""Run a benchmark: every method on every prompt, fairly timed.

    from selfspec.bench import run_benchmark
    result = run_benchmark(model, prompts, "vanilla,asd,hf", max_new_tokens=64)

Fairness rules, as in gpt-fast's benchmark loop:

1. warm-up: the first ``warmup`` prompts run once per method and are discarded
   (throw-away sessions, so no method state is learned from them);
2. interleaving: ``for prompt: for method:`` so that a slow phase of the machine
   hits every method alike;
3. one torch thread setting for all methods (recorded);
4. one :class:`~selfspec.Session` per method for the whole run, so what a
   method learns (Draft & Verify's gamma) carries over between prompts, as in
   the papers;
5. the time of a record is the wall time of the whole call (tokenisation
   included) for ours and the peers alike; or, with ``simulated`` (CLI
   ``--simulated``), the time a given cost profile says the call's passes take
   (:func:`selfspec.core.clock.simulated`): every decision reads those costs and
   a virtual clock, so a run gives the same figures on every machine and in every
   repeat, and what a method does on another machine's costs can be replayed
   here (ours only; a peer runs outside our engine and is refused).

Every output is compared with vanilla's on the same prompt: greedy decoding
must be token-identical, or the method is lossy.  So must coupled sampling
(the default scheme under ``temperature`` > 0): prompt i is sampled with seed
``seed + i`` by every method, and with one seed every method emits vanilla
sampling's tokens.  Under the rejection scheme (method option
``sampling_scheme=rejection``, e.g. ``swift:sampling_scheme=rejection@swift-rs``)
outputs legitimately differ draw by draw, so the comparison is not made
(exactness there is a statistical property, tested in ``tests/test_sampling.py``).  A method that raises is
recorded with its error and the run goes on (a peer that fails once is
skipped for the remaining prompts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..api import Session
from ..core import clock, quant
from ..core.sampling import GREEDY, SamplingParams
from ..datasets import PromptItem
from ..decoding import grammar as grammars
from ..decoding.loop import check_lengths, prefill_cosine
from ..errors import InvalidInputError
from ..model.models import Model
from .peers import check_peer, run_peer
from .spec import PEERS, SCHEME_OPTION, BenchMethod, baseline_of, parse_methods, with_baseline
from .system import PeakMemory


@dataclass(frozen=True)
class PromptRecord:
    """One method on one prompt."""

    index: int  # position of the prompt in the run (stream order)
    prompt_id: str
    task: str
    method: str  # label
    method_name: str
    token_ids: tuple[int, ...]
    text: str
    stats: dict[str, Any] | None  # GenerationStats.to_dict(); None on error
    time: float  # wall seconds of the whole call
    peak_rss_mb: float | None
    rss_delta_mb: float | None
    identical_to_vanilla: bool | None  # None when either run failed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["token_ids"] = list(self.token_ids)
        return d


@dataclass(frozen=True)
class BenchResult:
    model: str
    num_layers: int
    methods: tuple[BenchMethod, ...]
    prompts: tuple[PromptItem, ...]
    records: tuple[PromptRecord, ...]
    max_new_tokens: int
    warmup: int
    torch_threads: int
    memory_probe: str
    sampling: SamplingParams = GREEDY
    # per prompt, the prefill's per-sublayer cosine when no method measured it (None otherwise)
    cosine: tuple[dict[str, list[float]], ...] | None = None
    clock: str = "real"  # what the records' times are: "real" (wall time) or the simulated clock's source

    @property
    def baseline(self) -> BenchMethod:
        return baseline_of(self.methods)

    def by_method(self, label: str) -> list[PromptRecord]:
        return [r for r in self.records if r.method == label]


ProgressFn = Callable[[int, int, str], None]


def _comparable(ours: SamplingParams, vanilla: SamplingParams) -> bool:
    """Whether a method's output must equal vanilla's token for token: greedy, or both coupled sampling."""
    return ours.greedy or (ours.coupled and vanilla.coupled)


class _Runner:
    def __init__(self, model: Model, methods: Sequence[BenchMethod], max_new_tokens: int,
                 sampling: SamplingParams, timer: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.model = model
        self.timer = timer  # the records' clock: wall time, or the simulated clock's (clock.now)
        self.sampling = sampling
        self.methods = methods
        self.max_new_tokens = max_new_tokens
        self.memory = PeakMemory()
        self.vocab = getattr(getattr(model, "engine", None), "draft_vocab", None)  # engine-wide, grows as it reads
        self.learned: dict[str, list[int]] = {}  # per method: the ids its own generations added to the vocabulary
        self.learned_before: list[int] | None = None  # ... and those added before the first generation

    def session(self, method: BenchMethod) -> Session:
        options = {k: v for k, v in method.options.items() if k != SCHEME_OPTION}
        # every prompt prefilled whole, as in earlier rounds' figures and memory probes (`--turns 2` measures reuse)
        return Session(self.model, method.name, prefix_cache=0, **options)

    def sampling_for(self, index: int, method: BenchMethod | None = None) -> SamplingParams:
        s = self.sampling
        if s.greedy:
            return s
        scheme = method.options.get(SCHEME_OPTION, s.scheme) if method is not None else s.scheme
        return dataclasses.replace(s, seed=None if s.seed is None else s.seed + max(index, 0), scheme=scheme)

    def call(self, method: BenchMethod, session: Session | None, prompt: Any, index: int,
             grammar: str | None = None):  # fmt: skip
        """(token ids, text, stats dict) of one generation (``grammar``: the prompt's structure, if any)."""
        sampling = self.sampling_for(index, method)
        if grammar is not None:
            if method.is_peer:
                raise InvalidInputError(f"peer '{method.name}' takes no structure for its answer")
            sampling = dataclasses.replace(sampling, grammar=grammar)
        if method.is_peer:
            ids = self.model.encode(prompt)
            check_lengths(self.model, len(ids), self.max_new_tokens)
            tokens, stats = run_peer(self.model, method, ids, self.max_new_tokens, sampling)
            return tuple(tokens), self.model.decode(tokens), stats.to_dict()
        assert session is not None
        result = session.generate(prompt, max_new_tokens=self.max_new_tokens, **sampling.as_kwargs())
        return tuple(result.token_ids), result.text, result.stats.to_dict()

    def drafts_with_vocabulary(self, method: BenchMethod) -> bool:
        """Whether ``method`` runs on this engine's draft vocabulary (ours, on a model that has one)."""
        return self.vocab is not None and not method.is_peer

    def own_vocabulary(self, method: BenchMethod) -> None:
        """Before a method's generation: the draft vocabulary as its own generations grew it.  It is one per
        engine and takes in every token the model reads, so after vanilla's answer to a prompt it would hold that
        answer's rare words, and a self-draft run next on the same prompt would never miss one (Qwen: 5% of
        answer tokens lie outside the base ids, a miss ends the chain's accepted part)."""
        if not self.drafts_with_vocabulary(method):
            return
        if self.learned_before is None:
            self.learned_before = self.vocab.learned()
        self.vocab.restore(self.learned.get(method.label, self.learned_before))

    def record(self, index: int, item: PromptItem, method: BenchMethod, session: Session | None) -> PromptRecord:
        self.own_vocabulary(method)
        gc.collect()  # not inside the timed region: a collection there would bill one method at random
        self.memory.start()
        t0 = self.timer()
        try:
            grammar = None if item.structure is None else grammars.of(*item.structure)
            tokens, text, stats = self.call(method, session, item.prompt, index, grammar)
            error = None
        except Exception as exc:  # a failing method must not end the whole run
            tokens, text, stats = (), "", None
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        elapsed = self.timer() - t0
        mem = self.memory.stop()
        if self.drafts_with_vocabulary(method):
            self.learned[method.label] = self.vocab.learned()
        return PromptRecord(
            index=index,
            prompt_id=item.id,
            task=item.task,
            method=method.label,
            method_name=method.name,
            token_ids=tokens,
            text=text,
            stats=stats,
            time=elapsed,
            peak_rss_mb=mem.peak_mb,
            rss_delta_mb=mem.delta_mb,
            identical_to_vanilla=None,
            error=error,
        )

    def warm_up(self, prompts: Sequence[PromptItem], bar: Any) -> None:
        """Every method on each of ``prompts``, a fresh session each time; the records are discarded."""
        for i, item in enumerate(prompts):
            for m in self.methods:
                if bar is not None:
                    bar.set_description(f"warm-up {i + 1}/{len(prompts)} {m.label}")
                self.record(-1, item, m, None if m.is_peer else self.session(m))

    def timed_run(self, prompts: Sequence[PromptItem], bar: Any, on_progress: ProgressFn | None) -> list[PromptRecord]:
        """The timed run: the same sessions throughout, methods interleaved prompt by prompt.

        A peer that fails once is skipped for the remaining prompts.
        """
        sessions = {m.label: self.session(m) for m in self.methods if not m.is_peer}
        # transformers' modules compute norms and attention with other last bits than the fused stack; int8
        # activations turn those into rounding flips and logits a few percent apart, so the peers' tokens are not
        # compared then (test_int8_kernels.py; docs/engine.md "int8 activations")
        int8_model = getattr(self.model, "quantization", "none") != "none" and quant.int8_activations()
        failed_peers: dict[str, str] = {}
        records: list[PromptRecord] = []
        total = len(prompts) * len(self.methods)
        for i, item in enumerate(prompts):
            row: list[PromptRecord] = []
            for m in self.methods:
                if bar is not None:
                    bar.set_description(f"prompt {i + 1}/{len(prompts)} {m.label}")
                if m.label in failed_peers:
                    rec = _skipped(i, item, m, failed_peers[m.label])
                else:
                    rec = self.record(i, item, m, sessions.get(m.label))
                    if rec.error is not None and m.is_peer:
                        failed_peers[m.label] = rec.error
                row.append(rec)
                if bar is not None:
                    bar.update(1)
                if on_progress is not None:
                    on_progress(len(records) + len(row), total, m.label)
            records.extend(self.judged(i, row, int8_model))
        return records

    def judged(self, index: int, row: list[PromptRecord], int8_model: bool) -> list[PromptRecord]:
        """One prompt's records with ``identical_to_vanilla`` set where the output must equal the baseline's."""
        baseline = baseline_of(self.methods)
        base = next(r for r in row if r.method == baseline.label)
        out = []
        for m, rec in zip(self.methods, row, strict=True):
            judged = rec.ok and base.ok and _comparable(self.sampling_for(index, m), self.sampling_for(index, baseline))
            if m.is_peer:  # a peer samples with its own generator: judged on greedy output only
                judged = judged and PEERS[m.name].judged and self.sampling.greedy and not int8_model
            same = rec.token_ids == base.token_ids if judged else None
            out.append(dataclasses.replace(rec, identical_to_vanilla=same))
        return out


def run_benchmark(
    model: Model,
    prompts: Sequence[PromptItem],
    methods: str | Sequence[BenchMethod | str],
    max_new_tokens: int,
    *,
    warmup: int = 1,
    threads: int | None = None,
    progress: bool = False,
    measure_cosine: bool = True,
    on_progress: ProgressFn | None = None,
    sampling: SamplingParams = GREEDY,
    simulated: Any = None,
    simulated_name: str | None = None,
) -> BenchResult:
    """Run ``methods`` (a ``--methods`` string or a list) on ``prompts``; vanilla is added if absent.

    ``threads`` sets ``torch.set_num_threads`` for the whole run (None keeps
    torch's default; either way it is recorded).  ``progress`` shows a tqdm
    bar on stderr; ``on_progress(done, total, label)`` is called after every
    generation.  ``sampling`` (default greedy) applies to every method and
    peer; under sampling no output is compared with vanilla's.  With ``measure_cosine`` and no method that measured the
    per-sublayer cosine itself, one untimed prefill per prompt measures it.  ``simulated``: a
    :class:`~selfspec.cost.costs.CostProfile` (or a function making one from the model, as
    :func:`~selfspec.cost.costs.read_bound_profile`) whose costs time the run and every decision in it, instead of
    this machine's clock (``simulated_name``: what the report calls it).
    """
    specs = _runnable_methods(model, prompts, methods, max_new_tokens)
    if simulated is not None:
        _check_simulated(model, specs, simulated)
    if threads is not None:
        torch.set_num_threads(threads)
    runner = _Runner(model, specs, max_new_tokens, sampling, time.perf_counter if simulated is None else clock.now)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts) * len(specs), file=sys.stderr, unit="gen", dynamic_ncols=True, leave=True)
    with clock.simulated(simulated) if simulated is not None else contextlib.nullcontext():
        # 1. warm-up, discarded
        runner.warm_up(prompts[: max(0, warmup)], bar)
        # 2. the timed run, each prompt's outputs compared with the baseline's
        records = runner.timed_run(prompts, bar, on_progress)
    if bar is not None:
        bar.close()
    # 3. the per-sublayer cosine, untimed, when no method measured it
    cosine = None
    if measure_cosine and not any(r.stats and r.stats.get("cosine") for r in records):
        cosine = tuple(_prompt_cosine(model, item.prompt) for item in prompts)
    return BenchResult(
        model=model.name,
        num_layers=model.num_layers,
        methods=tuple(specs),
        prompts=tuple(prompts),
        records=tuple(records),
        max_new_tokens=max_new_tokens,
        warmup=warmup,
        torch_threads=torch.get_num_threads(),
        memory_probe=runner.memory.method,
        sampling=sampling,
        cosine=cosine,
        clock="real" if simulated is None else f"simulated: {simulated_name or 'a given cost profile'}",
    )


SIMULATED_HERE, SIMULATED_READ_BOUND = "here", "read-bound"  # --simulated's named sources (else a profile file)


def simulated_costs(model: Model, source: str) -> tuple[Any, str]:
    """The cost profile a ``--simulated`` run takes, and how the report names it: ``here``, this machine's
    (measured once and cached, as every method prices with); ``read-bound``, the idealised machine of
    :func:`~selfspec.cost.costs.read_bound_profile` (the same on every CPU: each pass costs its weights' bytes);
    else a profile file, as a simulated run writes one beside its report (``profile.json``)."""
    import json
    from pathlib import Path

    from ..cost import costs

    if source == SIMULATED_HERE:
        return costs.cost_profile(model), "the costs measured on this machine"
    if source == SIMULATED_READ_BOUND:
        return costs.read_bound_profile(model), "a pass costs its weights' read (read-bound profile)"
    path = Path(source)
    try:
        profile = costs.CostProfile.from_dict(json.loads(path.read_text()))
    except OSError as exc:
        raise InvalidInputError(f"--simulated {source}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidInputError(f"--simulated {source}: not a cost profile of this version (write one with "
                                f"--simulated {SIMULATED_HERE}, which saves profile.json beside the report)") from None
    fitted = costs.fitted(profile, model)
    if fitted is None:
        raise InvalidInputError(f"--simulated {source}: the profile has no costs for a draft precision "
                                f"{model.name} offers ({', '.join(costs.draft_precisions(model))})")  # fmt: skip
    return fitted, f"the costs in {path.name}"


def _check_simulated(model: Model, specs: Sequence[BenchMethod], profile: Any) -> None:
    """A simulated run's methods and profile: ours only (a peer's passes are not our engine's, nothing prices them),
    and a profile of the model's depth."""
    peers = [m.label for m in specs if m.is_peer]
    if peers:
        raise InvalidInputError(f"a simulated clock prices our engine's passes only; leave out the peers "
                                f"({', '.join(peers)})")  # fmt: skip
    layers = getattr(profile, "num_layers", None)
    if layers is not None and layers != model.num_layers:
        raise InvalidInputError(f"the cost profile is of a model with {layers} layers; {model.name} has "
                                f"{model.num_layers}")  # fmt: skip


def _runnable_methods(model: Model, prompts: Sequence[PromptItem], methods: str | Sequence[BenchMethod | str],
                      max_new_tokens: int) -> list[BenchMethod]:  # fmt: skip
    """The methods checked, vanilla added; a peer that cannot run this model is left out with a note on stderr."""
    specs = parse_methods(methods) if isinstance(methods, str) else with_baseline(methods)
    if not prompts:
        raise InvalidInputError("no prompts to benchmark")
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    skipped = {m.label: why for m in specs if m.is_peer and (why := check_peer(model, m))}
    for label, why in skipped.items():
        print(f"selfspec bench: {label} skipped: {why}", file=sys.stderr)
    return [m for m in specs if m.label not in skipped]


def _skipped(index: int, item: PromptItem, method: BenchMethod, error: str) -> PromptRecord:
    return PromptRecord(
        index,
        item.id,
        item.task,
        method.label,
        method.name,
        (),
        "",
        None,
        0.0,
        None,
        None,
        None,
        f"skipped after an earlier failure ({error})",
    )


def _prompt_cosine(model: Model, prompt: Any) -> dict[str, list[float]] | None:
    """Per-sublayer cosine of one full-model prefill (untimed analysis; None if the prompt is unusable)."""
    try:
        cos = prefill_cosine(model, model.encode(prompt))
    except Exception:
        return None
    return {"attention": list(cos.attention), "mlp": list(cos.mlp)}
