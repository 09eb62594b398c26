"""``selfspec bench``: the benchmark subcommand (argparse only; the work is in runner/summary/report).

    selfspec bench --model smollm2-135m --dataset xsum --limit 10 --max-new-tokens 128 \\
        --methods "vanilla,asd,asd:alpha=0.995:m=5,hf,hf-lookup"
    selfspec bench --stream xsum,humaneval,mtbench --limit 5 --methods asd --json
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError
from .args import add_model_args, add_sampling_args, load_model, sampling_argv, sampling_params, spec_bench_categories

METHODS_SYNTAX = """\
method specs (--methods):
  comma-separated; options follow the name, each introduced by ':' as key=value
  (values read as int, float, true/false, else text); a bare value sets the
  method's main option; '@label' at the end names it in tables and files.

    vanilla                     our plain decoding: the baseline (always added)
    asd                         ASD with the paper's values
    asd:alpha=0.995:m=5@strict  ASD with options, reported as 'strict'
    static:skip.json            a fixed skip set from a JSON file (= static:skip_set=skip.json)
    hf                          transformers generate(), greedy
    hf-lookup:tokens=10         transformers prompt lookup decoding
    hf-early-exit:8             transformers assistant_early_exit with 8 layers (default L/2)

datasets: xsum, humaneval, mtbench, spec-bench (480 questions, six categories;
--categories, --limit per category), or a JSONL file ({"prompt": ...} or
{"messages": [...]} per line); --stream takes a comma-separated list of them
and runs --limit prompts of each, task after task, with the same sessions.

outputs (--out DIR): results.jsonl, summary.json, report.md, speedup.png,
layers.png (+ stream.png). Exit status 1 when a method is LOSSY (an output
differs from vanilla's), 2 on invalid input.
"""


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``selfspec`` subparsers."""
    from ..bench.spec import methods_help

    p = sub.add_parser(
        "bench",
        help="benchmark methods against vanilla and transformers on a dataset",
        description="Benchmark decoding methods on the same prompts: speedup, M, acceptance, memory, lossless. "
        + methods_help(),
        epilog=METHODS_SYNTAX,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dataset", help="xsum, humaneval, mtbench, spec-bench, structured (answers held to JSON "
                                       "schemas) or PATH.jsonl (default xsum)")
    src.add_argument("--stream", help="domain-shift stream: comma-separated datasets, e.g. xsum,humaneval,mtbench")
    p.add_argument("--limit", type=int, default=10, help="prompts (per task with --stream; default 10)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of each dataset (default 0)")
    p.add_argument("--categories", help="spec-bench: comma-separated categories (default all six: mt_bench, "
                   "translation, summarization, qa, math_reasoning, rag); --limit applies per category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--turns", type=int, default=1, choices=(1, 2),
                   help="2: second turns of two-turn questions (spec-bench's MT-bench category, or mtbench) as a "
                   "server sees them, each method with its prefix cache and without: time to first token and "
                   "tokens/s (default 1: first turns, every prompt prefilled whole)")  # fmt: skip
    p.add_argument("--clients", type=int, default=0,
                   help="load test: this many concurrent clients against `selfspec serve --parallel CLIENTS` (and "
                   "llama-server -np CLIENTS with llamacpp among the methods), beside one client and --parallel 1; "
                   "see selfspec.bench.load")  # fmt: skip
    p.add_argument("--requests", type=int, default=8, help="load test: requests per client (default 8)")
    p.add_argument("--methods", default="vanilla,asd", help='method specs, e.g. "vanilla,asd,hf" (see below)')
    add_sampling_args(p, seed_help="sampling seed; prompt i uses seed + i (default 0)", seed_default=0)
    p.add_argument("--out", type=Path, help="output directory (default runs/bench-<timestamp>)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last stdout line")
    p.add_argument("--warmup", type=int, default=1, help="warm-up prompts per method, discarded (default 1)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the whole run (default: torch's)")
    p.add_argument("--window", type=int, default=5, help="rolling window of the stream acceptance plot (default 5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--simulated", nargs="?", const="here", metavar="PROFILE",
                   help="time the run, and every decision in it, by a cost profile's costs of the passes made instead "
                   "of the wall clock: the same figures in every repeat and on every machine (ours only, no peers). "
                   "'here' (the default with no value): this machine's measured costs; 'read-bound': each pass costs "
                   "its weights' read; or a profile.json that an earlier simulated run wrote")
    p.add_argument("--llama-cpp", metavar="PATH",
                   help="llama-server binary (or its folder) for the llamacpp peer (default: PATH)")
    p.set_defaults(func=cmd_bench)
    return p


def _command_line(args: argparse.Namespace) -> str:
    """The exact command, rebuilt from the parsed arguments (defaults made explicit)."""
    argv = ["selfspec", "bench", "--model", args.model]
    argv += ["--stream", args.stream] if args.stream else ["--dataset", args.dataset or "xsum"]
    if args.categories:
        argv += ["--categories", args.categories]
    if args.offset:
        argv += ["--offset", str(args.offset)]
    argv += ["--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--methods", args.methods]
    argv += ["--warmup", str(args.warmup)]
    if args.turns != 1:
        argv += ["--turns", str(args.turns)]
    argv += sampling_argv(args)
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if args.device != "cpu":
        argv += ["--device", args.device]
    if args.dtype != "float32":
        argv += ["--dtype", args.dtype]
    if args.kernels != "auto":
        argv += ["--kernels", args.kernels]
    if args.quantize != "auto":
        argv += ["--quantize", args.quantize]
    if args.llama_cpp:
        argv += ["--llama-cpp", args.llama_cpp]
    if args.simulated:
        argv += ["--simulated", args.simulated]
    return shlex.join(argv)


def _check_args(args: argparse.Namespace) -> list[str]:
    """Validate everything that needs no model; returns the dataset names."""
    for name, value, low in (
        ("--limit", args.limit, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--warmup", args.warmup, 0),
        ("--offset", args.offset, 0),
        ("--window", args.window, 1),
        ("--clients", args.clients, 0),
        ("--requests", args.requests, 1),
    ):
        if value < low:
            raise InvalidInputError(f"{name} must be >= {low}, got {value}")
    sampling_params(args)  # validates the sampling options
    if args.threads is not None and args.threads < 1:
        raise InvalidInputError(f"--threads must be >= 1, got {args.threads}")
    names = [s.strip() for s in args.stream.split(",") if s.strip()] if args.stream else [args.dataset or "xsum"]
    if not names:
        raise InvalidInputError("--stream names no dataset")
    from ..datasets import load_prompts

    for name in names:  # unknown name or category, missing package or bad JSONL: fail before loading
        load_prompts(name, limit=1, chat=False, categories=_categories(args, name))
    return names


def _categories(args: argparse.Namespace, name: str) -> list[str] | None:
    """The --categories list for dataset ``name`` (Spec-Bench's only; given with no Spec-Bench, an error)."""
    from ..datasets import SPEC_BENCH

    datasets = [args.dataset] if args.dataset else [s.strip() for s in (args.stream or "").split(",")]
    categories = spec_bench_categories(args.categories, datasets)
    return categories if name == SPEC_BENCH else None


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..bench.report import dumps, print_summary, warn_lossy, write_outputs
    from ..bench.runner import run_benchmark, simulated_costs
    from ..bench.spec import parse_methods
    from ..bench.summary import summarize
    from ..bench.system import machine_info
    from ..datasets import load_prompts

    methods = parse_methods(args.methods)  # validated before the model loads
    names = _check_args(args)
    started = datetime.now().astimezone()
    out_dir = args.out or Path("runs") / f"bench-{started.strftime('%Y%m%d-%H%M%S')}"
    console = Console(stderr=True)

    if args.llama_cpp:
        import os

        from ..bench.llamacpp import ENV

        os.environ[ENV] = args.llama_cpp  # where the llamacpp peer looks first (after its own bin= option)
    if args.simulated and (args.turns == 2 or args.clients):
        raise InvalidInputError("--simulated times single runs of our methods; --turns 2 and --clients use the wall "
                                "clock (time to first token, a server's load)")  # fmt: skip
    if args.turns == 2:
        return _bench_turns(args, methods, names, started, out_dir, console)
    if args.clients:
        return _bench_load(args, methods, names, started, out_dir, console)
    model = load_model(args)
    chat = model.has_chat_template
    prompts = [p for name in names for p in load_prompts(name, limit=args.limit, chat=chat, offset=args.offset,
                                                         categories=_categories(args, name))]  # fmt: skip
    profile, clock_name = simulated_costs(model, args.simulated) if args.simulated else (None, None)
    console.print(
        f"selfspec bench: {model.name}, {len(prompts)} prompts x {len(methods)} methods "
        f"({', '.join(m.label for m in methods)}), {args.max_new_tokens} new tokens"
        + (f", simulated clock: {clock_name}" if profile is not None else ""),
        highlight=False,
    )
    result = run_benchmark(
        model,
        prompts,
        methods,
        args.max_new_tokens,
        warmup=args.warmup,
        threads=args.threads,
        progress=not args.no_progress,
        sampling=sampling_params(args),
        simulated=profile,
        simulated_name=clock_name,
    )
    meta = {
        "dataset": None if args.stream else names[0],
        "stream": names if args.stream else None,
        "limit": args.limit,
        "offset": args.offset,
        "device": args.device,
        "dtype": args.dtype,
        "date": started.isoformat(timespec="seconds"),
        "command": _command_line(args),
        "machine": machine_info(),
        "out_dir": str(out_dir),
    }
    summary = summarize(result, meta=meta, stream=bool(args.stream), window=args.window)
    paths = write_outputs(result, summary, out_dir)
    if profile is not None:  # the costs the run was timed with: --simulated FILE replays it, here or elsewhere
        paths["profile"] = out_dir / "profile.json"
        profile.write(paths["profile"])

    print_summary(summary, console)
    warn_lossy(summary, console)
    console.print(f"outputs: {out_dir}/ ({', '.join(p.name for p in paths.values())})", highlight=False)
    if args.json:
        sys.stdout.write(dumps(summary.to_dict()) + "\n")
        sys.stdout.flush()
    return 1 if summary.lossy else 0


def _bench_turns(args: argparse.Namespace, methods, names: list[str], started, out_dir: Path, console) -> int:
    """``--turns 2`` (see :mod:`selfspec.bench.turns`)."""
    from ..bench.report import dumps
    from ..bench.system import machine_info
    from ..bench.turns import print_turns, run_turns, summarize_turns, two_turn_questions, write_turns

    if args.stream or len(names) != 1:
        raise InvalidInputError("--turns 2 takes one --dataset (spec-bench or mtbench), not --stream")
    questions = two_turn_questions(names[0], limit=args.limit, offset=args.offset)
    model = load_model(args)
    console.print(f"selfspec bench: {model.name}, second turns of {len(questions)} questions x {len(methods)} "
                  f"methods, {args.max_new_tokens} new tokens per turn", highlight=False)  # fmt: skip
    progress = None if args.no_progress else (lambda what: console.print(f"  {what}", highlight=False))
    records = run_turns(model, questions, methods, args.max_new_tokens, sampling_params(args), progress)
    summary = summarize_turns(records)
    meta = {"dataset": names[0], "turns": 2, "limit": args.limit, "offset": args.offset, "command": _command_line(args),
            "date": started.isoformat(timespec="seconds"), "machine": machine_info()}  # fmt: skip
    paths = write_turns(records, summary, meta, out_dir)
    print_turns(summary, console)
    console.print(f"outputs: {out_dir}/ ({', '.join(p.name for p in paths)})", highlight=False)
    if args.json:
        sys.stdout.write(dumps({"meta": meta, "methods": summary}) + "\n")
        sys.stdout.flush()
    return 0 if all(s["identical"] for s in summary.values()) else 1


MODEL_OPTIONS = ("model", "device", "dtype", "kernels", "quantize", "prefill_dtype", "activations")


def _bench_load(args: argparse.Namespace, methods, names: list[str], started, out_dir: Path, console) -> int:
    """``--clients N`` (see :mod:`selfspec.bench.load`)."""
    import torch

    from ..bench import load
    from ..bench.llamacpp import find_binary, gguf_file
    from ..bench.report import dumps
    from ..bench.system import machine_info
    from ..datasets import load_prompts

    if args.stream or len(names) != 1:
        raise InvalidInputError("--clients takes one --dataset, not --stream")
    plain = sampling_params(args)
    if args.turns != 1 or not plain.greedy or plain.penalised:
        raise InvalidInputError("--clients runs greedy first turns (no --turns 2, no sampling options)")
    model = load_model(args)  # its errors before any server starts; its tokenizer says chat or text
    prompts = load_prompts(names[0], limit=args.limit, chat=model.has_chat_template, offset=args.offset,
                           categories=_categories(args, names[0]))  # fmt: skip
    work = load.split_work(prompts, args.clients, args.requests)
    model_args = [a for opt in MODEL_OPTIONS if (v := getattr(args, opt, None)) is not None
                  for a in (f"--{opt.replace('_', '-')}", str(v))]  # fmt: skip
    progress = (lambda what: None) if args.no_progress else (lambda what: console.print(f"  {what}", highlight=False))
    console.print(f"selfspec bench: {model.name}, {args.clients} clients x {args.requests} requests, "
                  f"{args.max_new_tokens} new tokens each", highlight=False)  # fmt: skip
    runs = []
    for method in methods:
        if method.name == "llamacpp":
            binary = find_binary(method.options.get("bin"))
            if binary is None:
                console.print("  llamacpp: no llama-server found (--llama-cpp PATH); skipped", highlight=False)
                continue
            context = min(model.max_context, 4096)
            threads = int(method.options.get("threads", args.threads or torch.get_num_threads()))
            runs += load.bench_llamacpp(binary, gguf_file(model, method.options.get("gguf")), threads, context, work,
                                        args.max_new_tokens, progress)  # fmt: skip
        elif method.is_peer or method.options:
            raise InvalidInputError(f"--clients serves our methods by name (and llamacpp), not '{method.label}'")
        else:
            runs += load.bench_method(method.name, model_args, work, args.max_new_tokens, model.name, progress)
    result = {"meta": {"dataset": names[0], "clients": args.clients, "requests": args.requests,
                       "max_new_tokens": args.max_new_tokens, "command": _command_line(args),
                       "date": started.isoformat(timespec="seconds"), "machine": machine_info()},
              **load.compare(runs)}  # fmt: skip
    path = load.write(result, out_dir)
    load.print_table(result["runs"], console)
    console.print(f"outputs: {path}", highlight=False)
    if args.json:
        sys.stdout.write(dumps(result) + "\n")
        sys.stdout.flush()
    identical = all(r.get("identical", "1/1").split("/")[0] == r.get("identical", "1/1").split("/")[1]
                    for r in result["runs"])  # fmt: skip
    return 0 if identical and not any(r["errors"] for r in result["runs"]) else 1
