"""Structured output (decoding/grammar.py): the output held to a grammar, and every method still lossless.

The grammar is part of the model (logits of forbidden tokens at -inf, per row, by that row's own output), so
greedy decoding and a seed give every method vanilla's tokens under it, and the rejection scheme samples the
constrained distribution (chi-square against an enumeration that asks a fresh matcher at every prefix).  The
matcher follows a round's rows by rolling back; that it answers as a fresh matcher does, for any order of rows,
is checked against one.  Real models: JSON that parses and matches its schema, every method equal to vanilla.
"""

from __future__ import annotations

import collections
import json
import random

import llguidance
import pytest
import torch
from conftest import tiny_model
from test_sampling import CORRECT_P, chi_square_p, exact_distribution, sample_outputs

import selfspec
from selfspec.core.sampling import SamplingParams
from selfspec.decoding import grammar
from selfspec.decoding.grammar import Constraint, _tokenizer
from selfspec.errors import InvalidInputError

PROMPT = [3, 4, 5, 6, 7, 3, 5]  # the 8-token model's ids (a-e)
PATTERN = "(ab|c)+d"  # ids: a 3, b 4, c 5, d 6; the end of sequence 2 once d is written


@pytest.fixture(scope="module")
def small_vocab():
    return tiny_model("llama", seed=3, vocab_size=8)


def _fresh_allowed(model, spec: str, output: list[int]) -> set[int] | None:
    """What a new matcher allows after ``output`` (None: the output is not in the grammar)."""
    m = llguidance.LLMatcher(_tokenizer(model), spec, log_level=0)
    if m.try_consume_tokens(list(output)) < len(output):
        return None
    allowed = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8).nonzero().flatten().tolist()
    return set(allowed) or None


def test_the_constraint_answers_as_a_fresh_matcher_in_any_order_of_rows(small_vocab):
    spec = grammar.regex(PATTERN)
    c = Constraint(small_vocab, spec, prompt_len=len(PROMPT))
    rng = random.Random(0)
    outputs = [[rng.choice([3, 4, 5, 6]) for _ in range(rng.randint(0, 7))] for _ in range(300)]
    outputs += [[3, 4] * k + [5] for k in range(1, 40)]  # long valid paths, rolled back far
    rng.shuffle(outputs)
    for out in outputs:
        got = c.allowed([*PROMPT, *out])
        want = _fresh_allowed(small_vocab, spec, out)
        assert (None if got is None else set(got.nonzero().flatten().tolist())) == want, out
    assert c.allowed([*PROMPT]).nonzero().flatten().tolist() == [3, 5]
    assert c.allowed([*PROMPT, 5, 6]).nonzero().flatten().tolist() == [2]  # complete: only the end


def test_the_constraint_masks_rows_and_a_subsets_columns(small_vocab):
    c = Constraint(small_vocab, grammar.regex(PATTERN), prompt_len=0)
    x = torch.zeros(3, 8)
    out = c.apply(x, [[], [3], [3, 3]])  # the last row follows a forbidden token: left alone
    assert torch.isinf(out[0]).tolist() == [i not in (3, 5) for i in range(8)]
    assert torch.isinf(out[1]).tolist() == [i != 4 for i in range(8)]
    assert not torch.isinf(out[2]).any() and not torch.isinf(x).any()
    ids = torch.tensor([5, 4, 7])  # a draft vocabulary's columns: c, b, e

    def columns(t):
        return torch.tensor([{5: 0, 4: 1, 7: 2}.get(int(i), -1) for i in t])

    sub = c.apply(torch.zeros(2, 3), [[], [3]], columns)
    assert torch.isinf(sub[0]).tolist() == [False, True, True]  # c allowed, b and e not
    assert torch.isinf(sub[1]).tolist() == [True, False, True]
    assert len(ids) == sub.shape[1]


@pytest.mark.parametrize("method, options", [
    ("pld", {"draft_length": 3}), ("asd", {"preset": "paper"}), ("lookahead", {}), ("suffix", {}),
    ("swift", {"schedule": "paper", "epsilon": 0.0, "max_draft": 3, "skip_ratio": 0.3, "draft_dtype": "same"}),
    ("static", {"skip_set": {"attention": [1, 3], "mlp": [2]}, "draft_length": 3}),
    ("auto", {"draft_dtype": "same"}),
])  # fmt: skip
def test_every_method_under_a_grammar_is_vanillas(tiny_llama, method, options):
    spec = grammar.regex(r"([a-e]{2,4} ){3,8}[0-9]+\.")
    prompt = "Write some words and a number: abc dd e 12."
    for kw in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 3}):
        base = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=40, grammar=spec, **kw)
        text = tiny_llama.decode(list(base.token_ids), skip_special=True).replace(" ", "")
        assert base.token_ids and set(text) <= set("abcde0123456789.")
        out = selfspec.generate(tiny_llama, prompt, method, max_new_tokens=40, grammar=spec, **options, **kw)
        assert out.token_ids == base.token_ids, kw
        assert out.stats.drafted > 0, kw
        free = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=40, **kw)
        assert free.token_ids != base.token_ids  # the grammar changed the answer: it was applied


@pytest.mark.parametrize("method", ["pld", "asd", "lookahead"])
def test_what_the_grammar_forces_is_drafted_for_free_and_changes_nothing(tiny_llama, method):
    """After "h" the grammar forces "ello": the decoder drafts it itself (no draft pass), every method still
    emits vanilla's tokens; vanilla decoding stays plain (one forward a token)."""
    spec = grammar.regex(r"(hello|world)( (hello|world)){3,6}\.")
    settings = [{}, {"temperature": 1.0, "seed": 11}]
    if method != "lookahead":  # (lookahead has no draft distributions: greedy and coupled only)
        settings.append({"temperature": 1.0, "seed": 12, "sampling_scheme": "rejection"})
    for kw in settings:
        base = selfspec.generate(tiny_llama, "say:", "vanilla", max_new_tokens=48, grammar=spec, **kw)
        assert base.stats.grammar_drafted == 0 and base.stats.forwards == base.stats.new_tokens
        out = selfspec.generate(tiny_llama, "say:", method, max_new_tokens=48, grammar=spec, **kw)
        if kw.get("sampling_scheme") != "rejection":  # (the rejection scheme is exact in distribution only)
            assert out.token_ids == base.token_ids, kw
        text = tiny_llama.decode(list(out.token_ids), skip_special=True).replace(" ", "")
        assert text.endswith(".") and set(text) <= set("helowrd.")
        assert out.stats.grammar_drafted >= 4 and out.stats.grammar_accepted == out.stats.grammar_drafted
        assert out.stats.forwards < base.stats.forwards


@pytest.mark.usefixtures("one_torch_thread")  # a tiny model's thousands of decodings: conftest.one_torch_thread
@pytest.mark.statistical
@pytest.mark.parametrize("scheme", ["rejection", "coupled"])
def test_sampling_under_a_grammar_is_exactly_the_constrained_distribution(small_vocab, scheme):
    params = SamplingParams(1.0, scheme=scheme, grammar=grammar.regex(PATTERN))
    expected = exact_distribution(small_vocab, params, prompt=PROMPT, new=4,
                                  allowed=lambda prefix: _fresh_allowed(small_vocab, params.grammar, list(prefix)))
    assert all(len(seq) == 4 or seq[-1] == 2 for seq in expected)
    n = 1500
    options = {"schedule": "paper", "epsilon": 0.0, "max_draft": 3, "skip_ratio": 0.3, "draft_dtype": "same",
               "context_window": 4}  # fmt: skip
    counts, _, drafted = sample_outputs(small_vocab, "swift", options, params, n=n, prompt=PROMPT, new=4)
    assert drafted > n // 2
    assert chi_square_p(counts, expected, n) > CORRECT_P
    pld, _, _ = sample_outputs(small_vocab, "pld", {"draft_length": 2, "max_ngram": 1}, params, n=n, prompt=PROMPT,
                               new=4)  # fmt: skip
    assert chi_square_p(pld, expected, n) > CORRECT_P
    # the same counts without the grammar are far from it: the test can tell
    free = collections.Counter(sample_outputs(small_vocab, "vanilla", {}, SamplingParams(1.0, scheme=scheme), n=n,
                                              prompt=PROMPT, new=4)[0])  # fmt: skip
    assert chi_square_p(free, expected, n) < 1e-6


def test_bad_grammars_are_refused_with_the_reason(small_vocab):
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        grammar.json_schema("{bad")
    with pytest.raises(InvalidInputError, match="JSON object"):
        grammar.json_schema("[1, 2]")
    with pytest.raises(InvalidInputError, match="non-empty"):
        grammar.regex("")
    with pytest.raises(InvalidInputError, match="non-empty"):
        grammar.choice([])
    with pytest.raises(InvalidInputError, match="does not compile"):
        selfspec.generate(small_vocab, PROMPT, "vanilla", max_new_tokens=4, grammar=grammar.lark("start: foo("))
    with pytest.raises(InvalidInputError, match="does not compile"):
        selfspec.generate(small_vocab, PROMPT, "vanilla", max_new_tokens=4,
                          grammar=grammar.json_schema({"type": "bogus"}))  # fmt: skip
    with pytest.raises(InvalidInputError, match="grammar"):
        SamplingParams(grammar="")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 120},
          "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_json_from_a_real_model_parses_matches_and_is_every_methods(name, request):
    model = request.getfixturevalue(name)
    prompt = [{"role": "user", "content": "Describe a fictional programmer as JSON: name, age, languages."}]
    if not model.has_chat_template:
        prompt = "A fictional programmer described as JSON with name, age and languages:\n"
    spec = grammar.json_schema(SCHEMA)
    base = selfspec.generate(model, prompt, "vanilla", max_new_tokens=120, grammar=spec)
    data = json.loads(model.decode(list(base.token_ids), skip_special=True))
    assert set(data) == {"name", "age", "languages"} and isinstance(data["age"], int)
    assert 0 <= data["age"] <= 120 and len(data["languages"]) <= 3
    assert base.token_ids[-1] in model.eos_token_ids  # complete: the grammar let it end
    for method in ("pld", "asd", "vocab", "swift", "lookahead", "auto"):
        out = selfspec.generate(model, prompt, method, max_new_tokens=120, grammar=spec)
        assert out.token_ids == base.token_ids, method
    kw = {"temperature": 0.8, "top_p": 0.95, "seed": 5}
    sampled = selfspec.generate(model, prompt, "vanilla", max_new_tokens=120, grammar=spec, **kw)
    json.loads(model.decode(list(sampled.token_ids), skip_special=True))
    for method in ("pld", "auto"):
        out = selfspec.generate(model, prompt, method, max_new_tokens=120, grammar=spec, **kw)
        assert out.token_ids == sampled.token_ids, method


@pytest.mark.slow
def test_a_choice_and_a_regular_expression_on_the_default_model(smollm2):
    prompt = [{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."}]
    out = selfspec.generate(smollm2, prompt, "auto", max_new_tokens=8, grammar=grammar.choice(["yes", "no"]))
    assert smollm2.decode(list(out.token_ids), skip_special=True) in ("yes", "no")
    date = selfspec.generate(smollm2, [{"role": "user", "content": "When did Apollo 11 land?"}], "pld",
                             max_new_tokens=16, grammar=grammar.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))  # fmt: skip
    text = smollm2.decode(list(date.token_ids), skip_special=True)
    assert len(text) == 10 and text[4] == text[7] == "-" and text.replace("-", "").isdigit()
