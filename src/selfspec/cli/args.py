"""Command-line options shared by several commands (``generate``, ``kernels``, ``search``, ``train-s3d``,
``bench``): one definition, so that a new loading option reaches every command that loads a model, and a new
sampling option every command that samples."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --kernels, --quantize, --prefill-dtype, --activations, --kv-cache: every command
    that loads a model."""
    p.add_argument("--model", default="smollm2-135m", help="built-in name, HF directory, .gguf file or hub id")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--kernels", default="auto", choices=("auto", "torch"),
                   help="linear kernels: measured fastest on this machine (auto, default) or torch's own")
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "int8", "int4"),
                   help="weights: auto keeps a GGUF's quantised types (default), none dequantises to --dtype, "
                        "int8/int4 quantise the linear layers of any model (weight-only, CPU)")
    p.add_argument("--prefill-dtype", default=None, choices=("float32", "bfloat16"),
                   help="quantised weights: the prompt's products in float32 (default: outputs equal the "
                        "dequantised model's) or bfloat16 (4x faster on CPUs with AVX512-BF16/AMX; outputs part "
                        "from the fp32 model's after some dozens of tokens)")
    p.add_argument("--activations", default=None, choices=("auto", "int8", "float32"),
                   help="quantised weights: decoding products quantise their activations to int8 as llama.cpp does "
                        "(auto, default, wherever the native kernels build: 2.5-5x faster products "
                        "of several rows; keys and values then cached as halves, as llama.cpp's default cache) "
                        "or keep them float32 (outputs equal the dequantised model's within rounding)")
    p.add_argument("--kv-cache", default=None, choices=("auto", "f16", "f32", "q8_0"),
                   help="quantised weights: how keys and values are cached: auto (default: halves under int8 "
                        "activations, else float32), f16, f32, or q8_0 (8-bit blocks: 56%% of the halves' bytes, "
                        "for long contexts and several requests at once; logits move by the codes' rounding)")


def load_model(args: argparse.Namespace):
    """The model the options of :func:`add_model_args` name; on a terminal, a spinner on stderr while it loads (a
    7B file takes 10-15 s on 2 cores)."""
    import contextlib

    from rich.console import Console

    from ..model.models import load

    console = Console(stderr=True)
    waiting = console.status(f"loading {args.model}") if console.is_terminal else contextlib.nullcontext()
    with waiting:
        return load(args.model, device=args.device, dtype=args.dtype, kernels=args.kernels, quantize=args.quantize,
                    prefill_dtype=getattr(args, "prefill_dtype", None),
                    activations=getattr(args, "activations", None),
                    kv_cache=getattr(args, "kv_cache", None))  # fmt: skip


def spec_bench_categories(categories: str | None, datasets: list[str]) -> list[str] | None:
    """The ``--categories`` option as a list (None when not given), refused unless one of ``datasets`` (the named
    dataset, or a stream's) is Spec-Bench, the one dataset with categories."""
    if not categories:
        return None
    from ..datasets import SPEC_BENCH
    from ..errors import InvalidInputError

    if SPEC_BENCH not in datasets:
        raise InvalidInputError("--categories applies to --dataset spec-bench only")
    return [c.strip() for c in categories.split(",") if c.strip()]


def add_sampling_args(p: argparse.ArgumentParser, seed_help: str = "makes a sampled run reproducible",
                      seed_default: int | None = None) -> None:  # fmt: skip
    """--temperature, --top-p, --top-k, --min-p, the penalties, --seed, --sampling-scheme."""
    g = p.add_argument_group("sampling (default greedy; every method samples exactly from the model's distribution)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus cut (default 1: none)")
    g.add_argument("--top-k", type=int, default=0, help="top-k cut (default 0: none)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p cut (default 0: none)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty (default 1: none)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's: subtracted from each token the output holds (-2 to 2; default 0)")  # fmt: skip
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's: times how often the output holds the token (-2 to 2; default 0)")  # fmt: skip
    g.add_argument("--seed", type=int, default=seed_default, help=seed_help)
    g.add_argument("--sampling-scheme", choices=("coupled", "rejection"), default="coupled",
                   help="coupled (default): Gumbel-max noise per output position, so a seed gives exactly vanilla "
                        "sampling's tokens; rejection: classic speculative sampling")  # fmt: skip


def sampling_params(args: argparse.Namespace):
    """The parsed sampling options as :class:`~selfspec.core.sampling.SamplingParams` (validated)."""
    from ..core.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.min_p, args.repetition_penalty,
                          args.sampling_scheme, args.presence_penalty, args.frequency_penalty)  # fmt: skip


def sampling_argv(args: argparse.Namespace) -> list[str]:
    """The sampling options as command-line words (empty when plain greedy), to print a run's exact command."""
    penalties = [(flag, value, neutral) for flag, value, neutral in (
        ("--repetition-penalty", args.repetition_penalty, 1.0),
        ("--presence-penalty", getattr(args, "presence_penalty", 0.0), 0.0),
        ("--frequency-penalty", getattr(args, "frequency_penalty", 0.0), 0.0)) if value != neutral]  # fmt: skip
    argv = []
    if args.temperature:
        argv = ["--temperature", str(args.temperature), "--seed", str(args.seed)]
        for flag, value, neutral in (("--top-p", args.top_p, 1.0), ("--top-k", args.top_k, 0),
                                     ("--min-p", args.min_p, 0.0), ("--sampling-scheme", args.sampling_scheme,
                                                                    "coupled")):  # fmt: skip
            if value != neutral:
                argv += [flag, str(value)]
    for flag, value, _ in penalties:  # (greedy choices take the penalties too)
        argv += [flag, str(value)]
    return argv
