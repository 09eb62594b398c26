"""What every ``selfspec reproduce`` target shares: options, the result record, running the bench, writing files.

A target quotes its paper's figures (a :class:`Table` of strings, exactly as
printed), measures ours with the benchmark harness (:func:`bench`: the same fair
runner as ``selfspec bench``, method spec strings such as ``asd:variant=cs@cs``),
and returns a :class:`Reproduction`.  :func:`write_reproduction` writes it into
``--out`` as ``report.md`` (both tables side by side, model, dataset, machine and
the exact command), ``result.json`` (every number, strict JSON) and
``results.jsonl`` (the bench's per-prompt records); figure targets add a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..bench.report import dumps
from ..bench.runner import BenchResult, run_benchmark
from ..bench.spec import BenchMethod
from ..bench.summary import BenchSummary, MethodSummary, summarize
from ..bench.system import machine_info
from ..datasets import PromptItem, load_prompts
from ..errors import InvalidInputError
from ..io import atomic_write_text
from ..model.models import Model


@dataclass(frozen=True)
class ReproduceOptions:
    """One run of a target: ``limit`` prompts (per task for streams), ``max_new_tokens`` each."""

    limit: int
    max_new_tokens: int
    out_dir: Path
    command: str  # the exact command line, printed and recorded
    warmup: int = 1
    progress: bool = True
    adapters: tuple[str, ...] = ()  # s3d-figure5: trained adapters to measure instead of training
    train_steps: int = 250  # s3d-figure5: training steps per adapter when it trains its own

    def __post_init__(self) -> None:
        for name, low in (("limit", 1), ("max_new_tokens", 1), ("warmup", 0), ("train_steps", 1)):
            if getattr(self, name) < low:
                raise InvalidInputError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")


@dataclass(frozen=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Reproduction:
    target: str
    title: str
    paper_source: str  # paper, table or figure number, model, dataset, as the paper states them
    paper: Table  # the paper's figures, quoted exactly
    ours: Table
    setup: dict[str, Any]  # model, dataset, limit, tokens, methods, machine, command, date
    data: dict[str, Any]  # every measured number (result.json)
    notes: tuple[str, ...] = ()
    extra: tuple[Table, ...] = ()
    plot: Callable[[Path], None] | None = field(default=None, compare=False, repr=False)
    bench: BenchResult | None = field(default=None, compare=False, repr=False)  # per-prompt records

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "title": self.title, "paper_source": self.paper_source,
                "paper": _table_dict(self.paper), "ours": _table_dict(self.ours),
                "extra": [_table_dict(t) for t in self.extra], "setup": self.setup, "notes": list(self.notes),
                "data": self.data}  # fmt: skip


def _table_dict(t: Table) -> dict[str, Any]:
    return {"title": t.title, "columns": list(t.columns), "rows": [list(r) for r in t.rows]}


# -- running ----------------------------------------------------------------------------------


def load_target_prompts(model: Model, dataset: str, limit: int, categories: Sequence[str] | None = None
                        ) -> list[PromptItem]:  # fmt: skip
    """``limit`` prompts of an offline dataset (per category for Spec-Bench), as chat when the model has one."""
    return load_prompts(dataset, limit=limit, chat=model.has_chat_template,
                        categories=list(categories) if categories else None)  # fmt: skip


def bench(model: Model, prompts: Sequence[PromptItem], methods: Sequence[str | BenchMethod], opts: ReproduceOptions,
          *, stream: bool = False) -> tuple[BenchResult, BenchSummary]:  # fmt: skip
    """The benchmark harness's fair run (warm-up, interleaving, one session per method) and its summary."""
    result = run_benchmark(model, prompts, list(methods), opts.max_new_tokens, warmup=opts.warmup,
                           progress=opts.progress, measure_cosine=False)  # fmt: skip
    return result, summarize(result, stream=stream, window=max(1, opts.limit))


def setup_info(model: Model, opts: ReproduceOptions, dataset: str, result: BenchResult | None,
               **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "model": model.name,
        "num_layers": model.num_layers,
        "dataset": dataset,
        "limit": opts.limit,
        "prompts": None if result is None else len(result.prompts),
        "max_new_tokens": opts.max_new_tokens,
        "warmup": opts.warmup,
        "methods": [] if result is None else [m.label for m in result.methods],
        "specs": {} if result is None else {m.label: m.to_dict() for m in result.methods},
        "machine": machine_info(),
        "command": opts.command,
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        **extra,
    }


def method_numbers(row: MethodSummary) -> dict[str, Any]:
    """The figures a paper reports for a method (speedup, M, acceptance) and the ones we add."""
    return {"label": row.label, "options": row.options, "prompts": row.prompts, "errors": row.errors,
            "error": row.error, "speedup": row.speedup, "M": row.M, "acceptance_rate": row.acceptance_rate,
            "tokens_per_second": row.tokens_per_second, "c": row.c, "mean_skipped": row.mean_skipped,
            "lossless": row.lossless}  # fmt: skip


def swift_window_note(opts: ReproduceOptions) -> tuple[str, ...]:
    """SWIFT scores candidates on a response's first 32 tokens: shorter responses never start its search."""
    if opts.max_new_tokens > 32:
        return ()
    return (f"--max-new-tokens {opts.max_new_tokens} is below SWIFT's context window + 1 (33 tokens): its skip-set "
            "search never starts here, so SWIFT drafts with its starting set throughout.",)


def check_ran(summary: BenchSummary) -> None:
    """Every method must have run at least once; otherwise the comparison is empty and says so."""
    dead = [m.label for m in summary.methods if m.prompts == 0]
    if dead:
        first = next(m for m in summary.methods if m.prompts == 0)
        raise InvalidInputError(f"method(s) {', '.join(dead)} failed on every prompt: {first.error}")


# -- formatting and files ----------------------------------------------------------------------


def fx(v: float | None, digits: int = 2) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{digits}f}x"


def ff(v: float | None, digits: int = 2) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def lossless_text(v: bool | None) -> str:
    return "n/a" if v is None else "yes" if v else "**LOSSY**"


def _md_table(t: Table) -> list[str]:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    lines = [f"**{t.title}**", "", "| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in t.rows]
    return lines + [""]


def markdown(rep: Reproduction, plot_name: str | None = None) -> str:
    s = rep.setup
    m = s["machine"]
    lines = [f"# {rep.title}", "", f"Paper: {rep.paper_source}", ""]
    lines += _md_table(rep.paper) + _md_table(rep.ours)
    for t in rep.extra:
        lines += _md_table(t)
    if plot_name:
        lines += [f"![{rep.target}]({plot_name})", ""]
    lines += [f"Ours: model `{s['model']}` ({s['num_layers']} layers), dataset {s['dataset']}, "
              f"{s['prompts']} prompts (limit {s['limit']}), {s['max_new_tokens']} new tokens, greedy, "
              f"{s['warmup']} warm-up prompt(s) discarded.", "",
              f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}, "
              f"transformers {m['transformers']}, {m['platform']}; {s['date']}.", "",
              f"Command: `{s['command']}`", ""]  # fmt: skip
    if rep.notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in rep.notes] + [""]
    return "\n".join(lines)


def write_reproduction(rep: Reproduction, out_dir: Path) -> dict[str, Path]:
    """report.md, result.json, results.jsonl (per-prompt records) and the figure's PNG, into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report": out_dir / "report.md", "json": out_dir / "result.json"}
    if rep.plot is not None:
        paths["plot"] = out_dir / f"{rep.target}.png"
        rep.plot(paths["plot"])
    if rep.bench is not None:
        paths["records"] = out_dir / "results.jsonl"
        atomic_write_text(paths["records"], "".join(dumps(r.to_dict()) + "\n" for r in rep.bench.records))
    atomic_write_text(paths["json"], dumps(rep.to_dict(), indent=2) + "\n")
    atomic_write_text(paths["report"], markdown(rep, paths["plot"].name if "plot" in paths else None))
    return paths


def print_reproduction(rep: Reproduction, console: Any = None) -> None:
    """The paper's table and ours, one above the other, on stderr (rich); then setup and command."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table as RichTable

    console = console or Console(stderr=True)
    console.print(f"[bold]{escape(rep.title)}[/]\npaper: {escape(rep.paper_source)}", highlight=False)
    for t in (rep.paper, rep.ours, *rep.extra):
        table = RichTable(title=escape(t.title))
        for i, c in enumerate(t.columns):
            table.add_column(escape(c), justify="left" if i == 0 else "right")
        for r in t.rows:
            table.add_row(*(escape(c.replace("**", "")) for c in r))
        console.print(table)
    s, m = rep.setup, rep.setup["machine"]
    console.print(f"ours: {s['model']}, {s['dataset']}, {s['prompts']} prompts, {s['max_new_tokens']} new tokens; "
                  f"machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads\n"
                  f"command: {s['command']}", highlight=False, soft_wrap=True)  # fmt: skip
    for n in rep.notes:
        console.print(f"note: {escape(n)}", highlight=False)


def plt():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
