"""``selfspec whatif``: replay draft sources and their combinations on vanilla outputs, priced with this
machine's measured costs (argparse only; the work is in :mod:`selfspec.bench.whatif`).

    selfspec whatif --model gemma3-270m --dataset spec-bench --limit 2
    selfspec whatif --temperature 0.7 --top-p 0.9          # coupled sampling: vanilla sampling's outputs
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from .args import add_model_args, add_sampling_args, load_model, sampling_params, spec_bench_categories


def add_whatif_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``whatif`` on the ``selfspec`` subparsers."""
    from ..bench.whatif import POLICIES

    p = sub.add_parser(
        "whatif",
        help="would another draft source, or one tree merging several, pay here? (replayed on vanilla outputs)",
        description="Generate vanilla outputs, record what the model and its layer-skip draft predicted along "
        "them and this machine's verification and draft costs, then replay draft policies round by round: "
        + ", ".join(POLICIES)
        + " ('a|b': a where it proposes, else b; 'a+b': one tree of both).",
    )
    add_model_args(p)
    p.add_argument("--dataset", default="spec-bench", help="xsum, humaneval, mtbench, spec-bench or PATH.jsonl")
    p.add_argument("--categories", help="spec-bench: comma-separated categories (default all six)")
    p.add_argument("--limit", type=int, default=2, help="prompts (per category for spec-bench; default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_sampling_args(p, seed_help="prompt i samples with seed SEED + i (default 0), as in selfspec bench",
                      seed_default=0)  # fmt: skip
    p.set_defaults(func=cmd_whatif)
    return p


def cmd_whatif(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..bench.whatif import POLICIES, collect, replay, report
    from ..datasets import load_prompts
    from ..errors import InvalidInputError

    if args.limit < 1 or args.max_new_tokens < 1:
        raise InvalidInputError("--limit and --max-new-tokens must be >= 1")
    sampling = sampling_params(args)
    if not sampling.greedy and not sampling.coupled:
        raise InvalidInputError("whatif replays drafts by exact match: use the coupled sampling scheme")
    categories = spec_bench_categories(args.categories, [args.dataset])
    load_prompts(args.dataset, limit=1, chat=False, categories=categories)  # a bad dataset fails before the load
    model = load_model(args)
    prompts = load_prompts(args.dataset, limit=args.limit, chat=model.has_chat_template, categories=categories)
    with tqdm(total=len(prompts), desc="vanilla outputs and predictions", disable=args.json) as bar:
        traces, costs = collect(
            model, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, progress=bar.update
        )
    results = [replay(traces, costs, policy) for policy in POLICIES]
    if args.json:
        print(json.dumps({"costs": asdict(costs), "results": [
            {"policy": r.policy, "speedup": r.speedup, "mean_accepted": r.mean_accepted, "rounds": r.rounds,
             "per_task": {t: v[0] / v[1] for t, v in r.per_task.items()}} for r in results]}))  # fmt: skip
    else:
        print(report(traces, costs, results))
    return 0
