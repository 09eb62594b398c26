"""The central invariant on the real built-in models: greedy output of every method equals vanilla's,
and vanilla equals transformers' own ``model.generate(do_sample=False)``.

These load SmolLM2-135M-Instruct and Gemma 3 270M (converted once from their GGUF files and cached).
"""

from __future__ import annotations

import pytest
from conftest import hf_greedy

import selfspec
from selfspec.core.quant import activations
from selfspec.datasets import load_prompts

pytestmark = [pytest.mark.slow, pytest.mark.threads]  # (threads: as a user's run does)

NEW = 48


def assert_vanilla_is_transformers(model, prompt, ids, new: int) -> None:
    """Our vanilla decoding gives transformers' ``generate`` tokens, with fp32 activations: under int8 ones
    (the default here) the two paths' last-bit differences in norms and attention flip some roundings to int8,
    and their logits part by a few percent (test_int8_kernels.py), so that comparison checks nothing."""
    with activations("float32"):
        out = selfspec.generate(model, prompt, "vanilla", max_new_tokens=new)
        assert list(out.token_ids) == hf_greedy(model, ids, new)


def _prompts(chat: bool):
    return [
        load_prompts("xsum", limit=1, chat=chat)[0],
        load_prompts("humaneval", limit=1, offset=7, chat=chat)[0],
        load_prompts("mtbench", limit=1, offset=3, chat=chat)[0],
    ]


METHODS = [
    ("asd", {}),  # the paper's values
    ("asd", {"alpha": 0.999, "m": 5}),
    ("asd", {"variant": "r1+r2", "m": 4, "draft_length": 6}),
    ("static", {"skip_set": {"attention": [3, 6, 9, 12, 15, 18, 21], "mlp": [4, 8, 12, 16, 20]}}),
    ("pld", {}),  # drafts copied from the history, length priced with measured costs
    ("suffix", {}),  # frequency-weighted trees from the history and the session's earlier outputs
    ("lookahead", {}),  # n-grams of its own Jacobi iterations, generated and verified in one pass
]


@pytest.mark.parametrize("item", _prompts(chat=True), ids=lambda p: p.task)
def test_smollm2_all_methods_identical(smollm2, item):
    ids = smollm2.encode(item.prompt)
    assert_vanilla_is_transformers(smollm2, item.prompt, ids, NEW)
    base = selfspec.generate(smollm2, item.prompt, "vanilla", max_new_tokens=NEW)
    for method, options in METHODS:
        out = selfspec.generate(smollm2, item.prompt, method, max_new_tokens=NEW, **options)
        assert out.token_ids == base.token_ids, (method, options)
        assert out.stats.drafted > 0


def test_gemma3_long_prompt_all_methods_identical(gemma3):
    """A prompt longer than Gemma 3's 512-token sliding window, raw text (base model)."""
    items = load_prompts("xsum", limit=200, chat=False)
    item = max(items, key=lambda p: len(p.prompt))
    ids = gemma3.encode(item.prompt)
    assert len(ids) > 600
    assert_vanilla_is_transformers(gemma3, item.prompt, ids, 32)
    base = selfspec.generate(gemma3, item.prompt, "vanilla", max_new_tokens=32)
    for method, options in [("asd", {}), ("static", {"skip_set": {"attention": [2, 5, 8, 11], "mlp": [3, 9]}}),
                            ("pld", {"draft_length": 4}), ("lookahead", {})]:  # fmt: skip
        out = selfspec.generate(gemma3, item.prompt, method, max_new_tokens=32, **options)
        assert out.token_ids == base.token_ids, (method, options)


def test_gemma3_short_code_prompt(gemma3):
    item = load_prompts("humaneval", limit=1, chat=False)[0]
    assert_vanilla_is_transformers(gemma3, item.prompt, gemma3.encode(item.prompt), 32)
    base = selfspec.generate(gemma3, item.prompt, "vanilla", max_new_tokens=32)
    out = selfspec.generate(gemma3, item.prompt, "asd", max_new_tokens=32, alpha=0.995)
    assert out.token_ids == base.token_ids


SWIFT_VARIANTS = [
    {"context_window": 16, "budget": 1.0},  # ours: adaptive ratio, cost-aware drafting, token trees
    {"context_window": 16, "budget": 1.0, "tree": False, "draft_dtype": "same"},
    {"context_window": 16, "budget": 1.0, "schedule": "paper", "skip_ratio": 0.2, "objective": "matchness"},
]


@pytest.mark.parametrize("options", SWIFT_VARIANTS, ids=["ours", "chain-same-precision", "paper"])
def test_smollm2_swift_stream_identical(smollm2, options):
    """One SWIFT session over prompts of three tasks (its skip set carries over): every output is vanilla's."""
    session = selfspec.Session(smollm2, "swift", **options)
    for item in _prompts(chat=True):
        base = selfspec.generate(smollm2, item.prompt, "vanilla", max_new_tokens=NEW)
        out = session.generate(item.prompt, max_new_tokens=NEW)
        assert out.token_ids == base.token_ids, (item.task, options)
    assert session.skip_policy.state.steps > 0


def test_gemma3_swift_long_prompt_identical(gemma3):
    items = load_prompts("xsum", limit=200, chat=False)
    long_item = max(items, key=lambda p: len(p.prompt))
    code = load_prompts("humaneval", limit=1, chat=False)[0]
    session = selfspec.Session(gemma3, "swift", context_window=16, budget=1.0)
    for item in (long_item, code):
        base = selfspec.generate(gemma3, item.prompt, "vanilla", max_new_tokens=32)
        out = session.generate(item.prompt, max_new_tokens=32)
        assert out.token_ids == base.token_ids


@pytest.mark.usefixtures("fp32_activations")  # the reference enumerates with transformers' forward (see above)
def test_smollm2_sampling_is_exact(smollm2):
    """SWIFT (rejection scheme) with fp16 drafts and cost-aware token trees samples the real model's
    distribution of its first three tokens (top-k 3: 27 outcomes, enumerated with transformers), by
    chi-square over seeded decodings."""
    from test_sampling import CORRECT_P, chi_square_p, exact_distribution, sample_outputs

    from selfspec.core.sampling import SamplingParams

    prompt = smollm2.encode([{"role": "user", "content": "Name a colour and an animal."}])
    params = SamplingParams(1.0, top_k=3, scheme="rejection")
    n = 400
    # a fixed draft length: whether the cost-aware exit drafts at all depends on measured times
    counts, verified, drafted = sample_outputs(smollm2, "swift", {"context_window": 2, "draft_length": 2}, params,
                                               n=n, prompt=prompt, new=3)  # fmt: skip
    assert drafted >= n
    assert chi_square_p(counts, exact_distribution(smollm2, params, prompt=prompt, new=3), n) > CORRECT_P


SAMPLED_METHODS = [("asd", {}), ("swift", {}), ("pld", {}), ("lookahead", {}),
                   ("static", {"skip_set": {"attention": [3, 6, 9, 12], "mlp": [4, 8]}})]  # fmt: skip


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_seeded_sampling_is_vanilla_samplings_tokens(name, request):
    """Coupled sampling, the new lossless check under sampling: with one seed every method (SWIFT with its
    clock-driven default schedule included) emits exactly vanilla sampling's tokens, on both built-in models,
    at temperature 0.7 / top-p 0.9, at 1.0, and with top-k and a repetition penalty (which drafts over a
    draft vocabulary read through its columns)."""
    model = request.getfixturevalue(name)
    item = _prompts(chat=model.has_chat_template)[0]
    for kw in ({"temperature": 0.7, "top_p": 0.9, "seed": 1}, {"temperature": 1.0, "seed": 2},
               {"temperature": 0.8, "top_k": 40, "repetition_penalty": 1.2, "seed": 3},
               {"temperature": 0.9, "frequency_penalty": 0.6, "presence_penalty": 0.2, "seed": 4}):  # fmt: skip
        base = selfspec.generate(model, item.prompt, "vanilla", max_new_tokens=32, **kw)
        for method, options in SAMPLED_METHODS:
            out = selfspec.generate(model, item.prompt, method, max_new_tokens=32, **options, **kw)
            assert out.token_ids == base.token_ids, (name, method, kw)
        greedy = selfspec.generate(model, item.prompt, "vanilla", max_new_tokens=32)
        assert greedy.token_ids != base.token_ids


@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.3},
                                       {"frequency_penalty": 0.8, "presence_penalty": 0.3}])  # fmt: skip
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_with_penalties_every_method_is_vanillas(name, penalties, request):
    """temperature 0 with a repetition penalty (applied, as transformers' greedy search applies it) or OpenAI's
    presence and frequency penalties: every method, drafts over the draft vocabulary included, gives vanilla's
    tokens."""
    model = request.getfixturevalue(name)
    item = _prompts(chat=model.has_chat_template)[0]
    base = selfspec.generate(model, item.prompt, "vanilla", max_new_tokens=40, **penalties)
    assert base.token_ids != selfspec.generate(model, item.prompt, "vanilla", max_new_tokens=40).token_ids
    for method, options in [*SAMPLED_METHODS, ("vocab", {}), ("lowbit", {}), ("auto", {})]:
        out = selfspec.generate(model, item.prompt, method, max_new_tokens=40, **penalties, **options)
        assert out.token_ids == base.token_ids, (name, method)


def test_smollm2_s3d_identical(smollm2, tmp_path):
    """An S3D adapter trained for a few steps on the default model: output is still exactly vanilla's."""
    from selfspec.train.s3d import train_s3d

    train_s3d(smollm2, tmp_path, steps=5, prompts=2, new_tokens=16, progress=False)
    for item in _prompts(chat=True)[:2]:
        base = selfspec.generate(smollm2, item.prompt, "vanilla", max_new_tokens=NEW)
        out = selfspec.generate(smollm2, item.prompt, "s3d", max_new_tokens=NEW, adapter=str(tmp_path))
        assert out.token_ids == base.token_ids, item.task
        assert out.stats.draft_forwards < out.stats.drafted


def test_chosen_kernels_give_the_tokens_of_torchs_own(smollm2_fp32):
    """The measured kernel plan (oneDNN etc.) decodes the same greedy tokens as torch's own kernels, and
    so does SWIFT, whose drafts and verification trees run many row counts through the chosen kernels
    (on fp32 weights: quantised ones have kernels of their own)."""
    model = smollm2_fp32
    assert model.kernel_report.plan().names(), "a CPU model gets a measured plan"
    plain = selfspec.model_from_hf(model.hf, model.tokenizer, name=model.name, kernels="torch")
    for item in _prompts(chat=model.has_chat_template)[:2]:
        fast = selfspec.generate(model, item.prompt, "vanilla", max_new_tokens=40)
        assert selfspec.generate(plain, item.prompt, "vanilla", max_new_tokens=40).token_ids == fast.token_ids
        assert selfspec.generate(model, item.prompt, "swift", max_new_tokens=40).token_ids == fast.token_ids


def test_the_pieces_count_every_token_whatever_rounds_it_came_in(smollm2):
    """A Spec-Bench answer that ends at the end-of-sequence token: vanilla produces that token alone in a round
    (no new text), auto beside other tokens; the pieces' counts (a server's usage) are the same for both and
    equal the generation's tokens."""
    item = next(p for p in load_prompts("spec-bench", limit=4, categories=["qa"]) if p.id == "qa-324")
    counts = []
    for method in ("vanilla", "auto"):
        session = selfspec.Session(smollm2, method, prefix_cache=0)
        pieces = list(session.pieces(item.prompt, max_new_tokens=128))
        result = session.last_result
        assert result.stats.stop_reason == "eos" and "".join(p.text for p in pieces) == result.text
        assert sum(p.tokens for p in pieces) == len(result.token_ids)
        counts.append(len(result.token_ids))
    assert counts[0] == counts[1]


def test_gguf_models_stop_at_their_end_of_turn_tokens_as_llama_cpp_does(smollm2, gemma3, tiny_llama):
    """A GGUF file's config names one end-of-sequence id; llama.cpp also ends a generation at the special tokens
    named like an end of turn (Gemma 3's ``<end_of_turn>``, ChatML's ``<|endoftext|>`` beside ``<|im_end|>``), and
    so do we, where the model came from a GGUF file: a Gemma 3 instruct file would otherwise run past its turn."""
    names = lambda m: {m.tokenizer.convert_ids_to_tokens(i) for i in m.eos_token_ids}  # noqa: E731
    assert names(gemma3) == {"<eos>", "<end_of_turn>"}
    assert names(smollm2) == {"<|im_end|>", "<|endoftext|>"}
    assert not tiny_llama.from_gguf and tiny_llama.eos_token_ids == frozenset(
        {tiny_llama.hf.generation_config.eos_token_id} | {tiny_llama.tokenizer.eos_token_id}) - {None}
    # stopping there is the loop's: the end-of-turn token is emitted, nothing after it
    prompt = gemma3.tokenizer("The end.")["input_ids"]
    first = selfspec.generate(gemma3, prompt, "vanilla", max_new_tokens=1).token_ids[0]
    gemma3.__dict__["_end_of_turn_ids"] = gemma3._end_of_turn_ids | {first}  # the cached property, widened
    try:
        out = selfspec.generate(gemma3, prompt, "vanilla", max_new_tokens=8)
        assert list(out.token_ids) == [first] and out.stats.stop_reason == "eos"
    finally:
        del gemma3.__dict__["_end_of_turn_ids"]
