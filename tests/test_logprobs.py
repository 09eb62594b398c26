"""Log-probabilities of generated tokens (``logprobs``): the full model's own, whatever the method.

Checked against a teacher-forced forward over the prompt and the answer (transformers' own on a tiny model; our
engine's prompt pass on SmolLM2), and across methods: greedy and seeded sampling, every speculative method
reports what vanilla reports."""

from __future__ import annotations

import math

import pytest
import torch

import selfspec
from selfspec.decoding.logprobs import MAX_TOP, TokenLogprob, check_top, token_logprobs
from selfspec.errors import InvalidInputError

CHAT = [{"role": "user", "content": "List the planets of the solar system in order."}]


def _teacher_forced(model, prompt_ids: list[int], new: tuple[int, ...]) -> torch.Tensor:
    """log-softmax of our engine's logits at each new token's position, from one pass over prompt and answer."""
    engine = model.engine
    ids = torch.tensor([*prompt_ids, *new])
    cache = engine.new_cache(len(ids) + 1)
    logits = engine.forward(cache, ids, 0)  # [n, V]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : len(ids) - 1].float(), -1)


def _check_against(reference: torch.Tensor, got: tuple[TokenLogprob, ...], tokens: tuple[int, ...], tol: float):
    assert len(got) == len(tokens) == reference.shape[0]
    for row, entry, token in zip(reference, got, tokens, strict=True):
        assert entry.token == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=tol)
        values, _ = row.topk(len(entry.top))
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=tol)
        assert all(float(row[i]) == pytest.approx(lp, abs=tol) for i, lp in entry.top)


def test_token_logprobs_of_hand_made_logits():
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf], [2.0, 2.0, 2.0]])
    first, second = token_logprobs(logits, [1, 2], top=2)
    assert first.logprob == pytest.approx(math.log(0.75)) and first.token == 1
    assert [i for i, _ in first.top] == [1, 0] and first.top[1][1] == pytest.approx(math.log(0.25))
    assert second.logprob == pytest.approx(-math.log(3.0)) and len(second.top) == 2
    assert token_logprobs(logits, [0, 0], top=0)[0].top == ()
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(logits, [0], top=1)


@pytest.mark.parametrize("bad", [-1, MAX_TOP + 1, 2.5, True, "3"])
def test_a_bad_logprobs_value_is_refused_with_its_range(bad):
    with pytest.raises(InvalidInputError, match=f"between 0 and {MAX_TOP}"):
        check_top(bad)
    assert check_top(None) is None and check_top(0) == 0


def test_no_logprobs_unless_asked(tiny_llama):
    result = selfspec.generate(tiny_llama, [5, 6, 7, 8], "vanilla", max_new_tokens=4)
    assert result.logprobs is None


def test_logprobs_are_transformers_own_on_a_tiny_model(tiny_llama):
    """A tiny float32 model: the figures equal transformers' teacher-forced log-softmax (float32 rounding)."""
    prompt = [5, 9, 12, 7, 30, 11]
    for method in ("vanilla", "pld", "swift"):
        result = selfspec.generate(tiny_llama, prompt, method, max_new_tokens=12, logprobs=3)
        with torch.inference_mode():
            logits = tiny_llama.hf(torch.tensor([[*prompt, *result.token_ids]])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
        assert result.logprobs is not None
        _check_against(reference, result.logprobs, result.token_ids, tol=1e-4)


@pytest.mark.parametrize("method", ["pld", "asd", "vocab", "lowbit", "swift", "lookahead", "auto"])
def test_every_method_reports_vanillas_logprobs(smollm2, method):
    """Greedy on SmolLM2 (int8 engine): each method's tokens and figures are vanilla's (the same bits where a
    verification row is computed as a one-token row), and vanilla's are a teacher-forced pass's."""
    vanilla = selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=40, logprobs=4)
    ours = selfspec.generate(smollm2, CHAT, method, max_new_tokens=40, logprobs=4)
    assert ours.token_ids == vanilla.token_ids
    assert ours.stats.drafted > 0, "the method drafted: its figures came from verification rows"
    assert vanilla.logprobs is not None and ours.logprobs is not None
    if smollm2.engine.prompt_rows_exact:
        assert ours.logprobs == vanilla.logprobs
    else:
        _check_against(_as_rows(vanilla.logprobs), ours.logprobs, ours.token_ids, tol=1e-4)
    reference = _teacher_forced(smollm2, smollm2.encode(CHAT), vanilla.token_ids)
    _check_against(reference, vanilla.logprobs, vanilla.token_ids, tol=1e-4)


def _as_rows(entries: tuple[TokenLogprob, ...]) -> torch.Tensor:
    """Entries' chosen and top figures as rows of a log-probability table (the rest -inf), for comparison."""
    size = 1 + max(max(e.token, *(i for i, _ in e.top)) for e in entries)
    rows = torch.full((len(entries), size), -math.inf)
    for r, e in zip(rows, entries, strict=True):
        r[e.token] = e.logprob
        for i, lp in e.top:
            r[i] = lp
    return rows


def test_seeded_sampling_reports_vanillas_logprobs(smollm2):
    """Sampled (coupled, seeded): the same tokens as vanilla sampling, so the same figures; they are the
    model's own distribution, not the warped one tokens were drawn from (temperature does not change them)."""
    kw = {"max_new_tokens": 30, "temperature": 0.7, "top_p": 0.9, "seed": 11, "logprobs": 2}
    vanilla = selfspec.generate(smollm2, CHAT, "vanilla", **kw)
    ours = selfspec.generate(smollm2, CHAT, "asd", **kw)
    assert ours.token_ids == vanilla.token_ids and ours.logprobs == vanilla.logprobs
    reference = _teacher_forced(smollm2, smollm2.encode(CHAT), vanilla.token_ids)
    _check_against(reference, vanilla.logprobs, vanilla.token_ids, tol=1e-4)


def test_streamed_pieces_carry_their_tokens_logprobs(smollm2):
    session = selfspec.Session(smollm2, "pld", prefix_cache=0)
    pieces = list(session.pieces(CHAT, max_new_tokens=40, logprobs=1))
    result = session.last_result
    assert result is not None and result.logprobs is not None
    assert sum(p.tokens for p in pieces) == len(result.token_ids)
    assert tuple(e for p in pieces for e in p.logprobs) == result.logprobs
    assert all(len(p.logprobs) == p.tokens for p in pieces)


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])  # byte-level BPE; SentencePiece with byte fallback
def test_token_bytes_spell_the_text_a_character_split_over_tokens_included(fixture, request):
    from selfspec.arch.tokenizers import token_bytes

    model = request.getfixturevalue(fixture)
    text = "Héllo\n wörld 😀 the 🦜 end"
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    spell = token_bytes(model.tokenizer)
    assert b"".join(spell(i) for i in ids).decode() == text
    if fixture == "smollm2":  # its vocabulary splits the emoji's 4 bytes over two tokens
        assert any(not _utf8(spell(i)) for i in ids), "a token holding part of a character"


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_the_stop_scanner_gives_items_out_with_their_text_and_cuts_them_at_a_stop():
    from selfspec.server.worker import StopScanner

    scanner = StopScanner(["END"])
    text, stopped = scanner.feed("Hello wor", [(0, "Hello"), (5, " wor")])
    assert (text, stopped) == ("Hello w", False)  # "or" held back: it may be the start of "END"
    assert scanner.ready() == [(0, "Hello"), (5, " wor")], "an item goes out once its text has begun to"
    text, stopped = scanner.feed("ld. EN", [(0, "ld"), (2, "."), (3, " EN")])
    assert (text, stopped) == ("orld. ", False)
    assert scanner.ready() == [(9, "ld"), (11, "."), (12, " EN")]
    text, stopped = scanner.feed("D more", [(0, "D"), (1, " more")])
    assert (text, stopped) == ("", True)
    assert scanner.ready() == [], "no token from the stop string on"
    scanner = StopScanner(["END"])
    scanner.feed("oneE", [(0, "one"), (3, "E")])
    assert scanner.ready() == [(0, "one")], "a token whose text is held back waits"
    assert scanner.feed("ND", [(0, "ND")]) == ("e", True)
    assert scanner.ready() == [] and scanner.ready(everything=True) == []
    plain = StopScanner([])
    plain.feed("ab", [(0, "a"), (1, "b")])
    assert plain.ready() == [(0, "a"), (1, "b")]
    plain.feed("", [(0, "<eos>")])
    assert plain.ready() == [] and plain.ready(everything=True) == [(2, "<eos>")]


def test_prompt_logprobs_score_the_prompt_in_chunks_as_one_pass(smollm2, monkeypatch):
    """``echo``'s figures: each prompt token given those before it (the first has none), computed in chunks of
    rows; the same as one teacher-forced pass over the whole prompt."""
    from selfspec.decoding import logprobs as lp_module

    ids = smollm2.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    monkeypatch.setattr(lp_module, "PROMPT_CHUNK", 5)  # several chunks, one of them short
    entries = lp_module.prompt_logprobs(smollm2, ids, top=2)
    assert [e.token for e in entries] == ids and entries[0].logprob is None and entries[0].top == ()
    reference = _teacher_forced(smollm2, ids[:1], tuple(ids[1:]))
    _check_against(reference, tuple(entries[1:]), tuple(ids[1:]), tol=1e-4)
    greedy = selfspec.generate(smollm2, ids[:6], "vanilla", max_new_tokens=1, logprobs=2)
    scored = lp_module.prompt_logprobs(smollm2, [*ids[:6], *greedy.token_ids], top=2)
    assert greedy.logprobs is not None and scored[-1].token == greedy.logprobs[0].token
    if smollm2.engine.prompt_rows_exact:  # a continuation scored as the generation reported it
        assert scored[-1] == greedy.logprobs[0]
    assert scored[-1].logprob == pytest.approx(greedy.logprobs[0].logprob, abs=1e-4)


def test_bad_token_ids_get_a_clear_error(smollm2):
    for bad in ([1, 2, 10**9], [5, -1]):
        with pytest.raises(InvalidInputError, match="not in the model's vocabulary"):
            selfspec.generate(smollm2, bad, "vanilla", max_new_tokens=2)


def test_a_long_streamed_text_is_decoded_less_often_and_its_pieces_stay_exact(smollm2, monkeypatch):
    """Past STREAM_WHOLE_TOKENS tokens a text is decoded again only once STREAM_DECODE_SHARE of the time since went
    to decoding it: with a decoding made dear (5 ms), pieces hold several rounds' tokens, and they still join to the
    generation's text, count its tokens and carry its log-probabilities in order."""
    import time

    from selfspec import api

    real, calls = smollm2.decode, []

    def slow_decode(ids, *a, **kw):
        calls.append(len(ids))
        time.sleep(0.005)
        return real(ids, *a, **kw)

    monkeypatch.setattr(api, "STREAM_WHOLE_TOKENS", 4)
    monkeypatch.setattr(smollm2, "decode", slow_decode)
    session = selfspec.Session(smollm2, "vanilla")
    pieces = list(session.pieces(CHAT, max_new_tokens=40, logprobs=1))
    result = session.last_result
    assert len(result.token_ids) > 20
    assert len(calls) < len(result.token_ids) / 2  # (vanilla: one round a token; the first 4 decoded each round)
    assert "".join(p.text for p in pieces) == result.text == real(list(result.token_ids))
    assert sum(p.tokens for p in pieces) == len(result.token_ids)
    assert tuple(e for p in pieces for e in p.logprobs) == result.logprobs
