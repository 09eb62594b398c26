"""Head-only rounds priced by what they cost (issue 38).

A draft that skips nothing, in the model's own precision, with a draft vocabulary, is verified by the full head
over its own passes' hidden states (drafters/layerskip.py): a round of k drafted tokens costs k + 1 draft steps and
one full-head product over k + 1 rows, no verification pass.  Hand-written cost profiles check the price
(:meth:`CostProfile.verification`), the economy's use of it and ASD's choice; the real models check that asd and
auto stay lossless while they draft that way.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import selfspec
from selfspec.core.skipset import SkipSet
from selfspec.cost.costs import CostProfile, DraftCosts
from selfspec.cost.economy import Economy, verifies_by_head
from selfspec.decoding import batch_share
from selfspec.drafters.layerskip import AdaptiveDraftExit
from selfspec.model.engine import SublayerCosine
from selfspec.policies.asd import AutoAsdPolicy, DraftGate, best_draft_length

L = 8
STEEP = {t: 10.0 * (1 + 0.3 * (t - 1)) for t in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)}  # each verified row: +30%


def profile(head_one: float | None = 2.5, head_rows: float = 0.05) -> CostProfile:
    """A 10 ms step whose verification grows steeply with its rows; a draft skipping nothing costs 7.5 ms
    (sublayers 6, the draft vocabulary's head 1.5); the full head over T rows ``head_one`` (1 + ``head_rows``
    (T - 1)) (None: no measured head, as in a version-8 profile)."""
    attention, mlp = 6.0 / (8 * L), 6.0 * 7 / (8 * L)
    head = {} if head_one is None else {t: head_one * (1 + head_rows * (t - 1)) for t in (1, 2, 4, 8, 16)}
    return CostProfile("head", STEEP, {"same": DraftCosts(attention, mlp, 1.5, 1.0)}, L, head)


def fake_model(draft_vocab) -> SimpleNamespace:
    """What the policy reads of a model: name, shape, and whether its engine keeps a draft vocabulary."""
    return SimpleNamespace(name="fake", num_layers=L, hf=SimpleNamespace(config=SimpleNamespace(model_type="x")),
                           engine=SimpleNamespace(draft_vocab=draft_vocab))  # fmt: skip


def gated_drafter() -> SimpleNamespace:
    return SimpleNamespace(length=DraftGate(AdaptiveDraftExit()), max_draft=12, torch_dtype=lambda model: None)


NO_SKIP_COS = SublayerCosine(attention=(0.9,) * L, mlp=(0.9,) * L)  # every skip damages: the prior says so


def drive(policy: AutoAsdPolicy, rounds: int) -> list[SkipSet]:
    """Rounds where the empty set's 4 drafts are always kept and every other set's never are; the sets used."""
    used = []
    for _ in range(rounds):
        skip = policy.before_round(None)
        if policy.drafting():
            used.append(skip)
            policy.observe(4, 4 if skip.is_empty else 0)
    return used


# -- the price --------------------------------------------------------------------------------------


def test_a_head_only_round_costs_one_more_draft_step_and_the_full_head():
    prof = profile()
    step = prof.draft_step(SkipSet())
    assert step == pytest.approx(7.5)
    assert prof.verification(1, step) == prof.forward(1) == 10.0, "a plain round is a full one-token pass"
    assert prof.verification(5) == pytest.approx(22.0)
    assert prof.verification(5, step) == pytest.approx(7.5 + 2.5 * 1.2)
    assert prof.head(3) == pytest.approx(2.5 * 1.1), "interpolated between the measured sizes"
    assert prof.verify_curve(3) == pytest.approx([1.3, 1.6, 1.9])
    assert prof.verify_curve(2, step) == pytest.approx([0.75 + 0.2625, 0.75 + 0.275])


def test_a_profile_without_head_timings_derives_them_and_old_cached_ones_still_load():
    """Version 8 (no ``head_ms``): the full head is a one-token pass less a draft keeping every sublayer,
    growing with the rows as a pass does.  Version 9 round-trips its timings; older versions are re-measured."""
    old = profile(head_one=None)
    assert old.head(1) == pytest.approx(10.0 - 7.5)
    assert old.head(4) == pytest.approx(2.5 * old.forward(4) / old.forward(1))
    v8 = {k: v for k, v in old.to_dict().items() if k != "head_ms"} | {"version": 8}
    assert CostProfile.from_dict(v8).head(1) == pytest.approx(2.5)
    new = profile()
    assert CostProfile.from_dict(new.to_dict()) == new
    with pytest.raises(ValueError):
        CostProfile.from_dict(new.to_dict() | {"version": 7})


def test_verification_by_head_is_one_test_for_drafting_and_pricing():
    engine = SimpleNamespace(draft_vocab=object())
    assert verifies_by_head(engine, SkipSet(), None)
    assert not verifies_by_head(engine, SkipSet.of([1], []), None), "a skipped sublayer: not the full model"
    assert not verifies_by_head(engine, SkipSet(), "float16"), "another precision: not the full model"
    assert not verifies_by_head(SimpleNamespace(draft_vocab=None), SkipSet(), None), "the draft head is the full one"
    assert not verifies_by_head(engine, None, None)
    batch_share.join()
    try:
        assert not verifies_by_head(engine, SkipSet(), None), "in a server batch, the batch's pass verifies"
    finally:
        batch_share.reset()
    assert verifies_by_head(engine, SkipSet(), None)


# -- the economy ------------------------------------------------------------------------------------


def test_the_economy_prices_head_only_rounds_by_their_head():
    prof = profile()
    step = prof.draft_step(SkipSet())
    plain, head = Economy(prof, step), Economy(prof, step, head_only=True)
    assert head.verify_ms(1) == plain.verify_ms(1) == 10.0
    assert head.verify_ms(4) == pytest.approx(7.5 + 2.5 * 1.15)
    head.first_token_acceptance = plain.first_token_acceptance = 0.95
    # a first drafted token: a draft step and a 2-row verification against a plain round
    assert not plain.worth_drafting(), "7.5 + 13 - 10 ms for 0.95 of a 10 ms token"
    assert head.worth_drafting(), "7.5 + (7.5 + 2.625) - 10 ms"
    assert head.worth_another_draft(0.95, 0.95, tree_size=3) and not plain.worth_another_draft(0.95, 0.95, 3)
    plain.rebind(step, head_only=True)
    assert plain.head_only and plain.verify_ms(4) == head.verify_ms(4)


def test_head_only_rounds_measured_as_priced_leave_the_scales_alone():
    """A head-only round's verification (its finish: one step and the head) is priced as such, so measuring
    exactly the price keeps verify_scale at 1, and the draft steps alone set the draft's running cost."""
    prof = profile()
    step = prof.draft_step(SkipSet())
    econ = Economy(prof, step, head_only=True)
    for _ in range(20):
        econ.observe(tokens=5, round_ms=4 * step + prof.verification(5, step), draft_steps=4, draft_ms=4 * step,
                     verified=5, verify_ms=prof.verification(5, step), first_kept=True)  # fmt: skip
    assert econ.verify_scale == pytest.approx(1.0) and econ.draft_scale == pytest.approx(1.0)
    assert econ.cost_correction() == pytest.approx(1.0)


# -- ASD's choice -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("vocab", "head", "pays"), [(object(), (2.5, 0.05), True), (None, (2.5, 0.05), False),
                                                     (object(), (3.0, 1.0), False)])  # fmt: skip
def test_asd_drafts_skipping_nothing_where_its_head_only_price_pays(vocab, head, pays):
    """Drafts that skip nothing are always kept, all others never.  Priced as a draft plus a verification pass
    (no draft vocabulary) the empty set loses (c 0.75 and each verified row +30%); verified by a 2.5 ms head
    alone (+5% a row) it pays, and the gate drafts the k its head-only price peaks at; behind a head of 3 ms a
    row (each node's step and head: 10.5 ms, more than the 10 ms of a token) it loses again."""
    prof = profile(*head)
    drafter = gated_drafter()
    policy = AutoAsdPolicy(profile=prof)
    policy.bind(fake_model(vocab), drafter)
    policy.propose(NO_SKIP_COS, L)
    empty = next(o for o in policy.options if o.skip.is_empty)
    assert empty.head_only == (vocab is not None)
    used = drive(policy, 200)
    if pays:
        assert policy.choice.pays and policy.options[policy.choice.pick].skip.is_empty
        assert len(used) > 150 and all(s.is_empty for s in used[-20:])
        a = policy.learner.estimate(empty, 1.0, policy.learner.scale())[0]
        k = best_draft_length(a, empty.cost, prof.verify_curve(12, prof.draft_step(SkipSet())))
        assert drafter.length.length == k and k > best_draft_length(a, empty.cost, prof.verify_curve(12))
    else:
        assert not policy.choice.pays and len(used) < 40


def test_asd_in_a_server_batch_prices_the_empty_set_as_verified_by_the_batch():
    batch_share.join()
    try:
        policy = AutoAsdPolicy(profile=profile())
        policy.bind(fake_model(object()), gated_drafter())
        policy.propose(NO_SKIP_COS, L)
    finally:
        batch_share.reset()
    assert not any(o.head_only for o in policy.options)


def test_swift_prices_the_empty_set_by_its_head_where_it_verifies_so():
    """SWIFT's objective (and its choice of a starting set) reads the same head-only price; skip sets keep theirs."""
    from selfspec.policies.swift import predicted_speedup

    prof = profile()
    assert predicted_speedup(prof, SkipSet(), 0.95) < 1.0 < predicted_speedup(prof, SkipSet(), 0.95, head_only=True)
    some = SkipSet.of([1, 2], [])
    assert predicted_speedup(prof, some, 0.9, head_only=True) == predicted_speedup(prof, some, 0.9)


# -- real models: lossless while drafting by head -------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize(("method", "options"), [("asd", {}), ("auto", {}), ("auto", {"draft_dtype": "same"})])
def test_asd_and_auto_stay_lossless_drafting_by_head(name, method, options, request, monkeypatch):
    """Under the read-bound profile (conftest) both models' empty set pays by its head-only price: asd and auto
    draft it, verified by the head alone, and give vanilla's tokens, greedy and with seeded sampling (also auto
    with ``draft_dtype=same``, whose layer-skip source has no economy: its gain reads the profile's step)."""
    from selfspec.model.engine import Engine

    model = request.getfixturevalue(name)
    heads = []
    real = Engine.head_logits
    monkeypatch.setattr(Engine, "head_logits", lambda self, hidden: heads.append(len(hidden)) or real(self, hidden))
    session = selfspec.Session(model, method, **options)
    for prompt in ("The capital of France is", "def fibonacci(n):\n    "):
        ref = selfspec.generate(model, prompt, "vanilla", max_new_tokens=40)
        out = session.generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref.token_ids
    assert heads, "some rounds were verified by the head alone"
    kw = {"temperature": 0.8, "top_p": 0.95, "seed": 5}
    ref = selfspec.generate(model, "Once upon a time", "vanilla", max_new_tokens=40, **kw)
    assert session.generate("Once upon a time", max_new_tokens=40, **kw).token_ids == ref.token_ids
