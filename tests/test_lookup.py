"""Prompt-lookup drafting: what it proposes, when it declines, and how it prices the draft length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from selfspec.core.sampling import GREEDY_SAMPLER
from selfspec.cost.economy import VerifyCurve
from selfspec.drafters.lookup import PromptLookupDrafter, smoothed_acceptance
from selfspec.errors import InvalidInputError


class FlatProfile:
    """Verification over T tokens costs ``1 + slope * (T - 1)`` one-token steps."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def forward(self, tokens: int) -> float:
        return 1.0 + self.slope * (tokens - 1)


def drafter(slope: float = 0.05, **kw) -> PromptLookupDrafter:
    d = PromptLookupDrafter(**kw)
    d._costs = VerifyCurve(FlatProfile(slope))
    return d


def propose(d: PromptLookupDrafter, history: list[int], budget: int = 20):
    return d.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=budget, sampler=GREEDY_SAMPLER)


def test_proposes_what_followed_the_latest_earlier_occurrence():
    d = drafter(draft_length=3)
    out = propose(d, [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 7, 9, 1, 2, 3])
    assert out.tree.tokens == (3, 7, 7, 9)  # root 3, then what followed "1 2 3" the second time
    assert out.passes == 0 and out.steps == 3


def test_longest_match_wins_and_no_match_means_no_draft():
    d = drafter(draft_length=2)
    assert propose(d, [5, 6, 7, 8]) is None
    out = propose(d, [4, 2, 9, 1, 2, 8, 4, 2])  # "4 2" -> 9; "2" alone would give 8
    assert out.tree.tokens[1:] == (9, 1)


def test_the_index_follows_a_growing_history_and_restarts_on_another():
    d = drafter(draft_length=1)
    h = [1, 2, 3, 1]
    assert propose(d, h).tree.tokens[1:] == (2,)
    h += [2, 5, 1]
    assert propose(d, h).tree.tokens[1:] == (2,)  # latest "1" was followed by 2 again
    assert propose(d, [8, 9, 8]).tree.tokens[1:] == (9,)  # a new prompt: indexed afresh


def test_a_copied_passage_is_matched_at_the_longest_size_and_earns_its_own_acceptance():
    """Sizes 1, 2, 3, 4, 6, 8, 12, 16: a passage being copied matches at 16 tokens, and what is learnt there
    (accepted drafts) lengthens the drafts of later 16-token matches, not of 1-token ones."""
    d = drafter(slope=0.1, max_draft=16)
    assert d.sizes == (1, 2, 3, 4, 6, 8, 12, 16)
    passage = list(range(100, 140))
    history = [7, 8] + passage + [5, 6] + passage[:20]
    out = propose(d, history)
    assert d._last_n == 16 and list(out.tree.tokens[1:]) == passage[20 : 20 + out.steps]
    before16, before1 = d._length(16), d._length(1)
    for _ in range(5):  # long drafts after 16-token matches, all accepted
        d._last_n = 16
        ms = 1 + 0.1 * out.steps  # as the profile says
        d.observe(out, list(range(out.steps + 1)), tokens=out.steps + 1, round_ms=ms, draft_ms=0, verify_ms=ms)
    assert d.acceptance(16) > 0.9 and d._length(16) > before16
    assert d._length(1) == before1
    assert PromptLookupDrafter(max_ngram=5).sizes == (1, 2, 3, 4, 5)
    assert PromptLookupDrafter(max_ngram=8, min_ngram=3).sizes == (3, 4, 6, 8)


def test_draft_length_is_priced_by_acceptance_and_verify_cost():
    cheap, dear = drafter(slope=0.02), drafter(slope=0.6)
    assert cheap._length(3) > 3  # cheap verification: draft long
    assert dear._length(1) == 0  # a weak 1-gram match on dear verification: do not draft
    d = drafter(slope=0.1)
    before = d._length(2)
    for _ in range(20):  # every drafted token rejected
        d._drafted[2] += 1
    assert d._length(2) < before


def test_budget_and_options_are_respected():
    d = drafter(draft_length=5)
    out = propose(d, [1, 2, 3, 4, 5, 6, 1, 2], budget=2)
    assert out.steps == 2
    assert propose(d, [1, 2, 1], budget=0) is None
    with pytest.raises(InvalidInputError):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(InvalidInputError):
        PromptLookupDrafter(max_draft=0)


def test_a_size_whose_first_drafts_failed_is_tried_again_until_the_evidence_is_clear():
    """The drafts are chosen by the acceptance plus its uncertainty (smoothed_acceptance's optimism): one-token
    matches that failed their first 4 drafts (estimate 0.15 from the prior 0.3) still earn a draft, where the
    estimate alone would never draft them again and so never learn that they pay; after many failures the bonus
    is gone and they are not drafted."""
    slope = 0.14  # a one-token draft pays from acceptance (1 + 0.02) * 1.14 - 1 = 0.16 (MIN_GAIN)
    d = drafter(slope=slope)
    d._drafted[1] = 4.0  # 0 of 4 accepted
    assert d.acceptance(1) == pytest.approx(0.15)
    assert (1 + d.acceptance(1)) / (1 + slope) < 1.02  # deciding by the estimate: a size locked out
    assert d._length(1) >= 1  # by the estimate and its uncertainty: drafted again
    d._drafted[1] = 40.0  # 0 of 40
    assert d._length(1) == 0
    assert smoothed_acceptance(1, 0.0, 4.0, optimism=1.0) > smoothed_acceptance(1, 0.0, 4.0)
    assert smoothed_acceptance(1, 12.0, 40.0, optimism=1.0) - smoothed_acceptance(1, 12.0, 40.0) < 0.1
    assert smoothed_acceptance(16, 30.0, 30.0, optimism=0.0) == pytest.approx((30 + 4 * 0.7) / 34)
