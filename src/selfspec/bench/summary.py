"""Aggregate a :class:`~selfspec.bench.runner.BenchResult` into per-method summary rows.

Definitions (DESIGN.md section 3), all over the prompts where both the method
and its reference succeeded:

* speedup = sum of vanilla's wall times / sum of the method's (also the mean
  of the per-prompt ratios); the same against ``hf`` when it ran;
* M = total new tokens / total full-model forwards (prefill included), i.e.
  the per-prompt M weighted by tokens; alpha = total accepted / total drafted;
* c = draft cost / full cost, measured as (draft time / draft forwards) /
  (verify time / verify forwards), verify forwards = forwards - 1 per prompt;
* expected speedup, SWIFT eq. 6: E = M*alpha / ((M-1)*c + alpha).  Eq. 6
  prices a verification like one decoding step of vanilla.  On a CPU a
  verification of k+1 tokens costs more (DESIGN.md section 4), so we also
  report v = verify forward time / vanilla's decode-step time and E / v, the
  eq. 6 estimate with verification priced as measured (prefill and loop
  overheads still left out);
* time shares: prefill, draft, verify (vanilla: its decode steps), optimise
  (SWIFT's optimisation steps) and the rest, as fractions of the decoder's own total time;
* lossless: every output token-identical to vanilla's on the same prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .runner import BenchResult, PromptRecord
from .spec import BenchMethod, hf_of


@dataclass(frozen=True)
class MethodSummary:
    label: str
    name: str
    options: dict[str, Any]
    peer: bool
    task: str | None  # None: all prompts
    prompts: int  # successful prompts
    errors: int
    error: str | None  # the first error message
    new_tokens: int
    time: float  # wall seconds, summed
    tokens_per_second: float | None
    speedup: float | None  # vs vanilla, ratio of sums
    speedup_mean: float | None  # vs vanilla, mean of per-prompt ratios
    speedup_vs_hf: float | None
    speedup_vs_hf_mean: float | None
    M: float | None
    acceptance_rate: float | None
    drafted: int
    accepted: int
    c: float | None
    expected_speedup: float | None  # SWIFT eq. 6
    verify_cost: float | None  # v: verify forward / vanilla decode step
    expected_speedup_verify_adjusted: float | None  # E / v
    time_shares: dict[str, float] | None  # prefill, draft, verify, optimise, other
    peak_rss_mb: float | None
    rss_delta_mb: float | None
    memory_ratio: float | None  # peak RSS / vanilla's peak RSS
    lossless: bool | None
    lossy_prompts: tuple[int, ...] = ()
    skip_frequency: dict[str, list[float]] | None = field(default=None, repr=False)  # per layer, over prompts
    mean_skipped: float | None = None  # sublayers skipped per prompt, on average
    sources: dict[str, dict[str, float]] | None = None  # hybrid drafting: rounds, drafted, accepted, ms per source
    prefill_tokens_per_second: float | None = None  # prompt tokens / prefill seconds (llamacpp: its prompt_ms)
    decode_tokens_per_second: float | None = None  # new tokens / the seconds after prefill (llamacpp: predicted_ms)

    @property
    def status(self) -> str:
        if self.prompts == 0:
            return "ERROR"
        if self.lossless is False:
            return "LOSSY"
        return "ok" if self.lossless else "n/a"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lossy_prompts"] = list(self.lossy_prompts)
        d["status"] = self.status
        return d


@dataclass(frozen=True)
class BenchSummary:
    config: dict[str, Any]
    methods: tuple[MethodSummary, ...]
    by_task: dict[str, tuple[MethodSummary, ...]]  # filled when the prompts span several tasks
    lossy: tuple[str, ...]
    failed: tuple[str, ...]  # methods with at least one error
    cosine: dict[str, Any] | None  # mean per-sublayer cosine, and where it came from
    stream: dict[str, Any] | None  # acceptance over time (stream mode)

    def method(self, label: str) -> MethodSummary:
        return next(m for m in self.methods if m.label == label)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "methods": [m.to_dict() for m in self.methods],
            "by_task": {t: [m.to_dict() for m in rows] for t, rows in self.by_task.items()},
            "lossless": not self.lossy,
            "lossy": list(self.lossy),
            "failed": list(self.failed),
            "cosine": self.cosine,
            "stream": self.stream,
        }


# -- helpers -----------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _speedups(recs: Sequence[PromptRecord], ref: Sequence[PromptRecord]) -> tuple[float | None, float | None]:
    """(ratio of summed times, mean of per-prompt ratios) of ``ref`` over ``recs``, on common prompts."""
    ref_time = {r.index: r.time for r in ref if r.ok}
    pairs = [(ref_time[r.index], r.time) for r in recs if r.ok and r.index in ref_time and r.time > 0]
    if not pairs:
        return None, None
    total = _ratio(sum(p[0] for p in pairs), sum(p[1] for p in pairs))
    return total, sum(p[0] / p[1] for p in pairs) / len(pairs)


def _sum(recs: Sequence[PromptRecord], key: str) -> float:
    return sum(float(r.stats[key]) for r in recs if r.stats and r.stats.get(key) is not None)


def _per_forward(recs: Sequence[PromptRecord], time_key: str, forwards: float) -> float | None:
    return _ratio(_sum(recs, time_key), forwards)


def _verify_forwards(recs: Sequence[PromptRecord]) -> float:
    return sum(max(0, int(r.stats["forwards"]) - 1) for r in recs if r.stats)


def _sources(recs: Sequence[PromptRecord]) -> dict[str, dict[str, float]] | None:
    """A hybrid's per-source statistics (``GenerationStats.sources``: rounds, drafted, accepted tokens, ms of its
    rounds) summed over the prompts; None when no prompt reports any."""
    out: dict[str, dict[str, float]] = {}
    for r in recs:
        for name, st in (r.stats.get("sources") or {}).items():
            acc = out.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0, "ms": 0.0})
            for key in acc:
                acc[key] += st.get(key, 0)
    return out or None


def _skip_frequency(
    recs: Sequence[PromptRecord], num_layers: int
) -> tuple[dict[str, list[float]] | None, float | None]:
    sets = [r.stats["skip_set"] for r in recs if r.stats and r.stats.get("skip_set") is not None]
    if not sets:
        return None, None
    freq = {kind: [0.0] * num_layers for kind in ("attention", "mlp")}
    for s in sets:
        for kind in freq:
            for layer in s.get(kind, []):
                if 0 <= int(layer) < num_layers:
                    freq[kind][int(layer)] += 1 / len(sets)
    mean_skipped = sum(len(s.get("attention", [])) + len(s.get("mlp", [])) for s in sets) / len(sets)
    return freq, mean_skipped


def expected_speedup(M: float | None, alpha: float | None, c: float | None) -> float | None:
    """SWIFT eq. 6: E = M*alpha / ((M-1)*c + alpha)."""
    if M is None or alpha is None or c is None:
        return None
    denom = (M - 1) * c + alpha
    return M * alpha / denom if denom > 0 else None


def summarize_method(
    result: BenchResult,
    method: BenchMethod,
    records: Sequence[PromptRecord],
    task: str | None = None,
) -> MethodSummary:
    """One summary row; ``records`` is the subset of the run to summarise (all, or one task)."""
    mine = [r for r in records if r.method == method.label]
    ok = [r for r in mine if r.ok and r.stats]
    errs = [r for r in mine if not r.ok]
    base_recs = [r for r in records if r.method == result.baseline.label]
    base_ok = [r for r in base_recs if r.ok and r.stats]
    hf = hf_of(result.methods)
    hf_recs = [r for r in records if hf is not None and r.method == hf.label]

    # 1. speed: tokens per second and the speedups over vanilla and over transformers' generate()
    new_tokens = int(_sum(ok, "new_tokens"))
    wall = sum(r.time for r in ok)
    speedup, speedup_mean = _speedups(ok, base_recs)
    vs_hf, vs_hf_mean = _speedups(ok, hf_recs) if hf is not None else (None, None)
    # 2. lossless: every output compared with vanilla's equal to it (None: none could be compared)
    compared = [r for r in ok if r.identical_to_vanilla is not None]
    lossy = tuple(r.index for r in compared if not r.identical_to_vanilla)
    # 3. acceptance and cost (_acceptance_and_cost), time shares, memory, skipped sublayers, draft sources
    freq, mean_skipped = _skip_frequency(ok, result.num_layers)
    return MethodSummary(
        label=method.label,
        name=method.name,
        options=dict(method.options),
        peer=method.is_peer,
        task=task,
        prompts=len(ok),
        errors=len(errs),
        error=errs[0].error if errs else None,
        new_tokens=new_tokens,
        time=wall,
        tokens_per_second=_ratio(new_tokens, wall),
        speedup=speedup,
        speedup_mean=speedup_mean,
        speedup_vs_hf=vs_hf,
        speedup_vs_hf_mean=vs_hf_mean,
        **_acceptance_and_cost(ok, base_ok, new_tokens),
        time_shares=_time_shares(ok),
        **_memory(ok, base_ok),
        lossless=(not lossy) if compared else None,
        lossy_prompts=lossy,
        skip_frequency=freq,
        mean_skipped=mean_skipped,
        sources=_sources(ok),
        **_phase_rates(ok),
    )


def _phase_rates(ok: Sequence[PromptRecord]) -> dict[str, float | None]:
    """Prefill and decoding rates apart: prompt tokens per prefill second, new tokens per second after it
    (peers that time no prefill of their own, such as transformers' generate, get None)."""
    prefill = _sum(ok, "prefill_time")
    decode = _sum(ok, "total_time") - prefill
    return {
        "prefill_tokens_per_second": _ratio(_sum(ok, "prompt_tokens"), prefill) if prefill > 0 else None,
        "decode_tokens_per_second": _ratio(_sum(ok, "new_tokens"), decode) if prefill > 0 and decode > 0 else None,
    }


def _acceptance_and_cost(
    ok: Sequence[PromptRecord], base_ok: Sequence[PromptRecord], new_tokens: int
) -> dict[str, Any]:
    """M, the acceptance rate, the draft/verify cost ratio c and the speedups the cost model expects."""
    forwards = _sum(ok, "forwards")
    drafted, accepted = int(_sum(ok, "drafted")), int(_sum(ok, "accepted"))
    M = _ratio(new_tokens, forwards)
    alpha = _ratio(accepted, drafted)
    # a draft pass's cost: the drafting time of rounds that ran passes (n-gram rounds of a hybrid ran none)
    pass_time = "draft_pass_time" if all(r.stats.get("draft_pass_time") is not None for r in ok) else "draft_time"
    draft_cost = _per_forward(ok, pass_time, _sum(ok, "draft_forwards"))
    verify_cost = _per_forward(ok, "verify_time", _verify_forwards(ok))
    c = draft_cost / verify_cost if draft_cost is not None and verify_cost else None
    if drafted and c is None:
        c = 0.0  # drafting without model forwards (prompt lookup): free drafts
    E = expected_speedup(M, alpha, c) if drafted else None
    vanilla_step = _per_forward(base_ok, "verify_time", _verify_forwards(base_ok))
    v = verify_cost / vanilla_step if verify_cost is not None and vanilla_step else None
    return {
        "M": M,
        "acceptance_rate": alpha,
        "drafted": drafted,
        "accepted": accepted,
        "c": c,
        "expected_speedup": E,
        "verify_cost": v,
        "expected_speedup_verify_adjusted": E / v if E is not None and v else None,
    }


def _time_shares(ok: Sequence[PromptRecord]) -> dict[str, float] | None:
    """The shares of the generation time spent in prefill, drafting, verification, optimisation and the rest."""
    total = _sum(ok, "total_time")
    if total <= 0:
        return None
    parts = {k: _sum(ok, f"{k}_time") / total for k in ("prefill", "draft", "verify", "optimise")}
    parts["other"] = max(0.0, 1.0 - sum(parts.values()))
    return parts


def _memory(ok: Sequence[PromptRecord], base_ok: Sequence[PromptRecord]) -> dict[str, float | None]:
    """Peak resident memory, its growth during a generation, and the peak over vanilla's."""
    peaks = [r.peak_rss_mb for r in ok if r.peak_rss_mb is not None]
    deltas = [r.rss_delta_mb for r in ok if r.rss_delta_mb is not None]
    base_peaks = [r.peak_rss_mb for r in base_ok if r.peak_rss_mb is not None]
    peak = max(peaks) if peaks else None
    memory_ratio = peak / max(base_peaks) if peak is not None and base_peaks and max(base_peaks) > 0 else None
    return {"peak_rss_mb": peak, "rss_delta_mb": max(deltas) if deltas else None, "memory_ratio": memory_ratio}


def _mean_cosine(result: BenchResult) -> dict[str, Any] | None:
    """Mean per-layer cosine over prompts: from the first method that measured it, else the untimed prefills."""
    source, rows = None, []
    for m in result.methods:
        rows = [r.stats["cosine"] for r in result.by_method(m.label) if r.stats and r.stats.get("cosine")]
        if rows:
            source = f"{m.label} prefill"
            break
    if not rows and result.cosine:
        rows = [c for c in result.cosine if c]
        source = "untimed vanilla prefill"
    if not rows:
        return None
    out: dict[str, Any] = {"source": source, "prompts": len(rows)}
    for kind in ("attention", "mlp"):
        cols = list(zip(*(row[kind] for row in rows), strict=True))
        out[kind] = [_nanmean(col) for col in cols]
    return out


def _nanmean(values: Sequence[float]) -> float | None:
    good = [v for v in values if v is not None and not math.isnan(v)]
    return sum(good) / len(good) if good else None


def acceptance_stream(result: BenchResult, window: int) -> dict[str, Any]:
    """Per-prompt and rolling (last ``window`` prompts, token-weighted) acceptance rate per method."""
    tasks: list[str] = []
    boundaries: list[int] = []
    for i, item in enumerate(result.prompts):
        if not tasks or item.task != tasks[-1]:
            tasks.append(item.task)
            boundaries.append(i)
    per_prompt: dict[str, list[float | None]] = {}
    rolling: dict[str, list[float | None]] = {}
    for m in result.methods:
        recs = {r.index: r for r in result.by_method(m.label)}
        counts = [
            (recs[i].stats["accepted"], recs[i].stats["drafted"]) if i in recs and recs[i].stats else (0, 0)
            for i in range(len(result.prompts))
        ]
        if not any(d for _, d in counts):
            continue  # nothing drafted: vanilla, hf
        per_prompt[m.label] = [a / d if d else None for a, d in counts]
        roll = []
        for i in range(len(counts)):
            span = counts[max(0, i - window + 1) : i + 1]
            a, d = sum(x[0] for x in span), sum(x[1] for x in span)
            roll.append(a / d if d else None)
        rolling[m.label] = roll
    return {"tasks": tasks, "boundaries": boundaries, "window": window, "acceptance": per_prompt, "rolling": rolling}


def summarize(
    result: BenchResult, *, meta: dict[str, Any] | None = None, stream: bool = False, window: int = 5
) -> BenchSummary:
    """Summary rows per method (and per task when the prompts span several tasks)."""
    rows = tuple(summarize_method(result, m, result.records) for m in result.methods)
    tasks = list(dict.fromkeys(p.task for p in result.prompts))
    by_task: dict[str, tuple[MethodSummary, ...]] = {}
    if len(tasks) > 1:
        for t in tasks:
            subset = [r for r in result.records if r.task == t]
            by_task[t] = tuple(summarize_method(result, m, subset, task=t) for m in result.methods)
    config = {
        "model": result.model,
        "num_layers": result.num_layers,
        "prompts": len(result.prompts),
        "tasks": tasks,
        "max_new_tokens": result.max_new_tokens,
        "warmup": result.warmup,
        "torch_threads": result.torch_threads,
        "memory_probe": result.memory_probe,
        "methods": [m.to_dict() for m in result.methods],
        "baseline": result.baseline.label,
        "sampling": None if result.sampling.greedy and not result.sampling.penalised else asdict(result.sampling),
        "clock": result.clock,
        **(meta or {}),
    }
    return BenchSummary(
        config=config,
        methods=rows,
        by_task=by_task,
        lossy=tuple(r.label for r in rows if r.lossless is False),
        failed=tuple(r.label for r in rows if r.errors),
        cosine=_mean_cosine(result),
        stream=acceptance_stream(result, max(1, window)) if stream or len(tasks) > 1 else None,
    )
