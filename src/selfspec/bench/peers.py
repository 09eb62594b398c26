"""Peers: the speed-ups a user gets from ``transformers.generate`` itself.

* ``hf``            -- plain greedy ``generate``;
* ``hf-lookup``     -- prompt lookup decoding (``prompt_lookup_num_tokens``);
* ``hf-early-exit`` -- self-speculation with the first K layers
  (``assistant_early_exit=K``), transformers' nearest built-in relative of ours.

To report the same statistics as our decoder, forward hooks on the HF model
count and time its forward calls: a call while the base model's
``config.num_hidden_layers`` is lowered is an early-exit *draft* call (that is
how transformers implements it), any other is a *full* call.  Per generation:

* the first full call is the prefill; every later one verifies ``T - 1``
  candidate tokens (``T`` = its input length), so ``drafted = sum(T - 1)``;
* each verification yields its accepted candidates plus one token, and the
  prefill one token, so ``accepted = new tokens - full calls`` (untrimmed
  output, before cutting at EOS);
* the first draft call is the drafter's own prefill over the prompt: its time
  counts as prefill, not as a draft forward.

Outputs are cut after the first EOS token, as our decoder stops there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.sampling import GREEDY, SamplingParams
from ..decoding.loop import GenerationStats
from ..errors import InvalidInputError
from ..model.models import Model
from . import llamacpp
from .spec import BenchMethod


@dataclass
class _Call:
    draft: bool
    tokens: int
    seconds: float = 0.0


@dataclass
class _Counter:
    calls: list[_Call] = field(default_factory=list)
    _t0: float = 0.0


def early_exit_layer(model: Model, method: BenchMethod) -> int:
    layer = int(method.options.get("layer", model.num_layers // 2))
    if not 1 <= layer < model.num_layers:
        raise InvalidInputError(
            f"method '{method.label}': layer must be in 1..{model.num_layers - 1} for a {model.num_layers}-layer model"
        )
    return layer


def check_peer(model: Model, method: BenchMethod) -> str | None:
    """Model-dependent checks, before any timing starts; returns why the peer is skipped here (None: it runs)."""
    if method.name == "hf-early-exit":
        early_exit_layer(model, method)
    if method.name == "llamacpp":
        return llamacpp.skip_reason(model, method.options)
    return None


def generate_kwargs(model: Model, method: BenchMethod) -> dict[str, Any]:
    opts = method.options
    if method.name == "hf-lookup":
        kw: dict[str, Any] = {"prompt_lookup_num_tokens": int(opts.get("tokens", 10))}
        if "ngram" in opts:
            kw["max_matching_ngram_size"] = int(opts["ngram"])
        return kw
    if method.name == "hf-early-exit":
        kw = {"assistant_early_exit": early_exit_layer(model, method)}
        if "tokens" in opts:
            kw["num_assistant_tokens"] = int(opts["tokens"])
        return kw
    return {}


@contextmanager
def _count_forwards(model: Model) -> Iterator[_Counter]:
    hf = model.hf
    base_config = getattr(hf, hf.base_model_prefix).config
    full_layers = base_config.num_hidden_layers
    counter = _Counter()

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        tokens = int(ids.shape[1]) if ids is not None else 0
        counter.calls.append(_Call(draft=base_config.num_hidden_layers < full_layers, tokens=tokens))
        counter._t0 = time.perf_counter()

    def after(module, args, kwargs, output):
        counter.calls[-1].seconds = time.perf_counter() - counter._t0

    handles = [
        hf.register_forward_pre_hook(before, with_kwargs=True),
        hf.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()


def _sampling_kwargs(sampling: SamplingParams) -> dict:
    if sampling.presence_penalty or sampling.frequency_penalty:
        raise InvalidInputError("transformers' generate has no presence or frequency penalty: the hf peers cannot "
                                "run with --presence-penalty / --frequency-penalty")  # fmt: skip
    if sampling.greedy:  # (transformers' greedy search applies the repetition penalty, as ours does)
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                "repetition_penalty": sampling.repetition_penalty}  # fmt: skip
    # top_k 0 switches transformers' top-k off (None would fall back to the model's default, often 50)
    return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "min_p": sampling.min_p or None, "repetition_penalty": sampling.repetition_penalty}


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate() warns about flags it set itself for assisted decoding
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def run_peer(model: Model, method: BenchMethod, prompt_ids: list[int], max_new_tokens: int,
             sampling: SamplingParams = GREEDY):  # fmt: skip
    """Generate with a transformers peer; returns (token ids, GenerationStats from the hooks).

    Under sampling, transformers draws from torch's global generator, seeded
    here with the prompt's seed (it offers no per-call generator).
    """
    if method.name == "llamacpp":
        return llamacpp.run(model, method.options, prompt_ids, max_new_tokens, sampling)
    eos = model.eos_token_ids
    pad = model.tokenizer.pad_token_id
    if pad is None:
        pad = min(eos) if eos else 0
    x = torch.tensor([prompt_ids], dtype=torch.long, device=model.engine.device)  # [1, S]
    if not sampling.greedy and sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    t0 = time.perf_counter()
    with _quiet_transformers(), _count_forwards(model) as counter, torch.inference_mode():
        out = model.hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
            **_sampling_kwargs(sampling),
            **generate_kwargs(model, method),
        )
    total = time.perf_counter() - t0
    raw = out[0, len(prompt_ids) :].tolist()
    ids = raw
    for i, t in enumerate(raw):
        if t in eos:
            ids = raw[: i + 1]
            break

    full = [c for c in counter.calls if not c.draft]
    draft = [c for c in counter.calls if c.draft]
    drafted = sum(c.tokens - 1 for c in full[1:])
    accepted = min(drafted, max(0, len(raw) - len(full)))
    skip_set = None
    if method.name == "hf-early-exit":
        k = early_exit_layer(model, method)
        top = list(range(k, model.num_layers))  # early exit = every sublayer above layer k skipped
        skip_set = {"attention": top, "mlp": top, "early_exit": k}
    stats = GenerationStats(
        method=method.name,
        prompt_tokens=len(prompt_ids),
        new_tokens=len(ids),
        forwards=len(full),
        draft_forwards=max(0, len(draft) - 1),
        drafted=drafted,
        accepted=accepted,
        prefill_time=(full[0].seconds if full else 0.0) + (draft[0].seconds if draft else 0.0),
        draft_time=sum(c.seconds for c in draft[1:]),
        verify_time=sum(c.seconds for c in full[1:]),
        total_time=total,
        stop_reason="eos" if ids and ids[-1] in eos else "length",
        skip_set=skip_set,
    )
    return ids, stats
