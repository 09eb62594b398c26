"""S3D's speed model (paper eq. 10-13), fitted to acceptance measured with trained adapters.

* eq. 10: acceptance of the first draft token as a function of the share
  beta of the model the draft runs, alpha(beta; U) = (1 - U^beta) / (1 - U);
  U is fitted by least squares to (beta, alpha) measured with adapters trained
  at several skip depths;
* eq. 11: expected tokens per round tau(gamma, beta) = sum_{n=1}^{gamma+1}
  n * prod_{k<n} alpha_k(beta) * z_n(beta), where alpha_k is the acceptance
  of the k-th draft token given the earlier ones, alpha_k = alpha_1 * d_k with
  the discount d_k measured (mean over the adapters);
* eq. 12: improvement factor IF = tau / (delta + beta + 1), delta the round's
  fixed overhead in full-forward units (measured).  The paper prices a draft
  pass at beta full passes; with low-precision drafts (or where verifying
  gamma + 1 tokens costs more than one token, as on a CPU) that is off, so the
  report also gives IF with the draft pass priced as measured (c) and delta
  the rest of the round beyond one full pass;
* eq. 13: memory-normalised speed = speedup / (peak memory / vanilla's).

Measure, fit and report (each adapter directory from ``selfspec train-s3d``)::

    python -m selfspec.train.s3d_speed adapters/s3d-a adapters/s3d-b adapters/s3d-c --dataset xsum --limit 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass


def alpha_of_beta(beta: float, u: float) -> float:
    """Eq. 10 (U = 1 is the limit alpha = beta)."""
    if abs(u - 1.0) < 1e-9:
        return beta
    return (1.0 - u**beta) / (1.0 - u)


def fit_u(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares U of eq. 10 for (beta, alpha) points, by a fine log-spaced grid (U in 1e-6 .. 1e6)."""
    if not points:
        raise ValueError("no (beta, alpha) points to fit")
    grid = [10 ** (e / 200.0) for e in range(-1200, 1201)]

    def err(u: float) -> float:
        return sum((alpha_of_beta(b, u) - a) ** 2 for b, a in points)

    return min(grid, key=err)


def conditional_acceptance(accept_lengths: Sequence[int], gamma: int) -> list[float | None]:
    """alpha_k, k = 1..gamma: P(draft token k accepted | tokens 1..k-1 accepted), from accepted lengths per round."""
    out: list[float | None] = []
    for k in range(1, gamma + 1):
        reached = sum(1 for n in accept_lengths if n >= k - 1)
        kept = sum(1 for n in accept_lengths if n >= k)
        out.append(kept / reached if reached else None)
    return out


def tau(alphas: Sequence[float]) -> float:
    """Eq. 11: expected new tokens of a round with per-position conditional acceptances alpha_1..alpha_gamma."""
    gamma = len(alphas)
    total, prefix = 0.0, 1.0
    for n in range(1, gamma + 2):
        z = 1.0 if n == gamma + 1 else 1.0 - alphas[n - 1]
        total += n * prefix * z
        if n <= gamma:
            prefix *= alphas[n - 1]
    return total


def improvement_factor(alphas: Sequence[float], beta: float, delta: float) -> float:
    """Eq. 12."""
    return tau(alphas) / (delta + beta + 1.0)


def memory_normalised(speedup: float, peak_mb: float, baseline_peak_mb: float) -> float:
    """Eq. 13."""
    return speedup / (peak_mb / baseline_peak_mb)


@dataclass(frozen=True)
class Measurement:
    label: str
    beta: float
    gamma: int
    alphas: tuple[float | None, ...]  # conditional acceptance per draft position
    speedup: float  # vs vanilla on the same prompts
    delta: float  # the round beyond one draft pass and one full pass, in full-forward units
    draft_cost: float  # one draft pass, in full-forward units (c)


def discounts(measurements: Sequence[Measurement]) -> list[float]:
    """d_k = alpha_k / alpha_1, averaged over the measurements where both are known."""
    gamma = max(m.gamma for m in measurements)
    out = []
    for k in range(gamma):
        ratios = [m.alphas[k] / m.alphas[0] for m in measurements
                  if k < len(m.alphas) and m.alphas[k] is not None and m.alphas[0]]  # fmt: skip
        out.append(statistics.fmean(ratios) if ratios else (out[-1] if out else 1.0))
    return out


def predict(beta: float, gamma: int, u: float, d: Sequence[float], delta: float, cost: float | None = None) -> float:
    """Eq. 12 with alpha_1 from eq. 10 and the measured discounts; the draft pass costs ``cost`` (default beta)."""
    a1 = alpha_of_beta(beta, u)
    alphas = [min(1.0, a1 * d[min(k, len(d) - 1)]) for k in range(gamma)]
    return tau(alphas) / (delta + (beta if cost is None else cost) + 1.0)


def optimum(u: float, d: Sequence[float], delta: float, gammas=range(1, 9),
            cost_per_beta: float | None = None) -> tuple[float, int, float]:  # fmt: skip
    """(beta, gamma, IF) maximising eq. 12 over beta in 0.05..0.95 and the given gammas."""
    best = (0.0, 0, -math.inf)
    for b in [x / 100 for x in range(5, 96)]:
        for g in gammas:
            val = predict(b, g, u, d, delta, None if cost_per_beta is None else cost_per_beta * b)
            if val > best[2]:
                best = (b, g, val)
    return best


# -- measuring ---------------------------------------------------------------------------------


def measure(model, adapter_dirs: Sequence[str], prompts, max_new_tokens: int, progress: bool = True):
    """For each adapter: conditional acceptance per position, speedup and overhead vs vanilla (same prompts)."""
    from tqdm import tqdm

    from ..api import Session
    from ..drafters.s3d import S3DAdapter

    Session(model, "vanilla").generate(prompts[0].prompt, max_new_tokens=8)  # warm-up
    vanilla_time, vanilla_tokens = 0.0, 0
    van = Session(model, "vanilla")
    for item in tqdm(prompts, desc="vanilla", disable=not progress):
        r = van.generate(item.prompt, max_new_tokens=max_new_tokens)
        vanilla_time += r.stats.total_time
        vanilla_tokens += r.stats.new_tokens
    c_ms = 1000 * vanilla_time / max(1, vanilla_tokens)  # about one full forward
    out = []
    for d in adapter_dirs:
        adapter = S3DAdapter.load(model, d)
        session = Session(model, "s3d", adapter=adapter)
        lengths: list[int] = []
        t = 0.0
        rounds_ms: list[float] = []
        draft_ms: list[float] = []
        for item in tqdm(prompts, desc=str(d), disable=not progress):
            r = session.generate(item.prompt, max_new_tokens=max_new_tokens)
            s = r.stats
            lengths += list(s.accept_lengths)
            t += s.total_time
            rounds = max(1, s.forwards - 1)
            rounds_ms.append(1000 * (s.draft_time + s.verify_time) / rounds)
            draft_ms.append(1000 * s.draft_time / max(1, s.draft_forwards))
        beta = adapter.config.beta(model.num_layers)
        round_ms, pass_ms = statistics.fmean(rounds_ms), statistics.fmean(draft_ms)
        delta = max(0.0, (round_ms - pass_ms - c_ms) / c_ms)
        alphas = tuple(conditional_acceptance(lengths, adapter.config.gamma))
        out.append(Measurement(str(d), beta, adapter.config.gamma, alphas, vanilla_time / t, delta, pass_ms / c_ms))
    return out


def main(argv: list[str] | None = None) -> int:
    from ..datasets import load_prompts
    from ..model.models import load

    p = argparse.ArgumentParser(prog="python -m selfspec.train.s3d_speed", description=__doc__.split("\n")[0])
    p.add_argument("adapters", nargs="+", help="adapter directories (different skip depths)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="xsum")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    model = load(args.model)
    prompts = load_prompts(args.dataset, limit=args.limit, chat=model.has_chat_template, offset=args.offset)
    ms = measure(model, args.adapters, prompts, args.max_new_tokens)
    u = fit_u([(m.beta, m.alphas[0]) for m in ms if m.alphas[0] is not None])
    d = discounts(ms)
    delta = statistics.fmean(m.delta for m in ms)
    cost_per_beta = statistics.fmean(m.draft_cost / m.beta for m in ms)  # measured draft cost, per unit of beta
    print(f"fitted U = {u:.4g}; discount d_k = {', '.join(f'{x:.2f}' for x in d)}; delta = {delta:.2f}; "
          f"draft pass = {cost_per_beta:.2f} * beta full passes (measured)")  # fmt: skip
    print("| adapter | beta | gamma | alpha_1 measured | alpha_1 eq. 10 | alpha_k measured | c | IF eq. 12 "
          "| IF, c measured | speedup |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in ms:
        ak = ", ".join("-" if a is None else f"{a:.2f}" for a in m.alphas)
        paper = predict(m.beta, m.gamma, u, d, delta)
        priced = predict(m.beta, m.gamma, u, d, m.delta, m.draft_cost)
        print(f"| {m.label} | {m.beta:.2f} | {m.gamma} | {m.alphas[0]:.2f} | {alpha_of_beta(m.beta, u):.2f} | {ak} "
              f"| {m.draft_cost:.2f} | {paper:.2f} | {priced:.2f} | {m.speedup:.2f}x |")
    b, g, val = optimum(u, d, delta)
    print(f"predicted optimum (eq. 12 as in the paper): beta = {b:.2f}, gamma = {g} (IF {val:.2f})")
    b, g, val = optimum(u, d, delta, cost_per_beta=cost_per_beta)
    print(f"predicted optimum (draft cost as measured): beta = {b:.2f}, gamma = {g} (IF {val:.2f})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
