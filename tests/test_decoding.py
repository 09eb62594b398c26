"""The round loop against its protocols: a drafter without a skip policy, broken drafts, broken models, early stops."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

import selfspec
from selfspec.decoding.loop import Decoder
from selfspec.decoding.protocols import Drafter, DraftOutcome
from selfspec.decoding.trees import DraftTree
from selfspec.errors import SelfspecError

PROMPT = "abcabcabcabc the cat sat on the mat; the cat sat on the mat; the cat"


class PromptLookup:
    """A toy n-gram drafter: after the last token, copy what followed its previous occurrence in the history."""

    max_nodes = 1 + 4

    def __init__(self) -> None:
        self.rounds = 0
        self.observed = 0

    def bind(self, model, skip) -> None:
        assert skip is None  # no skip policy: nothing to skip

    def propose(self, history, *, model, cache, skip, budget, sampler):
        self.rounds += 1
        last = history[-1]
        for i in range(len(history) - 2, -1, -1):
            if history[i] == last:
                follow = list(history[i + 1 : i + 1 + min(4, budget)])
                if follow:
                    n = len(follow)
                    return DraftOutcome(DraftTree((last, *follow), tuple(range(-1, n))), [1.0] * n, {}, n)
        return None

    def observe(self, outcome, path, **_) -> None:
        self.observed += 1

    def precision(self, model):
        return None


def test_a_drafter_needs_no_skip_policy_and_sees_the_history(tiny_llama):
    prompt = tiny_llama.encode(PROMPT)
    vanilla = [t for new in Decoder(tiny_llama, prompt, max_new_tokens=40) for t in new]
    drafter = PromptLookup()
    assert isinstance(drafter, Drafter)
    dec = Decoder(tiny_llama, prompt, max_new_tokens=40, method="lookup", draft_policy=drafter)
    assert [t for new in dec for t in new] == vanilla
    assert drafter.rounds > 0 and drafter.observed == dec.stats.forwards - 1
    assert dec.stats.drafted > 0 and dec.stats.skip_set is None


def test_non_finite_draft_logits_fall_back_to_plain_decoding(monkeypatch):
    # a model of its own, under its own name: a cost profile measured with broken drafts must not be
    # cached under the shared tiny models' name
    tiny_llama = tiny_model("llama")
    tiny_llama.name = "tiny-llama-broken-drafts"
    base = selfspec.generate(tiny_llama, PROMPT, "vanilla", max_new_tokens=24)
    engine = tiny_llama.engine
    real = engine.forward

    def broken_draft(*args, **kwargs):
        out = real(*args, **kwargs)
        logits, vocab = out if kwargs.get("subset") else (out, None)
        skip = kwargs.get("skip")
        if skip is not None and len(skip):  # draft passes only: the full model stays sound
            logits = torch.full_like(logits, float("nan"))
        return (logits, vocab) if kwargs.get("subset") else logits

    monkeypatch.setattr(engine, "forward", broken_draft)
    # model-precision drafts and fixed or confidence lengths: no cost profile is measured (with broken drafts)
    static = {"skip_set": {"attention": [1, 2], "mlp": [2]}, "draft_length": 3, "draft_dtype": "same"}
    for method, opts in (("asd", {"draft_dtype": "same"}), ("static", static)):
        out = selfspec.generate(tiny_llama, PROMPT, method, max_new_tokens=24, **opts)
        assert out.token_ids == base.token_ids, method
        assert out.stats.drafted == 0, method  # every round fell back


def test_non_finite_full_model_logits_are_a_clear_error(tiny_llama, monkeypatch):
    engine = tiny_llama.engine
    real = engine.forward
    monkeypatch.setattr(engine, "forward", lambda *a, **k: torch.full_like(real(*a, **k), float("inf")))
    with pytest.raises(SelfspecError, match="NaN or infinite logits during prefill"):
        selfspec.generate(tiny_llama, PROMPT, "vanilla", max_new_tokens=4)


def test_an_abandoned_stream_still_saves_swift_state(tiny_llama, tmp_path):
    path = tmp_path / "swift.json"
    stream = selfspec.Session(tiny_llama, "swift", state=str(path)).stream(PROMPT, max_new_tokens=40)
    next(stream)
    stream.close()  # the consumer stops listening after the first piece
    assert path.is_file()
    assert json.loads(path.read_text())  # a complete JSON file, one entry per model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy's maxima, torch's
def test_the_finiteness_check_catches_one_nan_anywhere_and_allows_a_forbidden_token(dtype):
    from selfspec.decoding.loop import check_finite

    logits = torch.randn(4, 1000).to(dtype)
    check_finite(logits, "verification")
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[2, 777] = bad
        with pytest.raises(SelfspecError, match="during verification"):
            check_finite(broken, "verification")
    allowed = logits.clone()
    allowed[1, 5] = float("-inf")  # a token with probability 0
    check_finite(allowed, "verification")
    with pytest.raises(SelfspecError):
        check_finite(torch.full((1, 10), float("-inf"), dtype=dtype), "verification")  # no token possible at all
