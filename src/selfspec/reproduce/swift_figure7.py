"""``selfspec reproduce swift-figure7``: SWIFT against Self-SD on a domain-shifting stream (SWIFT Figure 7).

    selfspec reproduce swift-figure7                   # 5 tasks x 4 Spec-Bench prompts x 128 tokens, ~6 min
    selfspec reproduce swift-figure7 --limit 1 --max-new-tokens 32

The stream is Spec-Bench's first turns, task after task in the paper's order:
summarization (CNN/DM, as the paper's), math_reasoning (GSM8K, as the paper's),
mt_bench (instruction following; the paper used Alpaca), translation (WMT14
DE-EN, as the paper's) and qa (Natural Questions, as the paper's).  One SWIFT
session learns along the whole stream; Self-SD drafts with one static skip set:
the one `selfspec search` found on XSum for the model (``skipsets/MODEL-*.json``),
or, for a model without one, the best set of a SWIFT session run over the
stream's first task (written to ``--out`` as ``selfsd-skipset.json``).  Both draft
in the model's own precision.  Acceptance and speedup are recorded per prompt
and per task and plotted as the figure does (speedup bars, acceptance lines).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..api import Session
from ..bench.runner import BenchResult
from ..bench.spec import BenchMethod
from ..core.skipset import SkipSet
from ..datasets import PromptItem
from ..model.models import Model
from .common import (
    ReproduceOptions,
    Reproduction,
    Table,
    bench,
    check_ran,
    ff,
    fx,
    load_target_prompts,
    method_numbers,
    plt,
    setup_info,
    swift_window_note,
)

NAME = "swift-figure7"
DATASET = "spec-bench"
SOURCE = ("Xia et al., 'SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration' (ICLR 2025), "
          "Section 5.2, Figure 7: a stream of 500 instances each of CNN/DM, GSM8K, Alpaca, WMT14 DE-EN and "
          "Natural Questions (model not named for this figure; the paper's analyses use LLaMA-2-13B)")  # fmt: skip

# (Spec-Bench category, the paper's task, its dataset, Self-SD and SWIFT speedup labels, acceptance read off)
TASKS = (
    ("summarization", "Summarization", "CNN/DM", "1.28x", "1.56x", "≈0.90", "≈0.98"),
    ("math_reasoning", "Reasoning", "GSM8K", "1.10x", "1.45x", "≈0.70", "≈0.95"),
    ("mt_bench", "Instruction", "Alpaca", "1.08x", "1.47x", "≈0.65", "≈0.98"),
    ("translation", "Translation", "WMT14 DE-EN", "1.05x", "1.27x", "≈0.60", "≈0.90"),
    ("qa", "QA", "Natural Questions", "1.02x", "1.35x", "≈0.65", "≈0.95"),
)
PAPER = Table("Paper, Figure 7 (bar labels; acceptance read off the chart)",
              ("task", "dataset", "Self-SD speedup", "SWIFT speedup", "Self-SD acceptance", "SWIFT acceptance"),
              tuple(row[1:] for row in TASKS))  # fmt: skip
PAPER_TEXT = ("Section 5.2: Self-SD's average token acceptance rate drops from 92% to 68% and its speedup from "
              "1.33× to an average of 1.05× under domain shifts; SWIFT keeps an average token acceptance rate of "
              "96% and a consistent 1.3×~1.6× speedup.")  # fmt: skip
SWIFT, SELFSD = "swift", "self-sd"


def find_skip_set(model: Model) -> Path | None:
    """A skip set searched for this model (``skipsets/<model>-<dataset>.json``, XSum first), or None."""
    roots = [Path.cwd() / "skipsets", Path(__file__).resolve().parents[3] / "skipsets"]
    for root in roots:
        found = sorted(root.glob(f"{model.name}-*.json"), key=lambda p: (not p.stem.endswith("-xsum"), p.name))
        if found:
            return found[0]
    return None


def first_task_set(model: Model, prompts: Sequence[PromptItem], opts: ReproduceOptions) -> Path:
    """SWIFT's best set after the stream's first task (untimed), saved as Self-SD's static set."""
    session = Session(model, "swift", draft_dtype="same")
    first = [p for p in prompts if p.task == prompts[0].task]
    for item in first:
        session.generate(item.prompt, max_new_tokens=opts.max_new_tokens)
    best: SkipSet = session.skip_policy.state.best_set
    path = opts.out_dir / "selfsd-skipset.json"
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    SkipSet.of(best.attention, best.mlp, source=f"SWIFT's best set after the first task ({prompts[0].task})").save(
        path)
    return path


def per_prompt(result: BenchResult) -> list[dict[str, Any]]:
    """Acceptance and speedup over vanilla of each method on each prompt of the stream."""
    base = {r.index: r for r in result.by_method(result.baseline.label)}
    rows = []
    for item_index, item in enumerate(result.prompts):
        row: dict[str, Any] = {"index": item_index, "id": item.id, "task": item.task}
        for label in (SWIFT, SELFSD):
            rec = next(r for r in result.by_method(label) if r.index == item_index)
            b = base.get(item_index)
            ok = rec.ok and rec.stats and b is not None and b.ok and rec.time > 0
            row[label] = {"acceptance": rec.stats["acceptance_rate"] if ok and rec.stats["drafted"] else None,
                          "speedup": b.time / rec.time if ok else None}  # fmt: skip
        rows.append(row)
    return rows


def run(model: Model, opts: ReproduceOptions, prompts: Sequence[PromptItem] | None = None) -> Reproduction:
    categories = [t[0] for t in TASKS]
    prompts = list(prompts) if prompts is not None else load_target_prompts(model, DATASET, opts.limit, categories)
    skip_file = find_skip_set(model)
    source = f"searched offline ({skip_file.name})" if skip_file else "SWIFT's best set after the first task"
    skip_path = skip_file or first_task_set(model, prompts, opts)
    methods = [BenchMethod("swift", {"draft_dtype": "same"}, SWIFT),
               BenchMethod("selfsd", {"skip_set": str(skip_path), "draft_dtype": "same"}, SELFSD)]  # fmt: skip
    result, summary = bench(model, prompts, methods, opts, stream=True)
    check_ran(summary)
    tasks = list(dict.fromkeys(p.task for p in prompts))
    by_task = summary.by_task or {tasks[0]: summary.methods}
    names = {t[0]: t[1] for t in TASKS}
    rows, task_data = [], {}
    for task in tasks:
        row = {m.label: m for m in by_task[task]}
        sw, sd = row[SWIFT], row[SELFSD]
        task_data[task] = {SWIFT: method_numbers(sw), SELFSD: method_numbers(sd), "prompts": sw.prompts}
        rows.append((names.get(task, task), task, fx(sd.speedup), fx(sw.speedup), ff(sd.acceptance_rate),
                     ff(sw.acceptance_rate), str(sw.prompts)))  # fmt: skip
    ours = Table(f"Ours: {model.name}, Spec-Bench stream, speedup over our vanilla",
                 ("task", "Spec-Bench category", "Self-SD speedup", "SWIFT speedup", "Self-SD acceptance",
                  "SWIFT acceptance", "prompts"), tuple(rows))  # fmt: skip
    overall = {m.label: method_numbers(m) for m in summary.methods}
    stream = per_prompt(result)
    data = {"tasks": task_data, "overall": overall, "per_prompt": stream, "selfsd_skip_set": str(skip_path),
            "selfsd_skip_set_source": source, "paper_text": PAPER_TEXT}  # fmt: skip
    notes = (PAPER_TEXT, f"Self-SD's static skip set: {source} ({skip_path}).",
             "The paper's instruction task is Alpaca, which has no offline source here: Spec-Bench's mt_bench "
             "stands in.",
             "SWIFT runs with our defaults (objective speed, adaptive ratio, drafting by measured costs), drafts in "
             "the model's own precision; one session carries its state along the whole stream.",
             *swift_window_note(opts))  # fmt: skip
    return Reproduction(NAME, "SWIFT vs Self-SD on a domain-shifting stream (Figure 7)", SOURCE, PAPER, ours,
                        setup_info(model, opts, f"{DATASET} ({', '.join(tasks)})", result), data, notes,
                        plot=lambda path: plot_stream(rows, stream, tasks, path), bench=result)  # fmt: skip


def plot_stream(rows: Sequence[tuple[str, ...]], stream: Sequence[dict[str, Any]], tasks: Sequence[str],
                path: Path) -> None:  # fmt: skip
    """Left: Figure 7's layout (speedup bars per task, acceptance lines); right: per prompt along the stream."""
    pyplot = plt()
    fig, (ax, ax2) = pyplot.subplots(1, 2, figsize=(13, 4.8))
    _task_panel(ax, stream, tasks, [r[0] for r in rows])
    _stream_panel(ax2, stream)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def _mean(values: list[float | None]) -> float | None:
    good = [v for v in values if v is not None]
    return sum(good) / len(good) if good else None


def _task_panel(ax, stream: Sequence[dict[str, Any]], tasks: Sequence[str], names: Sequence[str]) -> None:
    xs = range(len(tasks))
    width = 0.27
    colors = {"vanilla": "#ff7f0e", SELFSD: "#17becf", SWIFT: "#1f77b4"}
    speed = {label: [_mean([p[label]["speedup"] for p in stream if p["task"] == t]) for t in tasks]
             for label in (SELFSD, SWIFT)}  # fmt: skip
    for k, (label, values) in enumerate((("vanilla", [1.0] * len(tasks)), (SELFSD, speed[SELFSD]),
                                         (SWIFT, speed[SWIFT]))):  # fmt: skip
        heights = [v or 0.0 for v in values]
        bars = ax.bar([x + (k - 1) * width for x in xs], heights, width, color=colors[label], label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}x" if v else "–" for v in values], fontsize=7)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("speedup (mean per prompt)")
    ax.axhline(1.0, color="grey", lw=0.6)
    right = ax.twinx()
    for label, color in ((SWIFT, "#2ca02c"), (SELFSD, "#7f7f7f")):
        acc = [_mean([p[label]["acceptance"] for p in stream if p["task"] == t]) for t in tasks]
        right.plot(list(xs), [a if a is not None else float("nan") for a in acc], "o--", color=color,
                   label=f"{label} acceptance")  # fmt: skip
    right.set_ylim(0, 1.05)
    right.set_ylabel("token acceptance")
    ax.legend(loc="lower left", fontsize=7, framealpha=0.9)
    right.legend(loc="lower right", fontsize=7, framealpha=0.9)
    ax.set_title("per task (as SWIFT Figure 7)", fontsize=10)


def _stream_panel(ax, stream: Sequence[dict[str, Any]]) -> None:
    xs = [p["index"] for p in stream]
    for label, color in ((SWIFT, "#1f77b4"), (SELFSD, "#17becf")):
        acc = [p[label]["acceptance"] for p in stream]
        ax.plot(xs, [a if a is not None else float("nan") for a in acc], "o-", color=color, label=f"{label} acceptance")
        sp = [p[label]["speedup"] for p in stream]
        ax.plot(xs, [s if s is not None else float("nan") for s in sp], "s:", color=color, alpha=0.7,
                label=f"{label} speedup")  # fmt: skip
    for i, p in enumerate(stream):
        if i == 0 or p["task"] != stream[i - 1]["task"]:
            ax.axvline(i - 0.5, color="grey", lw=0.6)
            ax.text(i - 0.4, 0.02, p["task"], fontsize=7, rotation=90, va="bottom")
    ax.axhline(1.0, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("prompt in the stream")
    ax.set_ylabel("acceptance / speedup")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("per prompt along the stream", fontsize=10)
