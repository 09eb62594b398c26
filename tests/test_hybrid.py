"""The hybrid drafter (method ``auto``): lossless, picks the source that pays, prices a garbage source out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_lookup import FlatProfile

import selfspec
from selfspec.core.sampling import GREEDY_SAMPLER
from selfspec.cost.economy import VerifyCurve
from selfspec.decoding.protocols import DraftOutcome
from selfspec.decoding.trees import DraftTree
from selfspec.drafters.hybrid import PAYS, HybridDrafter
from selfspec.drafters.lookup import PromptLookupDrafter
from selfspec.errors import InvalidInputError

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on"


class DeclineToDraft:
    """A layer-skip stand-in that never drafts (as SWIFT's cost-aware exit on a model where drafts cost too much)."""

    max_nodes = 8
    economy = None

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, history, **kw):
        self.calls += 1
        return None

    def observe(self, *a, **kw):
        pass


def test_a_lookup_source_whose_drafts_are_rejected_fades_out():
    lookup = PromptLookupDrafter()
    lookup._costs = VerifyCurve(FlatProfile(0.1))  # verifying k + 1 tokens costs 1 + 0.1 k steps
    layerskip = DeclineToDraft()
    hybrid = HybridDrafter(lookup, layerskip)
    history = [1, 2, 3, 4] * 10
    used = []
    for _ in range(40):
        out = hybrid.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20,
                             sampler=GREEDY_SAMPLER)  # fmt: skip
        used.append(out is not None)
        ms = 1.0 + 0.1 * (len(out.tree) - 1) if out is not None else 1.0  # as the profile says
        hybrid.observe(out, [0], tokens=1, round_ms=ms, draft_ms=0.0, verify_ms=ms)  # every draft rejected
    assert all(used[:3]), "a fresh match is tried"
    assert not any(used[-20:]), "after enough rejections the lookup source proposes nothing"
    assert layerskip.calls >= 20, "the other source gets the rounds"


def test_the_lookup_calibration_is_a_ratio_of_running_sums_not_a_mean_of_ratios():
    """Lookup rounds whose predictions swing (1 and 3) around what they earn (2, every round): the calibration
    is measured / predicted over the recent rounds, 1.0, where a running mean of each round's ratio (2 and 2/3)
    would read 1.33 and make the source look better than it is."""
    drafted = DraftOutcome(DraftTree.chain(4, [1, 2]), [0.9] * 2, {}, 2)
    hybrid = HybridDrafter(DeclineToDraft(), DeclineToDraft())
    hybrid._step_ms = 1.0
    for r in range(200):
        hybrid._source, hybrid._predicted = "lookup", (1.0 if r % 2 else 3.0)
        hybrid.observe(drafted, [4, 1], tokens=2, round_ms=1.0, draft_ms=0.0, verify_ms=1.0)  # gain 2 each
    assert hybrid.lookup_calibration == pytest.approx(1.0, abs=0.06)
    for _ in range(60):  # then predictions twice too hopeful: it follows
        hybrid._source, hybrid._predicted = "lookup", 4.0
        hybrid.observe(drafted, [4, 1], tokens=2, round_ms=1.0, draft_ms=0.0, verify_ms=1.0)
    assert hybrid.lookup_calibration == pytest.approx(0.5, abs=0.02)


def test_the_measured_gain_of_layer_skip_rounds_decides_against_a_weak_lookup():
    lookup = PromptLookupDrafter(max_ngram=3)  # short matches only: a modest expected gain
    lookup._costs = VerifyCurve(FlatProfile(0.02))
    lookup._drafted[3], lookup._accepted[3] = 100.0, 60.0  # measured at 60% (a fresh source is priced hopefully)
    drafted = DraftOutcome(DraftTree.chain(4, [1, 2, 3]), [0.9] * 3, {}, 3)

    class GoodSkipDrafts(DeclineToDraft):
        def propose(self, history, **kw):
            self.calls += 1
            return drafted

    layerskip = GoodSkipDrafts()
    hybrid = HybridDrafter(lookup, layerskip)
    history = [1, 2, 3, 4] * 10
    for _ in range(12):  # layer-skip rounds that earn 4 tokens for 1.5 steps of time
        hybrid._source = "layerskip"
        hybrid.observe(drafted, [0, 1, 2, 3], tokens=4, round_ms=1.5, draft_ms=0.5, verify_ms=1.0)
    assert hybrid.skip_gain > 2.0
    out = hybrid.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20, sampler=GREEDY_SAMPLER)
    assert out is drafted and lookup.last_gain < hybrid.skip_gain


def test_where_the_layer_skip_source_sits_out_the_lookup_drafts_whatever_its_calibration():
    """A losing layer-skip source (gain below PAYS, waiting for its next exploring round) leaves a plain step as
    the alternative: a lookup match its own pricing proposed drafts, even where its calibrated gain is below the
    layer-skip source's measured one (before, the round was a plain step)."""
    lookup = PromptLookupDrafter(max_ngram=3)
    lookup._costs = VerifyCurve(FlatProfile(0.02))
    layerskip = DeclineToDraft()
    hybrid = HybridDrafter(lookup, layerskip)
    hybrid.skip_gain, hybrid._idle, hybrid._wait = 1.03, 1, 16  # losing, not due to explore
    hybrid.lookup_calibration = 0.25  # the lookup's rounds earned a quarter of their predictions
    history = [1, 2, 3, 4] * 10
    out = hybrid.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20, sampler=GREEDY_SAMPLER)
    assert out is not None and hybrid._source == "lookup" and layerskip.calls == 0
    assert lookup.last_gain * hybrid.lookup_calibration < hybrid.skip_gain
    hybrid.skip_gain = 2.0  # a layer-skip source that pays takes the round from the weak match
    hybrid.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20, sampler=GREEDY_SAMPLER)
    assert hybrid._source == "layerskip" and layerskip.calls == 1


@pytest.mark.parametrize(
    "options", [{}, {"layerskip": "swift", "draft_dtype": "same", "schedule": "paper", "max_ngram": 2},
                {"layerskip": "vocab"}]
)
def test_auto_equals_vanilla_and_uses_both_sources(tiny_llama, options):
    base = selfspec.generate(tiny_llama, PROMPT, "vanilla", max_new_tokens=48)
    session = selfspec.Session(tiny_llama, "auto", **options)
    for _ in range(2):
        out = session.generate(PROMPT, max_new_tokens=48)
        assert out.token_ids == base.token_ids
    sources = out.stats.sources
    assert set(sources) == {"lookup", "layerskip"}
    assert sum(s["drafted"] for s in sources.values()) == out.stats.drafted
    assert sum(s["accepted"] for s in sources.values()) == out.stats.accepted


def test_garbage_lookup_drafts_never_change_the_output(tiny_llama, monkeypatch):
    real = PromptLookupDrafter.propose

    def garbage(self, history, **kw):
        out = real(self, history, **kw)
        if out is None:
            return None
        bad = [(t + 7) % 50 for t in out.tree.tokens[1:]]
        return DraftOutcome(DraftTree.chain(out.tree.tokens[0], bad), out.chain_probs, {}, out.steps, passes=0)

    monkeypatch.setattr(PromptLookupDrafter, "propose", garbage)
    base = selfspec.generate(tiny_llama, PROMPT, "vanilla", max_new_tokens=48)
    out = selfspec.generate(tiny_llama, PROMPT, "auto", max_new_tokens=48)
    assert out.token_ids == base.token_ids


@pytest.mark.parametrize("gain", [0.6, 1.02])  # losing time; only breaking even (below PAYS)
def test_a_losing_layer_skip_source_sits_out_but_still_explores(gain):
    """It explores after EXPLORE_EVERY idle rounds, then after twice as many each time it still loses, capped.
    A source that only breaks even (gains below ``PAYS``) sits out as one that loses time."""
    from selfspec.drafters.hybrid import EXPLORE_EVERY, MAX_BACKOFF

    lookup = PromptLookupDrafter()
    lookup._costs = VerifyCurve(FlatProfile(0.1))
    layerskip = DeclineToDraft()
    hybrid = HybridDrafter(lookup, layerskip)
    hybrid.skip_gain = gain  # what its rounds have been earning, in tokens per vanilla step
    history = list(range(100))  # no n-gram repeats: the lookup source has nothing
    waits = [EXPLORE_EVERY * min(2**i, MAX_BACKOFF) for i in range(6)]  # 16, 32, 64, 128, 128, 128
    explored_at = _explorations(hybrid, layerskip, history, sum(w + 1 for w in waits))
    assert explored_at == [sum(w + 1 for w in waits[: i + 1]) - 1 for i in range(len(waits))]


class DraftThree(DeclineToDraft):
    """A layer-skip stand-in that drafts three tokens every time it is asked."""

    def propose(self, history, **kw):
        self.calls += 1
        return DraftOutcome(DraftTree.chain(4, [1, 2, 3]), [0.9] * 3, {}, 3)


def test_an_exploring_round_that_pays_lets_the_layer_skip_source_draft_again():
    """A source whose running gain fell below PAYS drafts only to explore; when such a round pays (4 tokens for
    two vanilla steps' time), it drafts in the very next round instead of after another, longer wait; one that
    explores and still loses waits on."""
    from selfspec.drafters.hybrid import EXPLORE_EVERY

    history = list(range(100))  # no n-gram repeats: the lookup source has nothing
    for round_ms, drafts_next in ((20.0, True), (60.0, False)):  # 2 vanilla steps' worth: pays; 6: loses
        layerskip = DraftThree()
        layerskip.economy = SimpleNamespace(verify_ms=lambda tokens: 10.0)
        hybrid = HybridDrafter(PromptLookupDrafter(), layerskip)
        hybrid.skip_gain = 0.6  # its last rounds lost time
        explored = 0
        for _ in range(EXPLORE_EVERY + 2):
            calls = layerskip.calls
            out = hybrid.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20,
                                 sampler=GREEDY_SAMPLER)  # fmt: skip
            if layerskip.calls > calls:
                explored += 1
                hybrid.observe(out, [0, 1, 2, 3], tokens=4, round_ms=round_ms, draft_ms=round_ms - 10.0,
                               verify_ms=10.0)  # fmt: skip
            else:
                hybrid.observe(out, [0], tokens=1, round_ms=10.0, draft_ms=0.0, verify_ms=10.0)
        assert (hybrid.skip_gain >= PAYS) == drafts_next
        assert explored == (2 if drafts_next else 1)  # the exploring round, then (if it paid) the next one


def _explorations(hybrid, layerskip, history, rounds: int) -> list[int]:
    """The rounds (of ``rounds`` plain ones) in which the hybrid let its layer-skip source draft."""
    explored = []
    for r in range(rounds):
        calls = layerskip.calls
        out = hybrid.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20,
                             sampler=GREEDY_SAMPLER)  # fmt: skip
        hybrid.observe(out, [0], tokens=1, round_ms=1.0, draft_ms=0.0, verify_ms=1.0)
        if layerskip.calls > calls:
            explored.append(r)
    return explored


@pytest.mark.parametrize(("options", "message"), [
    ({"schedule": "paper"}, "schedule applies to layerskip=swift"),
    ({"layerskip": "swift", "explore_every": 4}, "explore_every applies to layerskip=asd"),
    ({"layerskip": "eagle"}, "layerskip must be one of asd, swift, lowbit"),
])
def test_auto_refuses_the_other_layer_skip_sources_options(tiny_llama, options, message):
    with pytest.raises(InvalidInputError, match=message):
        selfspec.Session(tiny_llama, "auto", **options)


def test_a_head_only_rounds_gain_counts_the_whole_round_against_a_vanilla_step():
    """A round verified by the head alone (drafters/layerskip.py) spends nearly all its time in its draft and
    little in its "verification": its gain is its tokens per vanilla step of the whole round's time, the vanilla
    step from the economy, or from the cost profile where the source has none (``draft_dtype=same``: no
    pricing), never the round's own short verification."""
    drafted = DraftOutcome(DraftTree.chain(4, [1, 2, 3]), [0.9] * 3, {}, 3, passes=4)
    with_economy = DeclineToDraft()
    with_economy.economy = SimpleNamespace(verify_ms=lambda tokens: 10.0 if tokens == 1 else None)
    for step_ms, layerskip in ((None, with_economy), (10.0, DeclineToDraft())):
        hybrid = HybridDrafter(PromptLookupDrafter(), layerskip)
        hybrid._step_ms = step_ms  # (set by bind from the profile where the source has no economy)
        hybrid._source = "layerskip"
        hybrid.observe(drafted, [0, 1, 2, 3], tokens=4, round_ms=30.0, draft_ms=28.0, verify_ms=2.0)
        assert hybrid.skip_gain == pytest.approx(0.8 * PAYS + 0.2 * 4 * 10.0 / 30.0)  # from its start, PAYS



def test_beside_other_requests_a_layer_skip_round_is_priced_as_its_share_of_the_batch():
    """The same round (3 draft steps, 4 tokens) that earns 1.5 vanilla steps' worth alone loses in a batch of 4,
    where its draft steps hold every member and a plain round costs it a quarter of the pass."""
    from test_economy import _profile

    from selfspec.cost.economy import Economy
    from selfspec.decoding import batch_share

    drafted = DraftOutcome(DraftTree.chain(4, [1, 2, 3]), [0.9] * 3, {}, 3)
    gains = []
    for members, verify_ms in ((1, 22.0), (4, 40.0)):  # a 4-row pass alone; beside 3 others' one-row rounds
        layerskip = DeclineToDraft()
        layerskip.economy = Economy(_profile(), 10.0)
        hybrid = HybridDrafter(PromptLookupDrafter(), layerskip)
        batch_share.record(batch_share.Share(members=members, rows_beside=members - 1))
        try:
            for _ in range(20):
                hybrid._source = "layerskip"
                hybrid.observe(drafted, [0, 1, 2, 3], tokens=4, round_ms=30.0 + verify_ms, draft_ms=30.0,
                               verify_ms=verify_ms)  # fmt: skip
        finally:
            batch_share.reset()
        gains.append(hybrid.skip_gain)
    assert gains[0] > 1.0 > gains[1]


def test_asds_choice_drives_autos_layer_skip_source(tiny_llama):
    """Within auto, ASD's automatic policy sets its layer-skip source's draft length and reads that source's
    measured costs, as when ASD drafts alone (bound to the hybrid it once found neither, and its source drafted by
    the confidence exit: 3 tokens a round where ASD alone drafted 11); the hybrid alone decides which rounds that
    source drafts."""
    session = selfspec.Session(tiny_llama, "auto", layerskip="asd")
    session.generate(PROMPT, max_new_tokens=16)
    policy, hybrid = session.skip_policy, session.draft_policy
    assert isinstance(hybrid, HybridDrafter)
    assert policy._gate is hybrid.layerskip.length and policy._gate.gate is None
    assert policy._drafter is hybrid.layerskip
    alone = selfspec.Session(tiny_llama, "asd")
    alone.generate(PROMPT, max_new_tokens=16)
    assert alone.skip_policy._gate.gate == alone.skip_policy.drafting


@pytest.mark.parametrize("source", ["lookup", "suffix"])
def test_a_match_is_priced_after_drafted_tokens_without_changing_the_source(source):
    """match_value prices the draft the source would make after history + a layer-skip chain's tokens, from the
    history's index alone; the source's own state (index, last proposal) stays as it was."""
    from selfspec.drafters.suffix import SuffixDrafter

    drafter = PromptLookupDrafter() if source == "lookup" else SuffixDrafter()
    drafter._costs = VerifyCurve(FlatProfile(0.02))
    history = [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 1, 2]
    drafter.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=20, sampler=GREEDY_SAMPLER)
    before = (drafter.last_gain, len(drafter._history if source == "lookup" else drafter._text.tokens))
    gain, tokens = drafter.match_value(history, [3, 4])  # "1 2 3 4" occurred: 5 6 7 8 follows
    assert gain > 1.0 and tokens > 1.0
    assert drafter.match_value(history, [42, 43]) == (0.0, 0.0)  # nothing ends so
    assert drafter.match_value(history, []) == (0.0, 0.0)
    assert drafter.match_value(history[:-1], [3]) == (0.0, 0.0)  # not the history last indexed: no answer
    assert (drafter.last_gain, len(drafter._history if source == "lookup" else drafter._text.tokens)) == before


def test_a_layer_skip_chain_ends_where_a_lookup_draft_would_earn_more():
    """auto's stop rule: the cut pays when the lookup's expected tokens, made at its gain instead of the layer-skip
    source's, save more than the extra round costs (hybrid.SWITCH_STEPS vanilla steps)."""
    from selfspec.drafters import hybrid as hybrid_module

    class Priced:
        value = (0.0, 0.0)
        max_nodes = 8

        def match_value(self, history, extra):
            return self.value

    lookup = Priced()
    hybrid = HybridDrafter(lookup, DeclineToDraft())
    hybrid.skip_gain = 1.25  # a layer-skip token costs 0.8 steps
    until = hybrid._lookup_wins_after([1, 2, 3])
    lookup.value = (2.5, 5.0)  # 5 tokens for 2 steps instead of 4: 2 steps saved
    assert until([4])
    lookup.value = (2.5, 2.0)  # 2 tokens: 0.8 steps saved, less than the cut costs
    assert not until([4]) and hybrid_module.SWITCH_STEPS > 0.8
    lookup.value = (1.2, 20.0)  # below the layer-skip source's gain: never
    assert not until([4])
    hybrid.lookup_calibration = 0.5  # its predictions have been twice too hopeful
    lookup.value = (2.5, 5.0)
    assert not until([4])
    assert HybridDrafter(DeclineToDraft(), DeclineToDraft())._lookup_wins_after([1]) is None  # no pricing


@pytest.mark.parametrize("source", ["lowbit", "vocab"])
def test_a_source_with_its_own_precision_refuses_a_draft_dtype(tiny_llama, source):
    with pytest.raises(selfspec.InvalidInputError, match=f"layerskip={source} drafts in .* drop draft_dtype"):
        selfspec.Session(tiny_llama, "auto", layerskip=source, draft_dtype="bfloat16")


def test_a_new_generation_lets_a_losing_source_explore_at_once():
    """Deep in its backoff, the losing layer-skip source explores in the first round of the next generation (a
    new prompt may be where it pays); its backoff starts again from EXPLORE_EVERY (declining there, it waits
    twice that, as after any losing exploration)."""
    from selfspec.drafters.hybrid import EXPLORE_EVERY

    lookup = PromptLookupDrafter()
    lookup._costs = VerifyCurve(FlatProfile(0.1))
    layerskip = DeclineToDraft()
    hybrid = HybridDrafter(lookup, layerskip)
    hybrid.skip_gain = 0.6
    history = list(range(100))
    _explorations(hybrid, layerskip, history, 16 * EXPLORE_EVERY)  # backed off: waits of 32, 64, 128 by now
    hybrid.begin()
    assert _explorations(hybrid, layerskip, history, 2 * EXPLORE_EVERY + 2) == [0, 2 * EXPLORE_EVERY + 1]


def test_ending_a_head_only_chain_early_costs_the_head_not_a_pass():
    """Where the full head alone verifies a layer-skip chain (a draft that skips nothing), ending it early for a
    lookup match costs the head over its rows (the draft step over the last token runs either way); where a full
    pass verifies it, a whole step."""
    from test_economy import _profile

    from selfspec.cost.economy import Economy
    from selfspec.drafters.hybrid import SWITCH_STEPS

    profile = _profile()
    for head_only in (True, False):
        layerskip = DeclineToDraft()
        layerskip.economy = Economy(profile, 10.0, head_only=head_only)
        hybrid = HybridDrafter(PromptLookupDrafter(), layerskip)
        switch = [hybrid._switch_steps(k) for k in (1, 4)]
        if head_only:
            assert switch == [profile.head(k + 1) / profile.forward(1) for k in (1, 4)]
            assert 0 < switch[0] < switch[1] < SWITCH_STEPS
        else:
            assert switch == [SWITCH_STEPS, SWITCH_STEPS]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 3}])
def test_lookup_guesses_ride_on_layer_skip_chains_and_keep_vanillas_tokens(tiny_llama, sampling, monkeypatch):
    """auto's layer-skip chains carry the lookup source's guesses as extra rows of their draft passes (here the
    lookup source never takes a round itself, and the layer-skip source drafts in every one); greedy and
    coupled-sampled outputs stay vanilla's, and the guesses are learned (tried, kept where the draft agreed)."""
    from selfspec.drafters import hybrid as hybrid_module
    from selfspec.drafters.suffix import SuffixDrafter

    learn, seen = HybridDrafter._learn_rides, []

    def spy(self, outcome):
        seen.extend(self._rides)
        learn(self, outcome)

    for cls in (SuffixDrafter, PromptLookupDrafter):
        def declines(self, history, _propose=cls.propose, **kw):
            _propose(self, history, **kw)  # (indexes the text, as each round does)
            return None

        monkeypatch.setattr(cls, "propose", declines)
    monkeypatch.setattr(HybridDrafter, "_learn_rides", spy)
    monkeypatch.setattr(hybrid_module, "PAYS", 0.0)
    base = selfspec.generate(tiny_llama, PROMPT * 2, "vanilla", max_new_tokens=64, **sampling)
    session = selfspec.Session(tiny_llama, "auto", layerskip="swift", schedule="paper", tree=False, draft_dtype="same")
    for _ in range(2):
        out = session.generate(PROMPT * 2, max_new_tokens=64, **sampling)
        assert out.token_ids == base.token_ids
    assert seen, "no guess rode along"
    tried = session.draft_policy._ride_seen
    assert sum(n for n, _ in tried.values()) >= len(seen) > 0
    assert all(0 <= kept <= n for n, kept in tried.values()) and any(kept for _, kept in tried.values())
    seen.clear()  # ride=false: one token a pass, the same tokens
    alone = selfspec.Session(tiny_llama, "auto", layerskip="swift", schedule="paper", tree=False, draft_dtype="same",
                             ride="false")  # fmt: skip
    assert alone.generate(PROMPT * 2, max_new_tokens=64, **sampling).token_ids == base.token_ids
    assert not seen and not alone.draft_policy._ride_seen
