"""The benchmark harness behind ``selfspec bench``.

    from selfspec.bench import run_benchmark, summarize, write_outputs
    from selfspec.datasets import load_prompts

    model = selfspec.load("smollm2-135m")
    prompts = load_prompts("xsum", limit=5, chat=model.has_chat_template)
    result = run_benchmark(model, prompts, "vanilla,asd,hf", max_new_tokens=64)
    summary = summarize(result)
    write_outputs(result, summary, "runs/my-bench")

Modules: :mod:`.spec` (method specs), :mod:`.peers` (transformers peers),
:mod:`.runner` (fair timing), :mod:`.summary` (aggregation), :mod:`.report`
(files, plots, tables), :mod:`.system` (machine, peak memory), :mod:`.cli`.
"""

from __future__ import annotations

from .report import markdown_report, write_outputs
from .runner import BenchResult, PromptRecord, run_benchmark
from .spec import BenchMethod, parse_methods, parse_spec
from .summary import BenchSummary, MethodSummary, summarize

__all__ = [
    "BenchMethod",
    "BenchResult",
    "BenchSummary",
    "MethodSummary",
    "PromptRecord",
    "markdown_report",
    "parse_methods",
    "parse_spec",
    "run_benchmark",
    "summarize",
    "write_outputs",
]
