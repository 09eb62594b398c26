"""``selfspec reproduce NAME``: a paper's key result reproduced by one command (argparse only; the work is in
:mod:`selfspec.reproduce`).

    selfspec reproduce asd-table5
    selfspec reproduce swift-figure7 --limit 2 --max-new-tokens 64 --out reproductions/fig7-quick
    selfspec reproduce s3d-figure5 --adapter adapters/a --adapter adapters/b
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError
from .args import add_model_args, load_model


def add_reproduce_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``reproduce`` on the ``selfspec`` subparsers."""
    from ..reproduce import TARGETS

    targets = "\n".join(f"  {t.name:14s} {t.summary} (default --limit {t.limit}, --max-new-tokens "
                        f"{t.max_new_tokens}: ~{t.minutes:g} min on 2 CPU cores)"
                        for t in TARGETS.values())  # fmt: skip
    p = sub.add_parser(
        "reproduce",
        help="reproduce a paper's key result (ASD Table 5, SWIFT Table 8 and Figure 7, S3D Figure 5)",
        description="Run a paper's key experiment on our engine and print the paper's figures next to ours; "
        "writes report.md, result.json, results.jsonl (and a PNG for figures) into --out.",
        epilog="targets:\n" + targets,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="target: " + ", ".join(TARGETS))
    add_model_args(p)
    p.add_argument("--limit", type=int, help="prompts (per task for swift-figure7; default: the target's)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default: the target's)")
    p.add_argument("--out", type=Path, help="output directory (default reproductions/NAME)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up prompts per method, discarded (default 1)")
    p.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="s3d-figure5: a trained S3D adapter to measure (repeat; default: train small ones)")
    p.add_argument("--train-steps", type=int, default=250,
                   help="s3d-figure5: training steps per adapter it trains itself (default 250)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_reproduce)
    return p


def _command_line(args: argparse.Namespace, limit: int, max_new_tokens: int, out: Path) -> str:
    argv = ["selfspec", "reproduce", args.name, "--model", args.model, "--limit", str(limit),
            "--max-new-tokens", str(max_new_tokens), "--out", str(out), "--warmup", str(args.warmup)]  # fmt: skip
    for a in args.adapter:
        argv += ["--adapter", a]
    if args.name == "s3d-figure5" and not args.adapter:
        argv += ["--train-steps", str(args.train_steps)]
    loading = (("--device", args.device, "cpu"), ("--dtype", args.dtype, "float32"),
               ("--kernels", args.kernels, "auto"), ("--quantize", args.quantize, "auto"))
    for flag, value, default in loading:
        if value != default:
            argv += [flag, value]
    return shlex.join(argv)


def cmd_reproduce(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..datasets import load_prompts
    from ..reproduce import ReproduceOptions, get_target, print_reproduction, write_reproduction

    target = get_target(args.name)
    if args.adapter and target.name != "s3d-figure5":
        raise InvalidInputError("--adapter applies to s3d-figure5 only")
    limit = target.limit if args.limit is None else args.limit
    max_new_tokens = target.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    out = args.out or Path("reproductions") / target.name
    opts = ReproduceOptions(limit, max_new_tokens, out, _command_line(args, limit, max_new_tokens, out),
                            warmup=args.warmup, progress=not args.no_progress, adapters=tuple(args.adapter),
                            train_steps=args.train_steps)  # fmt: skip  (validates before the model loads)
    load_prompts(target.dataset, limit=1, chat=False)  # a missing dataset package: fail before the model loads
    console = Console(stderr=True)
    console.print(f"selfspec reproduce {target.name}: {target.summary}\ncommand: {opts.command}", highlight=False,
                  soft_wrap=True)  # one line: the command stays copyable
    model = load_model(args)
    rep = target.run(model, opts, None)
    paths = write_reproduction(rep, out)
    print_reproduction(rep, console)
    console.print(f"outputs: {out}/ ({', '.join(p.name for p in paths.values())})", highlight=False)
    return 0
