"""The CUDA path (torch's kernels; the fused CPU stack never runs there): every method keeps vanilla's greedy
tokens and seeded samples on tiny random models of three architectures, in float32 and bfloat16; concurrent
requests through one batcher (the server's slots) each get their tokens alone; a session's prefix store says
why it stays unused there and its turns equal fresh ones; the CLI takes ``--device cuda``; a grammar holds every
method there too.  Skipped without a
CUDA GPU (CI has none); run on one with ``pytest tests/test_cuda.py``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import char_tokenizer, tiny_config

import selfspec
from selfspec.api import Session
from selfspec.core.prefix_store import inexact_reason
from selfspec.core.sampling import SamplingParams
from selfspec.decoding.batch import StepBatcher
from selfspec.methods import METHODS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

SKIP_SET = {"attention": [1, 3], "mlp": [4]}  # for the methods that take a given set


def _cuda_model(arch: str, dtype: torch.dtype) -> selfspec.Model:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # sharper logits: greedy well defined, drafts can match
    return selfspec.model_from_hf(hf.to("cuda", dtype).eval(), char_tokenizer(), name=f"tiny-{arch}-{dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_every_method_keeps_vanillas_tokens_on_cuda(arch, dtype):
    model = _cuda_model(arch, dtype)
    assert model.engine.device.type == "cuda" and not model.engine.fused
    seeded = dict(temperature=0.7, top_p=0.9, seed=3)
    base = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=24).token_ids
    sampled = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=24, **seeded).token_ids
    drafted = 0
    for method in METHODS:
        if method in ("vanilla", "s3d", "lowbit"):  # s3d needs a trained adapter, lowbit a quantised model
            continue
        opts = {"skip_set": SKIP_SET} if method in ("static", "selfsd") else {}
        got = selfspec.generate(model, "Hello there", method, max_new_tokens=24, **opts)
        assert got.token_ids == base, method
        assert selfspec.generate(model, "Hello there", method, max_new_tokens=24, **opts, **seeded).token_ids == sampled
        drafted += got.stats.drafted
    assert drafted > 0, "some method drafted"


def test_load_takes_device_and_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    model = selfspec.load(str(tmp_path), device="cuda", dtype="bfloat16")
    assert model.engine.device.type == "cuda" and next(model.hf.parameters()).dtype == torch.bfloat16
    assert len(selfspec.generate(model, "Hi", "swift", max_new_tokens=8).token_ids) == 8


def test_concurrent_requests_on_cuda_get_their_tokens_alone():
    """The server's slots on a GPU: each request decodes in its own thread through one batcher (passes run the
    items in turn off the fused stack), a client leaves mid-stream, and every other request gets its tokens
    alone."""
    from test_batch import _alone, _run_together

    model = _cuda_model("llama", torch.float32)
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    jobs = [("vanilla", "The capital of France is", 24, SamplingParams(), None),
            ("pld", "def reverse(xs):\n    return", 32, SamplingParams(), None),
            ("asd", "Once upon a time", 24, SamplingParams(), None),
            ("auto", "List three colours: red,", 16, seeded, None),
            ("vanilla", "Hello there", 40, SamplingParams(), 3)]  # fmt: skip
    alone = _alone(model, jobs)
    batcher = StepBatcher(model.engine)
    together = _run_together(model, jobs, batcher)
    assert together.pop(4) == "left"
    assert together == alone
    assert batcher.stats.passes > 0 and batcher.members == 0


def test_a_session_on_cuda_says_why_its_prefix_store_is_unused_and_keeps_its_tokens():
    model = _cuda_model("qwen2", torch.float32)
    reason = inexact_reason(model.engine)
    assert reason is not None and "transformers' modules" in reason
    session = Session(model, "vanilla")
    assert not session.prefix_store.usable(model.engine)
    first = session.generate("Hello there", max_new_tokens=12)
    turn2 = "Hello there" + first.text + " And then"
    again = session.generate(turn2, max_new_tokens=12).token_ids
    assert again == Session(model, "vanilla", prefix_cache=0).generate(turn2, max_new_tokens=12).token_ids
    assert session.prefix_store.stats().hits == 0


def test_the_cli_generates_on_cuda(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from selfspec.cli import main

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--device", "cuda", "--prompt", "Hi", "--max-new-tokens", "8"]
    assert main([*args, "--method", "auto", "--compare", "--json"]) in (0, None)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["identical"] and len(report["token_ids"]) == 8


def test_penalties_and_logprobs_on_cuda():
    """Greedy and seeded sampling with the repetition, presence and frequency penalties keep vanilla's tokens
    on the GPU (the penalties' histories built on the logits' device); log-probabilities are reported for every
    token, a speculative method's close to vanilla's (rows of a verification pass round as a GPU's kernels do),
    and the prompt's are scored.  float32: in bfloat16 a verification pass's rows may round apart from one-token
    steps' (on a CPU, this test's bfloat16 twin once parted at a near-tie)."""
    from selfspec.decoding.logprobs import prompt_logprobs

    model = _cuda_model("llama", torch.float32)
    kw = {"repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.5}
    for extra in ({}, {"temperature": 0.8, "seed": 5}):
        base = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=24, logprobs=2, **kw, **extra)
        for method in ("pld", "swift", "asd"):
            got = selfspec.generate(model, "Hello there", method, max_new_tokens=24, logprobs=2, **kw, **extra)
            assert got.token_ids == base.token_ids, (method, extra)
            assert len(got.logprobs) == len(got.token_ids)
            assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in base.logprobs], abs=1e-3)
    ids = model.encode("Hello there, general")
    scored = prompt_logprobs(model, ids, top=1)
    assert len(scored) == len(ids) and scored[0].logprob is None and all(e.logprob <= 0 for e in scored[1:])


def test_a_grammar_holds_every_method_on_cuda():
    """Structured output on the GPU: the grammar's masks (made on the CPU) reach the logits' device; every
    method keeps vanilla's tokens under it, greedy and seeded, and forced tokens are drafted."""
    model = _cuda_model("llama", torch.float32)
    spec = selfspec.grammar.regex(r"(hello|world)( (hello|world)){3,6}\.")
    for extra in ({}, {"temperature": 0.9, "seed": 3}):
        base = selfspec.generate(model, "say:", "vanilla", max_new_tokens=48, grammar=spec, **extra)
        text = model.decode(list(base.token_ids), skip_special=True).replace(" ", "")
        assert set(text) <= set("helowrd.")
        for method in ("pld", "swift", "asd"):
            got = selfspec.generate(model, "say:", method, max_new_tokens=48, grammar=spec, **extra)
            assert got.token_ids == base.token_ids, (method, extra)
            assert got.stats.grammar_drafted > 0
