"""ASD that pays (``asd``, preset auto): ADMG's alpha / m / n chosen by expected speedup; and ``preset=paper``.

Whole decodings on tiny random models check that the automatic choice never
changes the output (greedy, and coupled sampling with a seed) and that it
stops drafting when no candidate can pay; hand-written costs and acceptances
check the choice itself, without timing anything.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import ARCHS, tiny_model

import selfspec
from selfspec.core.skipset import SkipSet
from selfspec.cost.costs import CostProfile, DraftCosts
from selfspec.decoding.loop import prefill_cosine
from selfspec.drafters.layerskip import AdaptiveDraftExit
from selfspec.errors import InvalidInputError
from selfspec.methods import build_policies
from selfspec.model.engine import SublayerCosine
from selfspec.policies.asd import (
    AutoAsdConfig,
    AutoAsdPolicy,
    CandidateKey,
    DraftGate,
    Option,
    candidate_keys,
    choose,
    expected_speedup,
)
from selfspec.policies.skip import AsdPolicy, admg
from selfspec.policies.swift import predicted_speedup

PROMPTS = ["abcabcabd abcab", "the cat sat on the mat. the cat", "0123456789 0123"]
FLAT_VERIFY = {1: 10.0, 2: 10.2, 4: 10.5, 8: 11.0, 16: 12.0, 32: 14.0, 64: 18.0}


def cheap_profile(num_layers: int) -> CostProfile:
    """A full draft step costs 95% of a full step, each skipped sublayer saves its share; verification nearly
    flat: drafting pays with a set that is skipped cheaply and accepted well."""
    per_sublayer = 9.0 / (2 * num_layers)
    return CostProfile("cheap", FLAT_VERIFY, {"same": DraftCosts(per_sublayer, per_sublayer, 0.5, 1.0)}, num_layers)


def dear_profile(num_layers: int) -> CostProfile:
    """A draft step costs a full step whatever is skipped (our quantised models, nearly): nothing can pay."""
    return CostProfile("dear", FLAT_VERIFY, {"same": DraftCosts(0.0, 0.0, 10.0, 1.0)}, num_layers)


def no_draft_head_profile(num_layers: int) -> CostProfile:
    """``cheap_profile`` but the draft's head is the full head (no draft vocabulary): a draft that skips nothing
    is priced at a full pass."""
    per_sublayer = 9.0 / (2 * num_layers)
    return CostProfile("full-head", FLAT_VERIFY, {"same": DraftCosts(per_sublayer, per_sublayer, 1.0, 1.0)},
                       num_layers)  # fmt: skip


def draft_head_profile(num_layers: int, head_ms: float) -> CostProfile:
    """Qwen2.5 0.5B's shape of costs: sublayers 6 of a 10 ms step (an MLP 7x an attention), the full head 4;
    the draft's head ``head_ms``.  Skipping nothing costs (6 + head_ms) / 10 of a step."""
    attention, mlp = 6.0 / (8 * num_layers), 6.0 * 7 / (8 * num_layers)
    return CostProfile("draft-head", FLAT_VERIFY, {"same": DraftCosts(attention, mlp, head_ms, 1.0)}, num_layers)


def session_with(model, profile: CostProfile, **options) -> selfspec.Session:
    session = selfspec.Session(model, "asd", draft_dtype="same", **options)
    session.skip_policy = AutoAsdPolicy(profile=profile)
    return session


COS8 = SublayerCosine(attention=(0.50, 0.99, 0.97, 0.995, 0.99, 0.60, 0.999, 0.999), mlp=(0.95,) * 8)


# -- lossless ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_asd_is_token_identical_to_vanilla(arch):
    model = tiny_model(arch)
    session = session_with(model, cheap_profile(model.num_layers))
    drafted = 0
    for prompt in PROMPTS:
        base = selfspec.generate(model, prompt, "vanilla", max_new_tokens=32)
        out = session.generate(prompt, max_new_tokens=32)
        assert out.token_ids == base.token_ids, (arch, prompt)
        drafted += out.stats.drafted
    assert drafted > 0, "cheap drafts: the policy drafted"
    assert session.skip_policy.learner.records, "what was learned is kept across prompts"


def test_auto_asd_under_coupled_sampling_emits_vanilla_samplings_tokens():
    model = tiny_model("llama", seed=7)
    session = session_with(model, cheap_profile(model.num_layers))
    drafted = 0
    for seed in (1, 2, 3):
        kw = {"temperature": 0.8, "top_p": 0.95, "seed": seed}
        base = selfspec.generate(model, PROMPTS[0], "vanilla", max_new_tokens=40, **kw)
        out = session.generate(PROMPTS[0], max_new_tokens=40, **kw)
        assert out.token_ids == base.token_ids, seed
        drafted += out.stats.drafted
    assert drafted > 0


def test_default_asd_with_measured_costs_is_lossless(tiny_llama):
    """The real default path: the tiny model's measured profile, the auto draft precision."""
    for prompt in PROMPTS[:2]:
        base = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=24)
        assert selfspec.generate(tiny_llama, prompt, "asd", max_new_tokens=24).token_ids == base.token_ids


# -- falling back to plain decoding --------------------------------------------------------------


def test_no_draft_when_no_candidate_can_pay(tiny_llama):
    session = session_with(tiny_llama, dear_profile(tiny_llama.num_layers))
    for prompt in PROMPTS:
        base = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=40)
        out = session.generate(prompt, max_new_tokens=40)
        assert out.token_ids == base.token_ids
        assert out.stats.drafted == 0 and out.stats.forwards == 40  # one verified token per round
    assert not session.skip_policy.choice.pays


def fake_model(num_layers: int, name: str = "fake") -> SimpleNamespace:
    """What the policy reads of a model: its name and shape (costs come from the injected profile)."""
    return SimpleNamespace(name=name, num_layers=num_layers, hf=SimpleNamespace(config=SimpleNamespace(model_type="x")))


def drive(policy: AutoAsdPolicy, rounds: int, accepted_of) -> list[SkipSet]:
    """Run the policy's side of ``rounds`` decoding rounds; ``accepted_of(skip)``: tokens kept of 4 drafted.
    Returns the skip sets of the rounds that drafted."""
    used = []
    for _ in range(rounds):
        skip = policy.before_round(None)
        if policy.drafting():
            used.append(skip)
            policy.observe(4, accepted_of(skip))
    return used


def test_losing_drafts_fall_back_and_are_retried_rarely():
    """Drafting could pay (cheap steps) but every draft is rejected: after a few rounds no round drafts,
    except an occasional exploring one, ever rarer."""
    policy = AutoAsdPolicy(profile=cheap_profile(8))
    policy.bind(fake_model(8))
    policy.propose(COS8, 8)
    early = drive(policy, 20, lambda skip: 0)
    late = drive(policy, 400, lambda skip: 0)
    assert len(early) < 20 and not policy.choice.pays
    assert 1 <= len(late) <= 400 // 16, "tries again now and then, never more often than every 16 rounds"


def test_a_choice_predicted_to_pay_but_measured_to_lose_only_explores():
    """The model says the small sets pay (they are always kept), the drafter's economy measured its drafting
    rounds earning 0.7 tokens per plain round's time: the policy decodes plainly, exploring now and then."""
    from selfspec.cost.economy import Economy

    prof = cheap_profile(8)
    econ = Economy(prof, prof.draft_step(SkipSet.of([1], [])))
    drafter = SimpleNamespace(economy=econ, length=DraftGate(AdaptiveDraftExit()), max_draft=12)
    policy = AutoAsdPolicy(profile=prof)
    policy.bind(fake_model(8), drafter)
    policy.propose(COS8, 8)
    drive(policy, 100, lambda skip: 4)
    assert policy.choice.pays, "kept drafts of cheap steps: predicted to pay"
    step = prof.forward(1)
    econ.observe(tokens=1, round_ms=step, draft_steps=0, draft_ms=0.0, verified=1, verify_ms=step, first_kept=None)
    for _ in range(4):  # drafting rounds: 2 tokens for 2.9 plain rounds' time
        econ.observe(tokens=2, round_ms=2.9 * step, draft_steps=3, draft_ms=1.9 * step, verified=4, verify_ms=step,
                     first_kept=True)  # fmt: skip
    assert econ.drafting_loses()
    used = drive(policy, 160, lambda skip: 4)
    assert not policy.choice.pays and len(used) <= 160 // 16
    drive(policy, 400, lambda skip: 4)  # backed off: a try every 128 rounds by now
    policy.propose(COS8, 8)  # a new prompt: its first round drafts and measures again
    assert len(drive(policy, 1, lambda skip: 4)) == 1
    assert len(drive(policy, 16, lambda skip: 4)) <= 1  # then the gate waits explore_every rounds again


def test_a_gate_closed_by_the_policy_stops_the_drafter():
    gate = DraftGate(AdaptiveDraftExit(max_draft=5), gate=lambda: False)
    assert gate.max_draft == 5 and not gate.begin_round()
    gate.gate = lambda: True
    assert gate.begin_round() and gate.should_stop(5, 0.99)


# -- the choice on hand-written inputs ------------------------------------------------------------


def test_choose_prefers_the_candidate_expected_to_pay_most():
    verify = [FLAT_VERIFY[1] / 10.0 + 0.02 * k for k in range(1, 13)]
    key = CandidateKey(0.0, None, 2)
    options = [Option(key, SkipSet.of([1], []), cost, 0.0) for cost in (0.9, 0.6, 0.3, 0.1)]
    # the cheapest drafts are rarely accepted; the 0.3-cost one often
    estimates = [(0.9, 0.92), (0.85, 0.88), (0.8, 0.83), (0.05, 0.1)]
    choice = choose(options, estimates, verify, reach=1)
    assert choice.pick == 2 and choice.pays and choice.mean_speedup > 1.5
    losing = choose(options, [(0.0, 0.01)] * 4, verify, reach=1)
    assert not losing.pays


def test_the_policy_settles_on_a_well_accepted_cheap_candidate():
    """Small sets are kept (4 of 4 drafted), larger ones never: the policy ends up drafting with a small set."""
    policy = AutoAsdPolicy(profile=cheap_profile(8))
    policy.bind(fake_model(8))
    policy.propose(COS8, 8)
    drive(policy, 300, lambda skip: 4 if len(skip) <= 3 else 0)
    assert policy.choice.pays
    chosen = policy.options[policy.choice.pick].skip
    assert 1 <= len(chosen) <= 3
    used = drive(policy, 50, lambda skip: 4 if len(skip) <= 3 else 0)
    assert len(used) == 50 and all(len(s) <= 3 for s in used[-10:])


def test_what_is_learned_carries_over_to_the_next_prompt():
    policy = AutoAsdPolicy(profile=cheap_profile(8))
    policy.bind(fake_model(8))
    policy.propose(COS8, 8)
    drive(policy, 200, lambda skip: 4 if len(skip) <= 3 else 0)
    policy.bind(fake_model(8))
    other = SublayerCosine(attention=tuple(reversed(COS8.attention)), mlp=COS8.mlp)
    policy.propose(other, 8)
    assert policy.choice.pays, "the next prompt starts from what the first taught"
    policy.bind(fake_model(8, name="other"))
    assert not policy.learner.records, "another model starts afresh"


def test_expected_speedup_is_swifts_formula():
    prof = cheap_profile(8)
    verify = [prof.forward(k + 1) / prof.forward(1) for k in range(1, 17)]
    for skip in (SkipSet.of([1, 2], [3]), SkipSet.of(range(6), range(6))):
        for a in (0.0, 0.3, 0.8, 1.0):
            assert expected_speedup(a, prof.draft_ratio(skip), verify) == pytest.approx(
                predicted_speedup(prof, skip, a, "same", 16)
            )


def test_candidates_follow_the_cosine_profile_and_run_conservative_to_aggressive():
    keys = candidate_keys()
    assert len(keys) == len(set(keys)) and CandidateKey(0.0, None, 2) in keys
    assert CandidateKey(0.0, None, 2).skip_set(COS8) == SkipSet()
    # a quarter of the 6 unguarded attention sublayers (n=2): the 2 of highest cosine (indices 3 and 1 or 4)
    assert CandidateKey(0.25, None, 2).skip_set(COS8) == admg(COS8, alpha=0.99, m=1, n=2, variant="cs+r2")
    policy = AutoAsdPolicy(profile=cheap_profile(8))
    policy.bind(fake_model(8))
    policy.propose(COS8, 8)
    costs = [o.cost for o in policy.options]
    assert costs == sorted(costs, reverse=True)
    assert len({o.skip for o in policy.options}) == len(policy.options)
    assert policy.options[0].skip == SkipSet(), "skipping nothing (the draft head saves 5%) is the most conservative"
    full_head = AutoAsdPolicy(profile=no_draft_head_profile(8))
    full_head.bind(fake_model(8))
    full_head.propose(COS8, 8)
    assert SkipSet() not in {o.skip for o in full_head.options}, "a draft that is the full pass is no candidate"


@pytest.mark.parametrize("rules", ["cs", "cs+r2", "r1+r2", "admg"])
def test_a_table5_row_chooses_among_its_own_rules_only(rules):
    """preset=auto with a variant: every candidate's skip set is one ADMG builds with exactly that row's rules
    (CS thresholding skips attention only; rule 1 every m-th layer's attention and MLP; rule 2 keeps the last
    n layers whole), and the family is a subset of the default one (``cs`` aside: it has no guard)."""
    keys = candidate_keys(rules)
    assert keys and len(keys) == len(set(keys))
    for key in keys:
        uses_cs, uses_r1, guarded = key.share > 0, key.m is not None, key.n > 0
        assert (uses_cs, uses_r1, guarded) == {"cs": (True, False, False), "cs+r2": (True, False, True),
                                               "r1+r2": (False, True, True), "admg": (True, True, True)}[rules]
        skip = key.skip_set(COS8)
        k = round(key.share * (8 - key.n))  # the share of the unguarded attention sublayers, by cosine
        alpha = sorted(COS8.attention[: 8 - key.n], reverse=True)[k - 1] if k else 2.0
        assert skip == admg(COS8, alpha=alpha, m=key.m or 1, n=key.n, variant=rules)
    if rules != "cs":
        assert set(keys) <= set(candidate_keys())
    skip_policy, drafter = build_policies("asd", {"preset": "auto", "variant": rules})
    assert isinstance(skip_policy, AutoAsdPolicy) and isinstance(drafter.length, DraftGate)
    assert skip_policy.config.rules == rules
    policy = AutoAsdPolicy(AutoAsdConfig(rules=rules), profile=cheap_profile(8))
    policy.bind(fake_model(8))
    policy.propose(COS8, 8)
    made = {k.skip_set(COS8) for k in keys}
    assert policy.options and all(o.skip in made for o in policy.options)


# -- the paper's preset ---------------------------------------------------------------------------


def test_preset_paper_reproduces_the_old_skip_sets(tiny_llama):
    skip_policy, drafter = build_policies("asd", {"preset": "paper"})
    assert isinstance(skip_policy, AsdPolicy) and not isinstance(drafter.length, DraftGate)
    assert skip_policy.propose(COS8, 8) == admg(COS8, alpha=0.985, m=3, n=2)
    out = selfspec.generate(tiny_llama, PROMPTS[0], "asd", preset="paper", max_new_tokens=16)
    cos = prefill_cosine(tiny_llama, tiny_llama.encode(PROMPTS[0]))
    assert out.stats.skip_set == admg(cos, alpha=0.985, m=3, n=2).to_dict()


def test_admg_values_and_variants_imply_the_paper_preset():
    for opts in ({"alpha": 0.99}, {"m": 4}, {"n": 3}, {"variant": "cs"}, {"variant": "r1+r2", "preset": "paper"}):
        skip_policy, drafter = build_policies("asd", opts)
        assert isinstance(skip_policy, AsdPolicy), opts
    assert build_policies("asd", {"variant": "cs"})[0].propose(COS8, 8) == admg(COS8, alpha=0.985, m=3, n=2,
                                                                                  variant="cs")  # fmt: skip
    skip_policy, drafter = build_policies("asd", {})
    assert isinstance(skip_policy, AutoAsdPolicy) and isinstance(drafter.length, DraftGate)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"preset": "fast"}, "preset must be 'auto' or 'paper'"),
        ({"preset": "auto", "alpha": 0.99}, "preset=auto chooses alpha, m and n itself"),
        ({"preset": "auto", "variant": "x"}, "unknown ASD rules"),
        ({"preset": "paper", "variant": "all"}, "unknown ASD variant"),
        ({"explore_every": 0}, "explore_every must be >= 1"),
        ({"explore_every": "often"}, "bad option value"),
        ({"preset": "paper", "explore_every": 4}, "preset=auto only"),
        ({"alpha": 1.5}, "alpha must be in"),
        ({"variant": "x"}, "unknown ASD variant"),
    ],
)
def test_bad_asd_options_are_clear_errors(options, message):
    with pytest.raises(InvalidInputError, match=message):
        build_policies("asd", options)


@pytest.mark.parametrize("method", ["asd", "swift"])
def test_the_measured_gate_follows_the_costs_it_is_given(tiny_llama, method):
    """The whole default path (the model's cost profile, the rounds' clock, the drafter's economy) under
    hand-written costs given through the simulated clock: drafting where drafts are cheap; where a draft costs a
    full step, none (ASD's gate), or only SWIFT's exploring rounds (one in ``explore_every`` idle ones); the
    same tokens either way."""
    from selfspec.core import clock

    L = tiny_llama.num_layers
    drafted, exploring = {}, 0
    for name, profile in (("cheap", cheap_profile(L)), ("dear", dear_profile(L))):
        with clock.simulated(profile):
            session = selfspec.Session(tiny_llama, method, draft_dtype="same")
            drafted[name] = 0
            for prompt in PROMPTS:
                base = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=48)
                out = session.generate(prompt, max_new_tokens=48)
                assert out.token_ids == base.token_ids, (name, prompt)
                drafted[name] += out.stats.drafted
                if name == "dear" and method == "swift":
                    assert len(out.stats.accept_lengths) <= out.stats.forwards // 8 + 1, "exploring rounds only"
                    exploring += out.stats.drafted
    assert drafted["cheap"] > 0, drafted
    assert drafted["dear"] == exploring, drafted
    assert drafted["dear"] < drafted["cheap"], drafted


# -- the draft that skips nothing: priced by what its head saves ------------------------------------


def test_skipping_nothing_is_priced_by_its_head():
    """A draft pass = base (embedding, norm, the draft's head) + the sublayers it keeps, the empty set too."""
    prof = draft_head_profile(8, head_ms=0.5)
    assert prof.draft_ratio(SkipSet()) == pytest.approx(0.65)
    assert prof.draft_ratio(SkipSet.of([], [3])) == pytest.approx(0.65 - 6 * 7 / 64 / 10)
    assert prof.pass_ms(1, SkipSet(), draft=True) == pytest.approx(6.5)
    assert prof.pass_ms(1, SkipSet()) == pytest.approx(10.0), "a full pass keeps the full head"
    assert no_draft_head_profile(8).draft_ratio(SkipSet()) == pytest.approx(1.0), "never above a full pass"


def test_a_drafts_extra_rows_cost_a_full_passs_unless_it_reads_fewer_weights():
    """The simulated clock's multi-row draft passes (guessed rows riding along, S3D's blocks): the whole model
    over a smaller head adds a full pass's cost per extra row; a draft that skips sublayers scales with its
    one-row cost."""
    prof = draft_head_profile(8, head_ms=0.5)
    extra = prof.forward(3) - prof.forward(1)
    assert extra > 0
    assert prof.pass_ms(3, SkipSet(), draft=True) == pytest.approx(prof.pass_ms(1, SkipSet(), draft=True) + extra)
    skip = SkipSet.of([1, 2], [3])
    ratio = prof.draft_ratio(skip)
    assert prof.pass_ms(3, skip) == pytest.approx(ratio * prof.forward(3))


NO_SKIP_COS = SublayerCosine(attention=(0.9,) * 8, mlp=(0.9,) * 8)  # every skip damages: the prior says so


@pytest.mark.parametrize(("head_ms", "pays"), [(0.5, True), (3.9, False)])
def test_the_policy_drafts_skipping_nothing_when_its_head_makes_it_pay(head_ms, pays):
    """A draft head of 0.5 ms (c 0.65) accepted always: ASD drafts with the empty set; one of 3.9 ms (c 0.99):
    the empty set is no candidate, and the damaged sets never pay: plain decoding."""
    policy = AutoAsdPolicy(profile=draft_head_profile(8, head_ms))
    policy.bind(fake_model(8))
    policy.propose(NO_SKIP_COS, 8)
    used = drive(policy, 200, lambda skip: 4 if skip.is_empty else 0)
    if pays:
        assert policy.choice.pays and policy.options[policy.choice.pick].skip == SkipSet()
        assert len(used) > 150 and all(s == SkipSet() for s in used[-20:])
    else:
        assert SkipSet() not in {o.skip for o in policy.options}
        assert not policy.choice.pays and len(used) < 40


@pytest.mark.parametrize(("head_ms", "pays"), [(0.5, True), (3.9, False)])
def test_swift_starts_from_skipping_nothing_when_its_head_makes_it_pay(tiny_llama, head_ms, pays):
    """SWIFT's search starts from the empty set where the profile predicts it pays, else from uniform skipping."""
    from selfspec.core import clock
    from selfspec.policies.swift import uniform_skip_set

    L = tiny_llama.num_layers
    with clock.simulated(draft_head_profile(L, head_ms)):
        session = selfspec.Session(tiny_llama, "swift", draft_dtype="same")
        out = session.generate(PROMPTS[1], max_new_tokens=24)
        assert out.token_ids == selfspec.generate(tiny_llama, PROMPTS[1], "vanilla", max_new_tokens=24).token_ids
    start = SkipSet() if pays else uniform_skip_set(L)
    assert session.skip_policy.state.best_set == start, "no search step yet (24 tokens < the 32-token window)"


@pytest.mark.parametrize("arch", ARCHS)
def test_drafting_with_nothing_skipped_is_token_identical_to_vanilla(arch):
    """The draft head's subset (its tokens, -inf elsewhere) never changes the output: greedy, and coupled."""
    from selfspec.core import clock

    model = tiny_model(arch)
    with clock.simulated(draft_head_profile(model.num_layers, 0.5)):
        session = selfspec.Session(model, "static", skip_set=SkipSet(), draft_dtype="same")
        for prompt in PROMPTS:
            base = selfspec.generate(model, prompt, "vanilla", max_new_tokens=32)
            out = session.generate(prompt, max_new_tokens=32)
            assert out.token_ids == base.token_ids, (arch, prompt)
            assert out.stats.drafted > 0
        kw = {"temperature": 0.8, "seed": 3}
        base = selfspec.generate(model, PROMPTS[0], "vanilla", max_new_tokens=32, **kw)
        assert session.generate(PROMPTS[0], max_new_tokens=32, **kw).token_ids == base.token_ids
