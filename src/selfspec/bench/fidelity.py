"""How close quantised weights kept in their GGUF types come to the same file dequantised, and to llama.cpp.

For a few prompts of a dataset, with the model loaded twice from one GGUF file
(``quantize="auto"``: our quantised kernels; ``quantize="none"``: transformers'
dequantisation to fp32):

* the prompt's next-token logits at every position: largest absolute difference and
  mean KL(p_fp32 || p_quantised);
* greedy outputs: the first token where ours differs from the dequantised model's, and
  from llama.cpp's on the same file (where ``llama-server`` is found, see
  :mod:`selfspec.bench.llamacpp`).

Run::

    python -m selfspec.bench.fidelity --model gemma3-270m --dataset humaneval --limit 5 \\
        --max-new-tokens 32 --llama-cpp ~/.cache/llama-cpp-reference/bin

It prints a markdown table (the README quotes one).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from ..core.sampling import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.engine.new_cache(len(ids) + 1)
    return model.engine.forward(cache, torch.tensor(ids), 0, prefill=True).double()


def compare(model_q, model_f, prompts, max_new_tokens: int, llama_cpp: str | None) -> list[dict]:
    from ..api import generate
    from . import llamacpp

    rows = []
    for item in prompts:
        ids = model_q.encode(item.prompt)
        lq, lf = prompt_logits(model_q, ids), prompt_logits(model_f, ids)
        kl = torch.sum(torch.softmax(lf, -1) * (torch.log_softmax(lf, -1) - torch.log_softmax(lq, -1)), -1)
        ours = list(generate(model_q, item.prompt, "vanilla", max_new_tokens=max_new_tokens).token_ids)
        ref = list(generate(model_f, item.prompt, "vanilla", max_new_tokens=max_new_tokens).token_ids)
        row = {"prompt": item.id, "tokens": len(ids), "max_abs": float((lq - lf).abs().max()),
               "kl": float(kl.mean()), "vs_fp32": first_difference(ours, ref), "vs_llamacpp": "n/a"}  # fmt: skip
        if llamacpp.find_binary(llama_cpp) is not None:
            theirs, _ = llamacpp.run(model_q, {"bin": llama_cpp}, ids, max_new_tokens, SamplingParams())
            row["vs_llamacpp"] = first_difference(ours, theirs)
        rows.append(row)
    return rows


def format_rows(rows: list[dict], max_new_tokens: int) -> str:
    def where(v) -> str:
        return "identical" if v is None else str(v)

    lines = ["| prompt | prompt tokens | max abs logit diff | mean KL (nats) | first diff vs fp32 | "
             "first diff vs llama.cpp |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['tokens']} | {r['max_abs']:.2e} | {r['kl']:.1e} | {where(r['vs_fp32'])} "
                     f"| {where(r['vs_llamacpp'])} |")  # fmt: skip
    same_fp32 = sum(r["vs_fp32"] is None for r in rows)
    same_llama = sum(r["vs_llamacpp"] is None for r in rows)
    lines.append(f"\n{len(rows)} prompts, {max_new_tokens} greedy tokens: identical to the dequantised fp32 model "
                 f"in {same_fp32}, to llama.cpp in {same_llama}; largest logit difference "
                 f"{max(r['max_abs'] for r in rows):.2e}, median KL {statistics.median(r['kl'] for r in rows):.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..datasets import load_prompts
    from ..errors import SelfspecError
    from ..model.models import load

    p = argparse.ArgumentParser(prog="python -m selfspec.bench.fidelity", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", help="built-in name or .gguf file")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--llama-cpp", help="llama-server binary or its folder (default: $SELFSPEC_LLAMA_CPP or PATH)")
    args = p.parse_args(argv)
    try:
        model_q = load(args.model)
        if model_q.quantization == "none":
            raise SelfspecError(f"{args.model} is not held quantised; nothing to compare")
        model_f = load(args.model, quantize="none")
        prompts = load_prompts(args.dataset, limit=args.limit, chat=model_q.has_chat_template)
        rows = compare(model_q, model_f, prompts, args.max_new_tokens, args.llama_cpp)
    except SelfspecError as exc:
        print(f"selfspec: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} ({model_q.quantization}), {args.dataset}\n")
    print(format_rows(rows, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
