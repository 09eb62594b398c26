"""Cost profiles, the economy of draft decisions, cost-aware policies and low-precision draft weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_model

from selfspec.core.skipset import SkipSet
from selfspec.cost.costs import CostProfile, DraftCosts, _non_decreasing, measure_profile
from selfspec.cost.economy import Calibration, Economy, VerifyCurve
from selfspec.decoding import batch_share
from selfspec.drafters.layerskip import CostAwareExit, CostAwareTreeWidths, PaperTreeWidths


def _profile(forward=None, drafts=None) -> CostProfile:
    return CostProfile(
        key="synthetic",
        forward_ms=forward or {1: 20.0, 2: 20.0, 4: 22.0, 8: 40.0, 16: 80.0},
        drafts=drafts or {"same": DraftCosts(0.5, 1.0, 2.0, 1.0)},
        num_layers=10,
    )


def test_profile_interpolates_and_predicts_draft_cost():
    prof = _profile()
    assert prof.forward(1) == 20.0
    assert prof.forward(3) == pytest.approx(21.0)
    assert prof.forward(12) == pytest.approx(60.0)
    assert prof.forward(24) == pytest.approx(120.0)  # extrapolated with the last slope
    # nothing skipped: still a draft, every sublayer and the draft's head (its base); never above a full pass
    assert prof.draft_step(SkipSet()) == pytest.approx(2.0 + 10 * 1.5)
    assert _profile(drafts={"same": DraftCosts(0.5, 1.0, 6.0, 1.0)}).draft_step(SkipSet()) == prof.forward(1)
    assert prof.draft_step(SkipSet.of([0, 1], [0])) == pytest.approx(2.0 + 8 * 0.5 + 9 * 1.0)
    # the interpolation is memoised per size: asked again, the same value; a profile made from this one with
    # other tables (dataclasses.replace) prices by its own, and serialises without the memo
    assert prof.forward(3) == pytest.approx(21.0) and prof.forward(12) == pytest.approx(60.0)
    slower = dataclasses.replace(prof, forward_ms={k: 2 * v for k, v in prof.forward_ms.items()})
    assert slower.forward(3) == pytest.approx(42.0) and prof.forward(3) == pytest.approx(21.0)
    assert CostProfile.from_dict(prof.to_dict()) == prof and "_forward_memo" not in prof.to_dict()


def test_sublayer_costs_come_from_draft_passes_alone():
    """base 0.7 ms, 0.05 per attention and 0.08 per MLP sublayer, 18 layers, 9 of a kind left out: the three
    draft passes give back the parts (a full pass, with the whole head, is not one of them)."""
    from selfspec.cost.costs import _sublayer_costs

    L, h, a, m, base = 18, 9, 0.05, 0.08, 0.7
    c = _sublayer_costs(base, base + (L - h) * a + L * m, base + L * a + (L - h) * m, L, h, 1.0)
    assert (c.attention_ms, c.mlp_ms, c.base_ms) == pytest.approx((a, m, base))
    noisy = _sublayer_costs(base, base - 0.01, base + 0.5, L, h, 1.0)  # a pass timed below the base: no negatives
    assert noisy.attention_ms >= 0 and noisy.mlp_ms >= 0


def test_best_precision_needs_agreement_and_a_real_saving():
    """Priced by predicted chain speed, among precisions agreeing on MIN_AGREEMENT of tokens (fewer: broken)."""
    same = DraftCosts(1.0, 1.0, 5.0, 1.0)
    cheap_but_wrong = DraftCosts(0.1, 0.1, 1.0, 0.5)  # overflowed: agrees on half the tokens
    cheap = DraftCosts(0.3, 0.3, 2.0, 0.99)
    barely = DraftCosts(0.95, 0.95, 4.8, 1.0)  # 5% cheaper: not worth a second copy of the weights
    assert _profile(drafts={"same": same, "float16": cheap_but_wrong}).best_precision() == "same"
    assert _profile(drafts={"same": same, "float16": cheap_but_wrong, "bfloat16": cheap}).best_precision() == "bfloat16"
    assert _profile(drafts={"same": same, "bfloat16": barely}).best_precision() == "same"


def test_draft_vocabulary_coverage_caps_every_precisions_agreement():
    """A draft cannot propose a token its draft vocabulary lacks: chains that skip nothing are priced with the
    measured agreement times the coverage, so that a cheaper copy that agrees less is not out-priced by drafts in
    the model's own weights priced as never missing (Qwen2.5-Coder 0.5B Q8_0: predicted 1.28x, decoded 1.12x)."""
    same, q4 = DraftCosts(0.4, 0.6, 2.0, 1.0), DraftCosts(0.2, 0.3, 2.0, 0.9)
    full = _profile(drafts={"same": same, "q4": q4})
    held = dataclasses.replace(full, coverage=0.95)
    assert held.agreement("same") == pytest.approx(0.95) and held.agreement("q4") == pytest.approx(0.855)
    assert held.chain_speedup("same", True) < full.chain_speedup("same", True)
    assert CostProfile.from_dict(held.to_dict()) == held
    # an older profile (no coverage) reads as a draft vocabulary that holds every token
    old = {k: v for k, v in held.to_dict().items() if k != "coverage"} | {"version": 11}
    assert CostProfile.from_dict(old).agreement("same") == 1.0


def test_vocab_coverage_counts_the_tokens_held_when_they_came():
    """The base rows and every token of the text read before a position are held; the full model's token at a
    position is counted against what the draft vocabulary held then (the text's first reading only)."""
    from types import SimpleNamespace

    from selfspec.cost import costs

    dv = SimpleNamespace(ids=torch.tensor([0, 1, 2, 99]), base_size=3)
    model = SimpleNamespace(engine=SimpleNamespace(draft_vocab=dv), adapter=SimpleNamespace(vocab_size=100),
                            tokenizer=lambda text: {"input_ids": [10, 11, 12, 13]})  # fmt: skip
    # next tokens: 1 (base), 10 (read at position 0), 50 (never held), 99 (learned, not base: not counted)
    assert costs._vocab_coverage(model, torch.tensor([1, 10, 50, 99, 7, 7])) == pytest.approx(2 / 4)
    assert costs._vocab_coverage(SimpleNamespace(engine=SimpleNamespace(draft_vocab=None)), torch.tensor([3])) == 1.0


def test_isotonic_fit():
    assert _non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert _non_decreasing([5.0, 1.0, 1.0]) == pytest.approx([7 / 3] * 3)


def test_measured_profile_of_a_tiny_model():
    model = tiny_model("llama", seed=2)
    prof = measure_profile(model, reps=2, context=32)
    values = [prof.forward_ms[t] for t in sorted(prof.forward_ms)]
    assert values == sorted(values) and values[0] > 0
    assert {"same", "float16", "bfloat16"} <= prof.drafts.keys()
    assert prof.drafts["same"].agreement == 1.0
    assert 0.0 <= prof.drafts["float16"].agreement <= 1.0
    same = prof.drafts["same"]
    assert same.base_ms >= 0 and same.attention_ms >= 0 and same.mlp_ms >= 0
    # skipping nothing with the full head (a tiny model has no draft vocabulary) is priced at most a full pass;
    # how close its measured parts come to the measured whole is this machine's noise, not asserted here
    assert prof.draft_step(SkipSet()) <= prof.forward(1)


@pytest.mark.real_clock
@pytest.mark.parametrize("spread, others, saved", [(1.1, 0.0, True), (3.0, 0.0, False), (1.1, 1.0, False)])
def test_costs_measured_on_a_busy_machine_are_not_saved(monkeypatch, capsys, spread, others, saved):
    """Timings taken while other work held the cores (their quartiles far apart, or steady load from elsewhere
    that slows every timing alike) would price every later run wrongly (seen: a profile taken under load put
    2-token passes at twice and 1.7 times a 1-token one, and the n-gram sources stopped drafting): such a
    profile serves this process only."""
    from dataclasses import replace

    from selfspec.cost import costs

    model = tiny_model("llama", seed=4)
    fake = replace(_profile(), spread=spread, others=others)
    monkeypatch.setattr(costs, "measure_profile", lambda m, key="": replace(fake, key=key))
    prof = costs.cost_profile(model, force=True)
    assert prof.spread == spread and prof.others == others
    path = costs._profile_dir() / f"{costs.profile_key(model)}.json"
    assert path.is_file() == saved
    assert ("busy" in capsys.readouterr().err) != saved
    path.unlink(missing_ok=True)
    costs._MEMORY.pop(costs.profile_key(model), None)


@pytest.mark.real_clock
def test_a_cached_profile_of_an_older_version_is_measured_again(monkeypatch):
    """Version 12 times draft passes as rounds run them (a verification, then drafts in a row); a cached profile
    timed otherwise (a 4-bit copy priced at 15.9 ms where rounds took 11) is measured again, the current one read."""
    import json
    from dataclasses import replace

    from selfspec.cost import costs

    model = tiny_model("llama", seed=4)
    key = costs.profile_key(model)
    path = costs._profile_dir() / f"{key}.json"
    measured = []
    fake = _profile(drafts={name: DraftCosts(0.5, 1.0, 2.0, 1.0) for name in costs.draft_precisions(model)})
    monkeypatch.setattr(costs, "measure_profile", lambda m, key="": measured.append(1) or replace(fake, key=key))
    try:
        for version, again in [(11, True), (costs.PROFILE_VERSION, False)]:
            costs._MEMORY.pop(key, None)
            path.write_text(json.dumps(replace(fake, key=key, spread=1.01).to_dict() | {"version": version}))
            measured.clear()
            prof = costs.cost_profile(model)
            assert bool(measured) == again and (prof.spread == 1.0) == again
    finally:
        path.unlink(missing_ok=True)
        costs._MEMORY.pop(key, None)


def test_calibration_learns_from_outcomes():
    cal = Calibration()
    assert cal.prob(0.95) == pytest.approx(0.95)  # the prior: the draft is calibrated
    for _ in range(200):
        cal.update(0.95, kept=False)
    assert cal.prob(0.95) < 0.05
    assert cal.prob(0.15) == pytest.approx(0.15)  # other bins untouched
    assert cal.prob(float("nan")) == cal.prob(0.0)


def test_economy_decisions_follow_costs():
    econ = Economy(_profile(), draft_ms_predicted=5.0)  # a draft step costs a quarter of a full step
    assert econ.ms_per_token == 20.0
    # verifying a 2nd..4th token is almost free here, so a likely token is worth drafting
    assert econ.worth_another_draft(1.0, 0.9, tree_size=1)
    assert not econ.worth_another_draft(0.05, 0.1, tree_size=1)
    # leaves: free up to 2 tokens, costly beyond 4
    assert econ.worth_leaf(0.01, tree_size=1)
    assert not econ.worth_leaf(0.2, tree_size=8)
    # rounds that produce many tokens cheaply raise the bar
    for _ in range(50):
        econ.observe(tokens=5, round_ms=30.0, draft_steps=4, draft_ms=20.0, verified=5, verify_ms=22.0,
                     first_kept=True)  # fmt: skip
    assert econ.ms_per_token == pytest.approx(6.0, rel=0.05)
    assert econ.first_token_acceptance == pytest.approx(1.0)


def test_lookahead_sees_past_a_cost_jump():
    # the 3rd token costs 20 ms more to verify, the 4th and 5th nothing: drafting on pays over three tokens
    econ = Economy(_profile(forward={1: 20.0, 2: 20.0, 3: 40.0, 4: 40.0, 5: 40.0, 8: 60.0}), draft_ms_predicted=2.0)
    assert not econ.worth_another_draft(0.9, 0.9, tree_size=2, horizon=1)
    assert econ.worth_another_draft(0.9, 0.9, tree_size=2, horizon=3)


def test_cost_aware_exit_stops_and_skips_rounds():
    econ = Economy(_profile(), draft_ms_predicted=5.0)
    ex = CostAwareExit(max_draft=6, explore_every=3)
    ex.economy = econ
    assert ex.begin_round()
    assert not ex.should_stop(1, 0.99)
    assert ex.should_stop(2, 0.01)  # a hopeless token ends the draft
    assert ex.should_stop(6, 0.99)  # max_draft
    econ.first_token_acceptance = 0.0  # drafts are never right: rounds go without drafting...
    assert [ex.begin_round() for _ in range(6)] == [False, False, True, False, False, True]  # ...but explore


def test_tree_widths():
    econ = Economy(_profile(forward={1: 20.0, 2: 23.0, 4: 29.0, 8: 41.0}), draft_ms_predicted=5.0)  # 3 ms a token
    cost_aware = CostAwareTreeWidths(max_leaves=4)
    cost_aware.economy = econ
    # a likely second candidate earns a leaf, a hopeless third does not
    assert cost_aware.leaves([0.6, 0.3, 0.01], path_prob=1.0, size=2, budget=4) == 1
    # the same candidates below a path that is almost surely rejected earn none
    assert cost_aware.leaves([0.6, 0.3, 0.01], path_prob=0.001, size=2, budget=4) == 0
    assert cost_aware.leaves([0.2, 0.2, 0.2, 0.2, 0.2], path_prob=1.0, size=2, budget=1) <= 1  # budget caps
    paper = PaperTreeWidths()
    assert [paper.leaves([p], 1.0, 2, 9) for p in (0.3, 0.7, 0.9, 0.99)] == [9, 4, 2, 0]  # k = 10, 5, 3, 1
    assert paper.leaves([0.3], 1.0, 2, 3) == 3


def test_the_verification_curve_follows_what_rounds_measure():
    """The profile's curve at its short context, corrected: rounds of two tokens measured dearer than it says
    raise every multi-token ratio, one-token rounds set the unit."""

    class Linear:
        def forward(self, tokens: int) -> float:
            return 4.0 + 0.5 * (tokens - 1)  # ms

    curve = VerifyCurve(Linear(), smoothing=0.5)
    assert curve.ratio(1) == 1.0 and curve.ratio(3) == pytest.approx(1.25)
    for _ in range(20):
        curve.observe(1, 4.0)
        curve.observe(2, 5.0)  # one extra token costs 1 ms here, not the profile's 0.5
    assert curve.slope == pytest.approx(2.0, rel=1e-3)
    assert curve.ratio(3) == pytest.approx(1.5, rel=1e-3)
    curve.observe(2, 1e6)  # one absurd measurement moves the factor only up to its bound
    assert curve.slope <= VerifyCurve.SLOPE_RANGE[1]


def test_beside_other_requests_extra_verified_rows_are_weighed_against_the_rounds_share():
    """In a batch of 4 a one-token round (measured at 8 ms, the whole pass) is worth a quarter of it, so two
    extra rows, 1 ms on the curve, cost 0.5 of a round there where alone they cost 1/8 of one."""

    class Linear:
        def forward(self, tokens: int) -> float:
            return 4.0 + 0.5 * (tokens - 1)  # ms

    curve = VerifyCurve(Linear(), smoothing=1.0)
    curve.observe(1, 8.0)
    assert curve.ratio(3) == pytest.approx(1.0 + 1.0 / 8.0)
    batch_share.record(batch_share.Share(members=4, rows_beside=3))
    try:
        assert curve.ratio(3) == pytest.approx(1.0 + 1.0 / 2.0) and curve.ratio(1) == 1.0
    finally:
        batch_share.reset()


def test_prompt_lookup_stops_drafting_where_verifications_turn_out_dear():
    from types import SimpleNamespace

    from selfspec.core.sampling import GREEDY_SAMPLER
    from selfspec.drafters.lookup import PromptLookupDrafter

    class Flat:
        def forward(self, tokens: int) -> float:
            return 4.0 + 0.4 * (tokens - 1)  # the profile: an extra token costs 10% of a step

    d = PromptLookupDrafter(max_ngram=1)
    d._costs = VerifyCurve(Flat())
    history = [1, 2, 3, 1]

    def propose():
        return d.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=8, sampler=GREEDY_SAMPLER)

    assert propose() is not None  # a one-token match, acceptance 0.3 by the prior: pays at 10% per token
    for _ in range(30):
        d.observe(None, [0], tokens=1, round_ms=4.0, draft_ms=0.0, verify_ms=4.0)
        d._costs.observe(2, 6.0)  # but here a second token costs half a step
    # the prior alone no longer pays; its uncertainty (a size never drafted: smoothed_acceptance's optimism) earns
    # it one try, and once that try is rejected the size is not drafted
    tries = 0
    while (out := propose()) is not None and tries < 10:
        tries += 1
        d.observe(out, [0], tokens=1, round_ms=6.0, draft_ms=0.0, verify_ms=6.0)
    assert tries == 1 and propose() is None


def test_verification_timings_cover_every_row():
    """`selfspec kernels` sets a pass that keeps the last row's logits beside a verification (every row's
    logits, checked, and their argmax): both are timed per T, and the verification returns one token per row."""
    from selfspec.cost.costs import _verification, decode_step_ms

    model = tiny_model("llama", seed=2)
    for verify in (False, True):
        times = decode_step_ms(model, rows=(1, 3), context=16, reps=2, verify=verify)
        assert sorted(times) == [1, 3] and all(ms > 0 for ms in times.values())
    cache = model.engine.new_cache(24)
    assert _verification(model.engine, cache, torch.tensor([5, 6, 7]), 0).shape == (3,)


def test_drafting_rounds_are_judged_by_the_clock():
    """draft_gain: tokens of a drafting round per plain round's measured time; four rounds before it counts."""
    prof = _profile()
    econ = Economy(prof, 5.0)
    econ.observe(tokens=1, round_ms=30.0, draft_steps=0, draft_ms=0.0, verified=1, verify_ms=29.0, first_kept=None)
    assert econ.plain_round_ms == 30.0
    for _ in range(3):  # 2 tokens in 75 ms: 0.8 of a plain round's 2 x 30 ms
        econ.observe(tokens=2, round_ms=75.0, draft_steps=3, draft_ms=45.0, verified=4, verify_ms=30.0,
                     first_kept=True)  # fmt: skip
    assert econ.draft_gain == pytest.approx(0.8) and not econ.drafting_loses(), "three rounds are not enough"
    econ.observe(tokens=2, round_ms=75.0, draft_steps=3, draft_ms=45.0, verified=4, verify_ms=30.0, first_kept=True)
    assert econ.drafting_loses()
    for _ in range(30):  # now 5 tokens per such round: 2x a plain round's rate
        econ.observe(tokens=5, round_ms=75.0, draft_steps=3, draft_ms=45.0, verified=4, verify_ms=30.0,
                     first_kept=True)  # fmt: skip
    assert econ.draft_gain == pytest.approx(2.0, rel=0.01) and not econ.drafting_loses()


def test_the_cost_correction_is_what_draft_steps_and_verifications_really_take():
    prof = _profile()
    econ = Economy(prof, 5.0)  # a draft step predicted at 5 ms
    for _ in range(200):  # draft steps take 10 ms, verifications what the profile says
        econ.observe(tokens=2, round_ms=50.0, draft_steps=2, draft_ms=20.0, verified=3, verify_ms=prof.forward(3),
                     first_kept=True)  # fmt: skip
    assert econ.cost_correction() == pytest.approx(2.0, rel=1e-3)
    econ.rebind(2.5)  # another skip set: the correction stays
    assert econ.cost_correction() == pytest.approx(2.0, rel=1e-3)


def test_beside_other_requests_a_round_is_priced_as_its_share_of_the_batch():
    """In a batch of 4 (decoding/batch_share.py) a plain round costs a sequence a quarter of the pass it waited
    for: a draft of 3 steps run alone (the others wait) for 3 tokens loses there, where alone it pays."""
    prof = _profile()
    econ = Economy(prof, 5.0)
    alone = econ.batch_gain(tokens=3, draft_ms=15.0, verify_ms=40.0, verified=4)  # (as if one member)
    batch_share.record(batch_share.Share(members=4, rows_beside=3))
    try:
        share = 40.0 / 4
        extra = econ.verify_ms(4) - econ.verify_ms(1)
        assert econ.batch_gain(tokens=1, draft_ms=0.0, verify_ms=40.0, verified=1) == pytest.approx(1.0)
        gain = econ.batch_gain(tokens=3, draft_ms=15.0, verify_ms=40.0, verified=4)
        assert gain == pytest.approx(3 * share / (share + 15.0 + extra)) and gain < 1.0 < alone
        for _ in range(4):  # the clock's judgement of drafting rounds uses the same price in a batch
            econ.observe(tokens=3, round_ms=55.0, draft_steps=3, draft_ms=15.0, verified=4, verify_ms=40.0,
                         first_kept=True)  # fmt: skip
        assert econ.draft_gain == pytest.approx(gain, rel=0.02) and econ.drafting_loses()
    finally:
        batch_share.reset()


@pytest.mark.real_clock
def test_other_load_sees_another_process_spinning_on_our_cpus():
    """clock.OtherLoad: a process spinning beside a span shows as about a core's worth of other load; this process's
    own work does not count (where the CPUs cannot be watched, it reads 0.0 and the test has nothing to check)."""
    import subprocess
    import sys
    import time

    from selfspec.core import clock

    if clock._cpu_snapshot() is None:
        pytest.skip("the CPUs we run on cannot be watched here (not Linux, or many CPUs)")
    with clock.OtherLoad() as own:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.6:
            pass
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with clock.OtherLoad() as other:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert other.cores > 0.5 and other.busy
    assert own.cores < other.cores


def test_a_cache_form_of_its_own_gets_a_profile_of_its_own(smollm2):
    """The cost profile is keyed by the KV cache's form where it is not the activations' own (an 8-bit cache's
    attention costs otherwise), and the default keeps its key whichever way it is named."""
    from selfspec.core import quant
    from selfspec.cost import costs

    default = costs.profile_key(smollm2)
    with quant.kv_cache("q8_0"):
        eight = costs.profile_key(smollm2)
    named = "f16" if quant.int8_activations() else "f32"
    with quant.kv_cache(named):
        same = costs.profile_key(smollm2)
    assert eight != default and "-kvq8" in eight
    assert same == default
