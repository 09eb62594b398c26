"""Greedy output of every method equals vanilla's and transformers' on tiny random models of each architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

import selfspec

PROMPT = "The quick brown fox jumps over the lazy dog; sliding windows must hold over long prompts too."


def test_vanilla_matches_transformers_generate(tiny):
    ids = tiny.encode(PROMPT)
    assert len(ids) > 24, "the prompt must be longer than the tiny models' sliding windows"
    ours = selfspec.generate(tiny, PROMPT, "vanilla", max_new_tokens=48)
    assert list(ours.token_ids) == hf_greedy(tiny, ids, 48)
    assert ours.stats.mean_generated_length == 1.0
    assert ours.stats.forwards == ours.stats.new_tokens


@pytest.mark.parametrize(
    "method, options",
    [
        ("asd", {}),
        ("asd", {"alpha": 0.5}),  # skips nearly every attention sublayer: many rejections
        ("asd", {"variant": "cs"}),
        ("asd", {"variant": "cs+r2"}),
        ("asd", {"variant": "r1+r2", "m": 2}),
        ("asd", {"draft_length": 3, "preset": "paper"}),  # ADMG as published: drafts whatever the measured costs
        ("static", {"skip_set": {"attention": [1, 2, 3], "mlp": [2, 4]}}),
        ("static", {"skip_set": {"attention": [0, 1, 2, 3, 4], "mlp": [0, 1, 2, 3, 4]}, "max_draft": 5}),
        ("static", {"skip_set": {"attention": [], "mlp": []}, "draft_length": 4}),  # draft == full model
        ("pld", {"draft_length": 3}),
        ("pld", {"max_ngram": 2, "min_ngram": 1, "draft_length": 1}),
        ("suffix", {}),
        ("suffix", {"max_ngram": 2, "max_nodes": 6, "store_tokens": 0}),
        ("auto", {"draft_dtype": "same"}),  # ASD's choice as the layer-skip source
        ("auto", {"layerskip": "swift", "draft_dtype": "same", "schedule": "paper"}),
        ("lookahead", {}),
        ("lookahead", {"window": 2, "ngram_size": 2, "guesses": 0}),  # the smallest window, no pool
        ("lookahead", {"window": 4, "ngram_size": 5, "guesses": 8}),
    ],
)
def test_speculative_equals_vanilla(tiny, method, options):
    base = selfspec.generate(tiny, PROMPT, "vanilla", max_new_tokens=40)
    spec = selfspec.generate(tiny, PROMPT, method, max_new_tokens=40, **options)
    assert spec.token_ids == base.token_ids
    s = spec.stats
    assert s.new_tokens == len(spec.token_ids) == len(base.token_ids)
    assert s.drafted > 0 and 0 <= s.accepted <= s.drafted
    assert sum(s.accept_lengths) == s.accepted
    # every verification yields its accepted drafts plus one bonus token (the first token comes from prefill)
    assert s.new_tokens <= 1 + s.accepted + (s.forwards - 1)


def test_empty_skip_set_accepts_every_draft(tiny_llama):
    """With nothing skipped the draft *is* the full model: every drafted token must be accepted."""
    out = selfspec.generate(tiny_llama, PROMPT, "static", max_new_tokens=30, skip_set={"attention": [], "mlp": []},
                            draft_length=4)
    assert out.stats.drafted > 0
    assert out.stats.accepted == out.stats.drafted


def test_chat_prompt_and_stream_agree(tiny_llama):
    messages = [{"role": "user", "content": "Say something about foxes."}]
    result = selfspec.generate(tiny_llama, messages, "asd", max_new_tokens=25)
    pieces = list(selfspec.stream(tiny_llama, messages, "asd", max_new_tokens=25))
    assert "".join(pieces) == result.text
    assert len(pieces) >= 2


def test_stops_at_eos():
    from conftest import tiny_model

    model = tiny_model("llama", seed=3)
    eos = min(model.eos_token_ids)
    with_bias = model.hf.lm_head.weight.clone()
    try:
        # make EOS the most likely token once the context passes a few tokens (written through the parameter,
        # so that prepared kernel copies of it are refreshed)
        with torch.no_grad():
            model.hf.lm_head.weight[eos] = 5.0
        for method in ("vanilla", "asd"):
            out = selfspec.generate(model, PROMPT, method, max_new_tokens=20)
            assert out.token_ids[-1] == eos
            assert eos not in out.token_ids[:-1]
            assert out.stats.stop_reason == "eos"
    finally:
        with torch.no_grad():
            model.hf.lm_head.weight.copy_(with_bias)


def test_session_carries_draft_threshold_across_prompts(tiny_llama):
    session = selfspec.Session(tiny_llama, "asd", preset="paper")  # D&V's exit drafting every round
    gamma0 = session.draft_policy.length.gamma
    session.generate(PROMPT, max_new_tokens=30)
    gamma1 = session.draft_policy.length.gamma
    session.generate("Another prompt about something else entirely.", max_new_tokens=30)
    assert gamma1 != gamma0
    assert session.draft_policy.length.gamma != gamma1


def test_one_prefill_serves_many_decodings(tiny):
    """Decodings that reuse a prompt's prefill (as the skip-set search does) give the tokens of fresh ones."""
    from selfspec.decoding.loop import Decoder, prefill
    from selfspec.methods import build_policies

    ids = tiny.encode(PROMPT)
    pf = prefill(tiny, ids, max_new_tokens=30, max_nodes=13, cosine=True)
    runs = [("asd", {}), ("vanilla", {}), ("static", {"skip_set": {"attention": [1, 3], "mlp": [2]}}), ("asd", {})]
    for method, options in runs:
        fresh = selfspec.generate(tiny, PROMPT, method, max_new_tokens=30, **options)
        skip_policy, draft_policy = build_policies(method, options)
        decoder = Decoder(tiny, ids, max_new_tokens=30, method=method, skip_policy=skip_policy,
                          draft_policy=draft_policy, prefill=pf)
        reused = [t for new in decoder for t in new]
        assert tuple(reused) == fresh.token_ids, method
        assert decoder.stats.skip_set == fresh.stats.skip_set
    with pytest.raises(ValueError, match="another prompt"):
        Decoder(tiny, ids[:-1], max_new_tokens=5, prefill=pf)
    with pytest.raises(ValueError, match="this decoding needs"):
        Decoder(tiny, ids, max_new_tokens=31, method="asd", skip_policy=skip_policy, draft_policy=draft_policy,
                prefill=pf)


def test_greedy_with_a_repetition_penalty_is_transformers_greedy_search(tiny_llama):
    """temperature 0 with a repetition penalty: transformers' greedy search applies the penalty, and so does
    every method (it was ignored before 2026-11-27: a silently different answer)."""
    ids = tiny_llama.encode(PROMPT)
    x = torch.tensor([ids])
    with torch.inference_mode():
        want = tiny_llama.hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=40,
                                      repetition_penalty=1.4, eos_token_id=sorted(tiny_llama.eos_token_ids),
                                      pad_token_id=0, top_p=None, top_k=None, temperature=None)[0, len(ids):].tolist()
    assert want != hf_greedy(tiny_llama, ids, 40), "the penalty changes this answer"
    for method, options in (("vanilla", {}), ("pld", {"draft_length": 3}), ("asd", {"preset": "paper"}),
                            ("swift", {}), ("suffix", {})):  # fmt: skip
        ours = selfspec.generate(tiny_llama, PROMPT, method, max_new_tokens=40, repetition_penalty=1.4, **options)
        assert list(ours.token_ids) == want, method


def test_openai_presence_and_frequency_penalties_greedy_and_seeded(tiny_llama):
    """OpenAI's penalties on the generated tokens (logit - frequency x count - presence x [count > 0]): greedy
    output equals a hand-written greedy loop over transformers' logits, and every method gives vanilla's tokens,
    greedy and under seeded sampling."""
    from collections import Counter

    ids = tiny_llama.encode(PROMPT)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(32):
            logits = tiny_llama.hf(torch.tensor([ids + out])).logits[0, -1].float()
            for token, count in Counter(out).items():
                logits[token] -= 0.7 * count + 0.4
            out.append(int(logits.argmax()))
            if out[-1] in tiny_llama.eos_token_ids:
                break
    assert out != hf_greedy(tiny_llama, ids, len(out)), "the penalties change this answer"
    kw = {"presence_penalty": 0.4, "frequency_penalty": 0.7}
    for method, options in (("vanilla", {}), ("pld", {"draft_length": 3}), ("swift", {}), ("suffix", {})):
        ours = selfspec.generate(tiny_llama, PROMPT, method, max_new_tokens=32, **kw, **options)
        assert list(ours.token_ids) == out, method
    sampled = {**kw, "temperature": 0.8, "seed": 9}
    base = selfspec.generate(tiny_llama, PROMPT, "vanilla", max_new_tokens=32, **sampled)
    for method, options in (("pld", {"draft_length": 3}), ("swift", {}), ("asd", {"preset": "paper"})):
        assert selfspec.generate(tiny_llama, PROMPT, method, max_new_tokens=32, **sampled, **options).token_ids \
            == base.token_ids, method  # fmt: skip


def test_greedy_with_a_logit_bias_is_the_biased_argmax(tiny_llama):
    """OpenAI's logit_bias at temperature 0: the argmax of the biased logits (a hand-written loop over
    transformers' logits), every method alike."""
    ids = tiny_llama.encode(PROMPT)
    plain = hf_greedy(tiny_llama, ids, 24)
    bias = {plain[0]: -100.0, plain[3]: -30.0, 7: 2.5}
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(24):
            logits = tiny_llama.hf(torch.tensor([ids + out])).logits[0, -1].float()
            for token, b in bias.items():
                logits[token] += b
            out.append(int(logits.argmax()))
            if out[-1] in tiny_llama.eos_token_ids:
                break
    assert out != plain[: len(out)]
    for method, options in (("vanilla", {}), ("pld", {"draft_length": 3}), ("swift", {}), ("asd", {"preset": "paper"})):
        assert list(selfspec.generate(tiny_llama, PROMPT, method, max_new_tokens=24, logit_bias=bias,
                                      **options).token_ids) == out, method  # fmt: skip


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}])
def test_penalties_out_of_openais_range_are_refused(tiny_llama, bad):
    from selfspec.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="between -2 and 2"):
        selfspec.generate(tiny_llama, PROMPT, "vanilla", max_new_tokens=4, **bad)
