"""Benchmark outputs: results.jsonl, summary.json, report.md, PNG plots, the terminal table.

* ``results.jsonl`` -- one line per prompt and method (ids, text, stats, time);
* ``summary.json``  -- :meth:`BenchSummary.to_dict`;
* ``report.md``     -- a Markdown table ready to paste into a README;
* ``speedup.png``   -- speedup vs vanilla (with SWIFT eq. 6's expectation) and M per method;
* ``layers.png``    -- per-layer cosine of attention/MLP sublayers, and each method's skip map;
* ``stream.png``    -- acceptance over the prompt stream (stream mode only).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..io import atomic_write_text
from .runner import BenchResult
from .summary import BenchSummary, MethodSummary

LOSSY_COLOR = "#d62728"


def clean_json(value: Any) -> Any:
    """NaN and infinities become null: the files must be strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def dumps(value: Any, **kw: Any) -> str:
    return json.dumps(clean_json(value), allow_nan=False, ensure_ascii=False, **kw)


# -- formatting ---------------------------------------------------------------------------


def _x(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}x"


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _shares(s: dict[str, float] | None) -> str:
    if not s:
        return "–"
    return "/".join(f"{100 * s.get(k, 0.0):.0f}" for k in ("prefill", "draft", "verify", "optimise", "other"))


def _mem(row: MethodSummary) -> str:
    if row.peak_rss_mb is None:
        return "–"
    delta = f" (+{row.rss_delta_mb:.0f})" if row.rss_delta_mb is not None else ""
    return f"{row.peak_rss_mb:.0f}{delta}"


def _status(row: MethodSummary) -> str:
    if row.prompts == 0:
        return "ERROR"
    if row.lossless is False:
        return f"**LOSSY** ({len(row.lossy_prompts)}/{row.prompts} prompts differ)"
    text = "yes" if row.lossless else "n/a"
    return text + (f" ({row.errors} errors)" if row.errors else "")


COLUMNS = (
    "method",
    "speedup",
    "per-prompt mean",
    "vs hf",
    "tokens/s (prefill / decode)",
    "M",
    "acceptance",
    "c",
    "E (eq. 6)",
    "E/v",
    "prefill/draft/verify/optimise/other %",
    "peak RSS MB (+delta)",
    "lossless",
)


def table_rows(rows: Sequence[MethodSummary], *, with_hf: bool) -> list[list[str]]:
    out = []
    for r in rows:
        cells = [
            r.label,
            _x(r.speedup),
            _x(r.speedup_mean),
            _x(r.speedup_vs_hf),
            _rates(r),
            _f(r.M),
            _pct(r.acceptance_rate),
            _f(r.c),
            _x(r.expected_speedup),
            _x(r.expected_speedup_verify_adjusted),
            _shares(r.time_shares),
            _mem(r),
            _status(r),
        ]
        out.append(cells if with_hf else cells[:3] + cells[4:])
    return out


def _rates(r: MethodSummary) -> str:
    """End-to-end tokens/s, then prefill and decoding rates apart where the method timed them."""
    whole = _f(r.tokens_per_second, 1)
    if r.prefill_tokens_per_second is None or r.decode_tokens_per_second is None:
        return whole
    return f"{whole} ({r.prefill_tokens_per_second:.0f} / {r.decode_tokens_per_second:.1f})"


def _columns(with_hf: bool) -> list[str]:
    return list(COLUMNS) if with_hf else [c for c in COLUMNS if c != "vs hf"]


def _md_table(rows: Sequence[MethodSummary], with_hf: bool) -> list[str]:
    cols = _columns(with_hf)
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows, with_hf=with_hf)]
    return lines


def header_line(config: dict[str, Any]) -> str:
    m = config.get("machine", {})
    data = config.get("dataset") or ("stream " + ",".join(config.get("stream", []) or config.get("tasks", [])))
    machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {config.get('torch_threads', '?')} torch threads"
    return (
        f"**model** {config.get('model')} · **dataset** {data} · **limit** {config.get('limit', config.get('prompts'))}"
        f" · **max_new_tokens** {config.get('max_new_tokens')} · **decoding** {sampling_text(config)}"
        f" · **machine** {machine} · **date** {config.get('date', '?')}"
        + (f" · **clock** {config['clock']} (times are the profile's costs of the passes made)"
           if config.get("clock", "real") != "real" else "")  # fmt: skip
    )


def sampling_text(config: dict[str, Any]) -> str:
    s = config.get("sampling")
    if not s:
        return "greedy"
    cuts = f", top-p {s['top_p']}" if s.get("top_p", 1.0) < 1.0 else ""
    cuts += f", top-k {s['top_k']}" if s.get("top_k") else ""
    cuts += f", min-p {s['min_p']}" if s.get("min_p") else ""
    cuts += f", repetition penalty {s['repetition_penalty']}" if s.get("repetition_penalty", 1.0) != 1.0 else ""
    cuts += f", presence penalty {s['presence_penalty']}" if s.get("presence_penalty") else ""
    cuts += f", frequency penalty {s['frequency_penalty']}" if s.get("frequency_penalty") else ""
    if not s.get("temperature"):
        return f"greedy ({cuts[2:]})"
    scheme = s.get("scheme", "coupled")
    return f"sampling (temperature {s['temperature']}{cuts}, {scheme} scheme, seed {s.get('seed')} + prompt index)"


def _lossless_under_sampling(s: dict[str, Any]) -> str:
    if s.get("scheme", "coupled") == "coupled":
        return (" with the same seed (coupled sampling: every method emits vanilla sampling's tokens; columns with "
                "sampling_scheme=rejection and the peers sample on their own, n/a)")
    return (" (rejection sampling: outputs differ draw by draw, so n/a here; exactness in distribution is tested "
            "statistically in tests/test_sampling.py)")


def markdown_report(summary: BenchSummary) -> str:
    cfg = summary.config
    with_hf = any(r.speedup_vs_hf is not None for r in summary.methods)
    lines = [f"## selfspec bench: {cfg.get('model')}", "", header_line(cfg), ""]
    if cfg.get("command"):
        lines += ["```", cfg["command"], "```", ""]
    if summary.lossy:
        lines += [
            f"> **WARNING: LOSSY** -- {', '.join(summary.lossy)} produced output that differs from vanilla's "
            "greedy output on the same prompt.",
            "",
        ]
    lines += _md_table(summary.methods, with_hf)
    for task, rows in summary.by_task.items():
        lines += ["", f"### task: {task}", ""] + _md_table(rows, with_hf)
    lines += [
        "",
        f"Speedup = sum of vanilla's wall times / sum of the method's over the same {cfg.get('prompts')} prompts "
        f"(after {cfg.get('warmup')} discarded warm-up prompt(s), methods interleaved prompt by prompt); "
        "per-prompt mean = mean of the per-prompt ratios. M = new tokens / full-model forwards (prefill included); "
        "acceptance = accepted / drafted tokens; c = time per draft forward / time per verify forward; "
        "E (eq. 6) = M·α / ((M−1)·c + α) from SWIFT; E/v divides by v = verify forward / vanilla decode step, "
        "pricing verification as measured. Time shares are of the decoder's own time (vanilla: its decode steps "
        "count as verify). Peak RSS: process resident-set high-water mark during each call "
        f"({cfg.get('memory_probe')}), max over prompts; +delta = peak minus RSS at the call's start. "
        "Lossless = every output token-identical to vanilla's"
        + (_lossless_under_sampling(cfg["sampling"]) if (cfg.get("sampling") or {}).get("temperature") else "")
        + ". Peers (hf*) are counted with forward hooks.",
    ]
    lines += _sources_table(summary)
    errors = [r for r in summary.methods if r.errors]
    if errors:
        lines += ["", "Errors:"] + [f"- {r.label}: {r.errors} prompt(s): {r.error}" for r in errors]
    return "\n".join(lines) + "\n"


def _sources_table(summary: BenchSummary) -> list[str]:
    """Per draft source of each hybrid method (``auto``): its rounds, drafted and accepted tokens, acceptance, and
    the time of its rounds (draft + verification) as a share of the method's time, over all prompts."""
    rows = [r for r in summary.methods if r.sources]
    if not rows:
        return []
    lines = ["", "### draft sources", "",
             "| method | source | rounds | drafted | accepted | acceptance | share of time |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        for name, st in r.sources.items():
            acceptance = st["accepted"] / st["drafted"] if st["drafted"] else None
            share = st["ms"] / 1000 / r.time if r.time else None
            lines.append(f"| {r.label} | {name} | {int(st['rounds'])} | {int(st['drafted'])} | {int(st['accepted'])} "
                         f"| {_pct(acceptance)} | {_pct(share)} |")  # fmt: skip
    return lines


# -- plots ----------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summary: BenchSummary, path: Path) -> None:
    plt = _plt()
    rows = list(summary.methods)
    labels = [r.label for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.5))
    colors = [LOSSY_COLOR if r.lossless is False else ("#7f7f7f" if r.peer else "#1f77b4") for r in rows]
    speed = [r.speedup or 0.0 for r in rows]
    ax1.bar(xs, speed, color=colors, hatch=None)
    for i, r in enumerate(rows):
        if r.lossless is False:
            ax1.text(i, speed[i], "LOSSY", ha="center", va="bottom", color=LOSSY_COLOR, fontweight="bold")
        elif r.prompts == 0:
            ax1.text(i, 0.02, "error", ha="center", va="bottom", color=LOSSY_COLOR)
        else:
            ax1.text(i, speed[i], f"{speed[i]:.2f}", ha="center", va="bottom", fontsize=9)
    series = (
        ("expected_speedup", "D", "expected (SWIFT eq. 6)"),
        ("expected_speedup_verify_adjusted", "x", "expected, verify cost measured (E/v)"),
    )
    if any(r.expected_speedup is not None for r in rows):
        for key, marker, label in series:
            points = [(i, getattr(r, key)) for i, r in enumerate(rows) if getattr(r, key) is not None]
            ax1.scatter(
                [i for i, _ in points], [e for _, e in points], marker=marker, color="black", zorder=3, label=label
            )
        ax1.legend(fontsize=8, loc="upper left")
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_title("speedup vs vanilla (wall time)")
    ax1.set_ylabel("x")
    ax2.bar(xs, [r.M or 0.0 for r in rows], color=colors)
    for i, r in enumerate(rows):
        if r.M is not None:
            ax2.text(i, r.M, f"{r.M:.2f}", ha="center", va="bottom", fontsize=9)
    ax2.set_title("M: new tokens per full-model forward")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=9)
        ax.margins(y=0.15)
    cfg = summary.config
    fig.suptitle(
        f"{cfg.get('model')} · {cfg.get('dataset') or 'stream'} · {cfg.get('prompts')} prompts · "
        f"{cfg.get('max_new_tokens')} new tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(summary: BenchSummary, path: Path, num_layers: int) -> None:
    plt = _plt()
    mapped = [r for r in summary.methods if r.skip_frequency]
    n_rows = 2 * len(mapped)
    fig, (ax1, ax2) = plt.subplots(
        2,
        1,
        figsize=(max(8, 0.3 * num_layers + 3), 3.2 + 0.35 * max(2, n_rows)),
        gridspec_kw={"height_ratios": [3, max(1.2, 0.35 * n_rows)]},
        sharex=True,
    )
    layers = list(range(num_layers))
    cos = summary.cosine
    if cos:
        for kind, marker in (("attention", "o"), ("mlp", "s")):
            ys = [math.nan if v is None else v for v in cos[kind]]
            ax1.plot(layers, ys, marker=marker, markersize=4, label=f"{kind} sublayer")
        ax1.set_ylabel("cos(h before, h after)")
        ax1.set_title(f"mean per-sublayer cosine similarity ({cos['source']}, {cos['prompts']} prompts)", fontsize=10)
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3)
    else:
        ax1.text(0.5, 0.5, "no cosine measured", ha="center", va="center", transform=ax1.transAxes)
    if mapped:
        import numpy as np

        grid = np.array([row.skip_frequency[kind] for row in mapped for kind in ("attention", "mlp")])
        im = ax2.imshow(
            grid,
            aspect="auto",
            cmap="Blues",
            vmin=0,
            vmax=1,
            interpolation="nearest",
            extent=(-0.5, num_layers - 0.5, n_rows - 0.5, -0.5),
        )
        ax2.set_yticks(range(n_rows))
        ax2.set_yticklabels([f"{row.label} · {k}" for row in mapped for k in ("attn", "mlp")], fontsize=8)
        for y in range(2, n_rows, 2):
            ax2.axhline(y - 0.5, color="black", linewidth=0.8)
        cbar = fig.colorbar(im, ax=[ax1, ax2], fraction=0.03, pad=0.01)
        cbar.set_label("fraction of prompts skipped", fontsize=8)
        ax2.set_title("skipped sublayers per method (0-based layers)", fontsize=10)
    else:
        ax2.text(0.5, 0.5, "no method skipped sublayers", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_yticks([])
    ax2.set_xlabel("layer (0-based)")
    ax2.set_xticks(layers if num_layers <= 40 else layers[::2])
    ax2.tick_params(axis="x", labelsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_stream(summary: BenchSummary, path: Path) -> None:
    plt = _plt()
    st = summary.stream or {}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, roll in st.get("rolling", {}).items():
        xs = [i for i, v in enumerate(roll) if v is not None]
        (line,) = ax.plot(xs, [roll[i] for i in xs], label=f"{label} (rolling, {st['window']} prompts)")
        per = st["acceptance"][label]
        pxs = [i for i, v in enumerate(per) if v is not None]
        ax.scatter(pxs, [per[i] for i in pxs], s=12, alpha=0.35, color=line.get_color())
    for b, task in zip(st.get("boundaries", []), st.get("tasks", []), strict=False):
        ax.axvline(b - 0.5, color="black", linestyle="--", linewidth=0.8)
        ax.text(b - 0.4, 1.02, task, fontsize=9, va="bottom")
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("prompt index in the stream")
    ax.set_ylabel("acceptance rate")
    ax.set_title("acceptance over the task stream (dots: per prompt)", fontsize=10, pad=16)
    if st.get("rolling"):
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no method drafted tokens", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- files and terminal ---------------------------------------------------------------------


def write_outputs(result: BenchResult, summary: BenchSummary, out_dir: str | Path) -> dict[str, Path]:
    """Write every output file into ``out_dir``; returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": out / "results.jsonl",
        "summary": out / "summary.json",
        "report": out / "report.md",
        "speedup": out / "speedup.png",
        "layers": out / "layers.png",
    }
    atomic_write_text(paths["results"], "".join(dumps(r.to_dict()) + "\n" for r in result.records))
    atomic_write_text(paths["summary"], dumps(summary.to_dict(), indent=2) + "\n")
    atomic_write_text(paths["report"], markdown_report(summary))
    plot_speedup(summary, paths["speedup"])
    plot_layers(summary, paths["layers"], result.num_layers)
    if summary.stream is not None:
        paths["stream"] = out / "stream.png"
        plot_stream(summary, paths["stream"])
    return paths


TERMINAL_COLUMNS = ("method", "speedup", "vs hf", "tokens/s", "M", "acceptance", "E (eq. 6)", "lossless")


def print_summary(summary: BenchSummary, console=None) -> None:
    """A compact summary table on stderr (rich), LOSSY methods in red; report.md has every column."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(stderr=True)
    with_hf = any(r.speedup_vs_hf is not None for r in summary.methods)
    columns = _columns(with_hf)
    keep = [i for i, c in enumerate(columns) if c in TERMINAL_COLUMNS]
    sections = [(None, summary.methods)] + list(summary.by_task.items())
    for task, rows in sections:
        cfg = summary.config
        where = task or cfg.get("dataset") or "stream"
        title = f"{cfg.get('model')} · {where} · {cfg.get('max_new_tokens')} new tokens · {sampling_text(cfg)}"
        if cfg.get("clock", "real") != "real":
            title += f" · {cfg['clock']}"
        table = Table(title=escape(title))
        for i in keep:
            table.add_column(columns[i], justify="left" if i == 0 else "right")
        for row, cells in zip(rows, table_rows(rows, with_hf=with_hf), strict=True):
            cells = [cells[i].replace("**", "") for i in keep]
            style = "bold red" if row.lossless is False or row.prompts == 0 else None
            table.add_row(*(escape(c) for c in cells), style=style)
        console.print(table)


def warn_lossy(summary: BenchSummary, console=None) -> None:
    """A red line on stderr per lossy method (and a yellow one per failing method)."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(stderr=True)
    for label in summary.lossy:
        row = summary.method(label)
        where = escape(str(list(row.lossy_prompts)[:10]))
        console.print(
            f"[bold red]WARNING: method '{escape(label)}' is LOSSY: its output differs from vanilla's on "
            f"{len(row.lossy_prompts)} of {row.prompts} prompts (prompt indices {where})[/]",
            highlight=False,
        )
    for label in summary.failed:
        row = summary.method(label)
        console.print(
            f"[yellow]method '{escape(label)}' failed on {row.errors} prompt(s): {escape(row.error or '')}[/]",
            highlight=False,
        )
