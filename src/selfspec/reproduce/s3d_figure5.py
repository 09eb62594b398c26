"""``selfspec reproduce s3d-figure5``: S3D's speed model against measurement (Zhong & Bharadwaj 2024, Figure 5).

    selfspec reproduce s3d-figure5                     # trains 3 adapters, then 3 MT-Bench prompts x 64 tokens
    selfspec reproduce s3d-figure5 --adapter adapters/a --adapter adapters/b --limit 5

Draft models of several sizes beta (the share of layers the draft runs: the
middle quarter, half or three quarters skipped) each draft gamma = 1..5 tokens
per pass.  Without ``--adapter`` the target trains its own small adapters first
(``selfspec train-s3d``'s self-distillation and eq. 9 loss, ``--train-steps``
steps each, about 1.5 min each on 2 cores; resumable: a rerun reuses them from
``--out``/adapters).  Every (beta, gamma) pair then runs beside vanilla on the
same prompts with the bench's fair runner.  From the measured acceptance the
target fits eq. 10's U, measures the per-position discount and the round's
overhead delta, and predicts acceptance (eq. 10) and speed (eq. 11-12, the draft
priced at beta full passes as in the paper, and at its measured cost), beside
the measured acceptance and speedup; the plot has Figure 5's two panels.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..bench.runner import BenchResult, PromptRecord
from ..bench.spec import BenchMethod
from ..datasets import PromptItem
from ..drafters.s3d import S3DConfig
from ..errors import InvalidInputError
from ..model.models import Model
from ..train.s3d import train_s3d
from ..train.s3d_speed import Measurement, alpha_of_beta, conditional_acceptance, discounts, fit_u, optimum, predict
from .common import (
    ReproduceOptions,
    Reproduction,
    Table,
    bench,
    check_ran,
    ff,
    fx,
    load_target_prompts,
    lossless_text,
    plt,
    setup_info,
)

NAME = "s3d-figure5"
DATASET = "mtbench"
GAMMAS = (1, 2, 3, 4, 5)  # the paper: "evaluated for different gamma values up to 5"
SKIPPED_SHARES = (0.25, 0.5, 0.75)  # middle layers skipped; beta = the share kept
TRAIN_GAMMA = max(GAMMAS)  # trained on every draft position that is measured
TRAIN_TEXTS, TRAIN_NEW_TOKENS = 16, 48  # self-distilled texts, shared by the adapters
SOURCE = ("Zhong & Bharadwaj 2024, 'S3D: A Simple and Cost-Effective Self-Speculative Decoding Scheme for "
          "Low-Memory GPUs', Section 5.3, Figure 5 and eq. 10-12: models trained with different numbers of middle "
          "layers skipped (the section's target model is LLaMA 7B), MT-Bench, 50 samples, gamma up to 5")  # fmt: skip
PAPER = Table("Paper, Section 5.3 on Figure 5 (the figure prints no numbers; its findings, quoted)",
              ("finding", "paper"),
              (("eq. 10 (acceptance)", "mostly matches with the empirical results except for the lowest β value"),
               ("eq. 12 (speed)", "successfully predicts both the trend and the sweet spot in speedups"),
               ("optimum", "skipping around half of the layers (β → 0.5) and the optimal γ is 4"),
               ("higher γ", "align less with the prediction")))  # fmt: skip


def adapter_config(path: str | Path) -> S3DConfig:
    d = Path(path)
    try:
        meta = json.loads((d / "config.json").read_text())
        config = S3DConfig(**meta["config"])
    except (OSError, ValueError, KeyError, TypeError):
        msg = f"'{d}' is not an S3D adapter directory (train one with `selfspec train-s3d`)"
        raise InvalidInputError(msg) from None
    if not (d / "adapter.pt").is_file():
        raise InvalidInputError(f"'{d}' has no adapter.pt (train it with `selfspec train-s3d --out {d}`)")
    return config


def skip_configs(num_layers: int) -> list[S3DConfig]:
    """Symmetric middle gaps skipping about each share of the layers (distinct, at least one layer kept each side)."""
    out: list[S3DConfig] = []
    for share in SKIPPED_SHARES:
        skipped = min(max(1, round(num_layers * share)), num_layers - 2)
        start = max(1, (num_layers - skipped) // 2)
        config = S3DConfig(start, start + skipped, TRAIN_GAMMA)
        if config not in out:
            out.append(config)
    return out


def train_adapters(model: Model, opts: ReproduceOptions) -> list[Path]:
    """Train (or resume, or reuse) one adapter per gap under ``out/adapters``; the self-distilled texts are shared."""
    dirs = []
    for config in skip_configs(model.num_layers):
        d = opts.out_dir / "adapters" / f"skip-{config.skip_from}-{config.skip_to - 1}"
        if dirs and not (d / "data.jsonl").is_file() and (dirs[0] / "data.jsonl").is_file():
            d.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dirs[0] / "data.jsonl", d / "data.jsonl")
        train_s3d(model, d, steps=opts.train_steps, config=config, prompts=TRAIN_TEXTS, new_tokens=TRAIN_NEW_TOKENS,
                  progress=opts.progress)  # fmt: skip
        dirs.append(d)
    return dirs


def label_of(beta: float, gamma: int) -> str:
    return f"beta={beta:.2f}:gamma={gamma}"


def methods(adapters: Sequence[Path], num_layers: int) -> list[BenchMethod]:
    out = []
    for d in adapters:
        beta = adapter_config(d).beta(num_layers)
        for g in GAMMAS:
            out.append(BenchMethod("s3d", {"adapter": str(d), "gamma": g, "draft_dtype": "same"}, label_of(beta, g)))
    return out


def _round_costs(recs: Sequence[PromptRecord], full_ms: float) -> tuple[float, float]:
    """(delta, c): the round beyond one draft pass and one full pass, and one draft pass, in full-pass units."""
    rounds, drafts = [], []
    for r in recs:
        s = r.stats
        rounds.append(1000 * (s["draft_time"] + s["verify_time"]) / max(1, s["forwards"] - 1))
        drafts.append(1000 * s["draft_time"] / max(1, s["draft_forwards"]))
    round_ms, pass_ms = statistics.fmean(rounds), statistics.fmean(drafts)
    return max(0.0, (round_ms - pass_ms - full_ms) / full_ms), pass_ms / full_ms


def measurements(result: BenchResult, speedups: dict[str, float | None]) -> list[Measurement]:
    """One :class:`~selfspec.train.s3d_speed.Measurement` per (beta, gamma) from the bench's records."""
    base = [r for r in result.by_method(result.baseline.label) if r.ok]
    full_ms = 1000 * sum(r.stats["total_time"] for r in base) / max(1, sum(r.stats["new_tokens"] for r in base))
    out = []
    for m in result.methods:
        if m.is_baseline:
            continue
        recs = [r for r in result.by_method(m.label) if r.ok and r.stats]
        lengths = [n for r in recs for n in r.stats["accept_lengths"]]
        delta, c = _round_costs(recs, full_ms)
        beta = adapter_config(m.options["adapter"]).beta(result.num_layers)
        alphas = tuple(conditional_acceptance(lengths, int(m.options["gamma"])))
        out.append(Measurement(m.label, beta, int(m.options["gamma"]), alphas, speedups[m.label] or 0.0, delta, c))
    return out


def fit(ms: Sequence[Measurement]) -> dict[str, Any]:
    """Eq. 10's U from each beta's first-token acceptance (all gammas pooled), discounts, overhead, optima."""
    by_beta: dict[float, list[float]] = {}
    for m in ms:
        if m.alphas and m.alphas[0] is not None:
            by_beta.setdefault(m.beta, []).append(m.alphas[0])
    points = [(b, statistics.fmean(a)) for b, a in sorted(by_beta.items())]
    if not points:
        raise InvalidInputError("no S3D draft was ever verified: nothing to fit (more prompts or tokens?)")
    u = fit_u(points)
    deepest = [m for m in ms if m.gamma == max(x.gamma for x in ms)]
    d = discounts(deepest)
    delta = statistics.fmean(m.delta for m in ms)
    cost_per_beta = statistics.fmean(m.draft_cost / m.beta for m in ms)
    paper_opt, priced_opt = optimum(u, d, delta, GAMMAS), optimum(u, d, delta, GAMMAS, cost_per_beta)
    best = max(ms, key=lambda m: m.speedup)
    return {"U": u, "points": points, "discounts": d, "delta": delta, "cost_per_beta": cost_per_beta,
            "optimum_eq12": {"beta": paper_opt[0], "gamma": paper_opt[1], "IF": paper_opt[2]},
            "optimum_measured_costs": {"beta": priced_opt[0], "gamma": priced_opt[1], "IF": priced_opt[2]},
            "best_measured": {"beta": best.beta, "gamma": best.gamma, "speedup": best.speedup}}  # fmt: skip


def _rows(ms: Sequence[Measurement], f: dict[str, Any], summary_rows: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for m in ms:
        s = summary_rows[m.label]
        a1 = m.alphas[0] if m.alphas else None
        rows.append((ff(m.beta), str(m.gamma), ff(a1), ff(alpha_of_beta(m.beta, f["U"])),
                     fx(predict(m.beta, m.gamma, f["U"], f["discounts"], f["delta"])),
                     fx(predict(m.beta, m.gamma, f["U"], f["discounts"], m.delta, m.draft_cost)), fx(s.speedup),
                     ff(s.M), ff(s.acceptance_rate), lossless_text(s.lossless)))  # fmt: skip
    return rows


def run(model: Model, opts: ReproduceOptions, prompts: Sequence[PromptItem] | None = None) -> Reproduction:
    adapters = [Path(a) for a in opts.adapters] if opts.adapters else None
    for a in adapters or ():
        adapter_config(a).check(model.num_layers)
    prompts = list(prompts) if prompts is not None else load_target_prompts(model, DATASET, opts.limit)
    adapters = adapters or train_adapters(model, opts)
    result, summary = bench(model, prompts, methods(adapters, model.num_layers), opts)
    check_ran(summary)
    rows_by_label = {m.label: m for m in summary.methods}
    ms = measurements(result, {k: v.speedup for k, v in rows_by_label.items()})
    f = fit(ms)
    ours = Table(f"Ours: {model.name} on {DATASET}, {len(adapters)} draft sizes x gamma {GAMMAS[0]}..{GAMMAS[-1]}",
                 ("β", "γ", "α1 measured", "α1 eq. 10", "IF eq. 12", "IF, c measured", "speedup", "M", "acceptance",
                  "lossless"), tuple(_rows(ms, f, rows_by_label)))  # fmt: skip
    fit_table = Table("Fitted speed model and optima", ("quantity", "value"), _fit_rows(f))
    data = {"fit": f, "adapters": [str(a) for a in adapters],
            "measurements": [{**m.__dict__, "alphas": list(m.alphas)} for m in ms],
            "vanilla_tokens_per_second": summary.method(result.baseline.label).tokens_per_second}  # fmt: skip
    notes = ("β here is the share of layers the draft runs (by layer count; the paper counts parameters); "
             "the embedding and LM head always run.",
             "IF eq. 12 prices a draft pass at β full passes as the paper does; 'IF, c measured' uses the measured "
             "draft-pass cost and the round's measured overhead.",
             f"Adapters: {', '.join(str(a) for a in adapters)}" + ("" if opts.adapters else
             f" (trained here: {opts.train_steps} steps each on {TRAIN_TEXTS} self-distilled texts; the paper "
             "trains far longer, so acceptance is lower)"),
             "Drafts in the model's own precision (draft_dtype=same); greedy decoding.")  # fmt: skip
    return Reproduction(NAME, "S3D: predicted vs measured acceptance and speed (Figure 5)", SOURCE, PAPER, ours,
                        setup_info(model, opts, DATASET, result, gammas=list(GAMMAS)), data, notes, (fit_table,),
                        plot=lambda path: plot_figure5(ms, f, path), bench=result)  # fmt: skip


def _fit_rows(f: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    o, p, b = f["optimum_eq12"], f["optimum_measured_costs"], f["best_measured"]
    return (("U (eq. 10, least squares)", f"{f['U']:.4g}"),
            ("discount d_k (α_k / α_1)", ", ".join(f"{x:.2f}" for x in f["discounts"])),
            ("δ (round overhead, full passes)", ff(f["delta"])),
            ("draft pass cost per unit β (measured)", ff(f["cost_per_beta"])),
            ("optimum, eq. 12 as the paper", f"β {o['beta']:.2f}, γ {o['gamma']} (IF {o['IF']:.2f})"),
            ("optimum, draft cost measured", f"β {p['beta']:.2f}, γ {p['gamma']} (IF {p['IF']:.2f})"),
            ("best measured", f"β {b['beta']:.2f}, γ {b['gamma']} ({b['speedup']:.2f}x)"))  # fmt: skip


def plot_figure5(ms: Sequence[Measurement], f: dict[str, Any], path: Path) -> None:
    """Figure 5's panels: acceptance vs beta (eq. 10 dashed, measured dots); speed vs beta per gamma."""
    pyplot = plt()
    fig, (top, bottom) = pyplot.subplots(2, 1, figsize=(6.5, 8))
    grid = [x / 100 for x in range(5, 100)]
    top.plot(grid, [alpha_of_beta(b, f["U"]) for b in grid], "--", label=f"eq. 10, U = {f['U']:.3g}")
    top.plot([p[0] for p in f["points"]], [p[1] for p in f["points"]], "o", color="#ff7f0e", label="measured α1")
    top.set_xlabel("β (share of layers the draft runs)")
    top.set_ylabel("acceptance of the first draft token")
    top.set_ylim(0, 1.02)
    top.legend(fontsize=8)
    colors = pyplot.get_cmap("viridis")
    for i, g in enumerate(GAMMAS):
        color = colors(i / max(1, len(GAMMAS) - 1))
        bottom.plot(grid, [predict(b, g, f["U"], f["discounts"], f["delta"]) for b in grid], color=color,
                    label=f"γ = {g}, eq. 12")  # fmt: skip
        pts = [(m.beta, m.speedup) for m in ms if m.gamma == g]
        bottom.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color)
    bottom.axhline(1.0, color="grey", lw=0.6)
    bottom.set_xlabel("β (share of layers the draft runs)")
    bottom.set_ylabel("speed over vanilla (curves: eq. 12; dots: measured)")
    bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
