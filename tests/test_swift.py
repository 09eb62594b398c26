"""SWIFT on tiny models: lossless across a stream of prompts, the optimiser really optimises, its state persists."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import tiny_model

import selfspec
from selfspec.core.skipset import SkipSet
from selfspec.cost.costs import CostProfile, DraftCosts
from selfspec.decoding.loop import RoundContext, prefill
from selfspec.errors import InvalidInputError
from selfspec.policies.swift import SwiftConfig, SwiftPolicy, predicted_speedup, uniform_skip_set

STREAM = [
    "The quick brown fox jumps over the lazy dog; sliding windows must hold over long prompts too.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Summarise: the council met on Tuesday and agreed to publish the budget report next month.",
    "Q: What is 12 times 12? A: Let us think step by step about the numbers involved here.",
]
# optimise at every round of these short runs, and never stop for a good score
FAST = {"context_window": 8, "budget": 1000.0, "bo_interval": 3, "score_threshold": 1.0}


def _stream_equals_vanilla(model, **options):
    session = selfspec.Session(model, "swift", **FAST, **options)
    for prompt in STREAM:
        base = selfspec.generate(model, prompt, "vanilla", max_new_tokens=40)
        out = session.generate(prompt, max_new_tokens=40)
        assert out.token_ids == base.token_ids, prompt
        assert out.stats.new_tokens == len(base.token_ids)
    state = session.skip_policy.state
    assert state.steps > FAST["bo_interval"], "the optimiser took (Bayesian) steps"
    assert len(state.observations) == state.steps
    return state


def test_swift_equals_vanilla_over_a_stream(tiny):
    _stream_equals_vanilla(tiny)


@pytest.mark.parametrize(
    "options",
    [
        {"tree": False},
        {"schedule": "paper", "skip_ratio": 0.45, "objective": "matchness", "search": "paper"},  # the paper
        {"draft_dtype": "float16", "draft_length": 3},
    ],
    ids=["no-tree", "paper", "fp16-fixed-length"],
)
def test_swift_variants_equal_vanilla(tiny_llama, options):
    _stream_equals_vanilla(tiny_llama, **options)


def test_optimiser_improves_on_a_bad_start(tiny_llama):
    """In the model's own precision the search starts from SWIFT's uniform set and must find better ones."""
    state = _stream_equals_vanilla(tiny_llama, draft_dtype="same")
    assert state.history, "at least one candidate beat the uniform start"
    assert state.best_set != uniform_skip_set(tiny_llama.num_layers)


def test_trees_are_used_and_lossless_with_forced_wide_trees(tiny_llama):
    """The paper's schedule on a near-uniform draft builds wide trees; output still equals vanilla."""
    session = selfspec.Session(tiny_llama, "swift", schedule="paper", epsilon=0.99, skip_ratio=0.2,
                               objective="matchness", **FAST)  # fmt: skip
    for prompt in STREAM[:2]:
        base = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=40)
        out = session.generate(prompt, max_new_tokens=40)
        assert out.token_ids == base.token_ids
        assert out.stats.verified_tokens > out.stats.forwards - 1 + out.stats.drafted, "leaves were verified"


@pytest.mark.parametrize(
    "options, reason",
    [({"max_steps": 3}, "max steps"), ({"patience": 1, "seed": 1}, "patience"), ({"score_threshold": 0.01}, "score")],
)
def test_optimisation_stops_by_the_papers_rules(tiny_llama, options, reason):
    session = selfspec.Session(tiny_llama, "swift", **{**FAST, **options})
    for prompt in STREAM:
        session.generate(prompt, max_new_tokens=40)
    state = session.skip_policy.state
    assert state.done and state.stop_reason.startswith(reason)
    steps = state.steps
    policy = session.skip_policy
    policy.config = dataclasses.replace(policy.config, reopen_drop=1.0)  # whatever the new text scores
    session.generate(STREAM[0], max_new_tokens=40)
    assert state.done and state.steps == steps, "no more steps once stopped"


def test_a_drop_in_matchness_reopens_the_search(tiny_llama):
    session = selfspec.Session(tiny_llama, "swift", **{**FAST, "max_steps": 3})
    session.generate(STREAM[0], max_new_tokens=40)
    state = session.skip_policy.state
    assert state.done
    state.matchness_at_stop = 2.0  # the next text scores far below what the best set scored when the search stopped
    session.generate(STREAM[1], max_new_tokens=40)
    assert state.steps > 3 and state.done  # searched again (and stopped again: max_steps counts every step)


def test_the_search_gives_up_when_no_skip_set_pays(tiny_llama, monkeypatch):
    """Where a draft step costs about what a full step does (our quantised models), no set is predicted to
    pay: the search stops instead of spending its budget, and reopens if the text gets easier to draft."""
    from selfspec.policies import swift

    monkeypatch.setattr(swift, "predicted_speedup", lambda profile, skip, m, precision, **kw: 0.9 * m)
    session = selfspec.Session(tiny_llama, "swift", **FAST, give_up_after=5)
    for prompt in STREAM[:2]:
        base = selfspec.generate(tiny_llama, prompt, "vanilla", max_new_tokens=40)
        assert session.generate(prompt, max_new_tokens=40).token_ids == base.token_ids
    state = session.skip_policy.state
    assert state.done and state.stop_reason == swift.NO_SET_PAYS
    steps = state.steps
    policy = session.skip_policy
    policy.config = dataclasses.replace(policy.config, reopen_drop=1.0)  # whatever the new text scores
    session.generate(STREAM[2], max_new_tokens=40)
    assert state.steps == steps, "no more steps once given up"
    policy.config = dataclasses.replace(policy.config, reopen_drop=0.1)
    state.matchness_at_stop = -1.0  # the next text scores far above what the best set scored at the stop
    session.generate(STREAM[3], max_new_tokens=40)
    assert state.steps > steps, "searched again"


def test_matchness_of_the_full_model_is_one():
    """Teacher-forced over its own greedy output, the undamaged model predicts every next token."""
    model = tiny_model("llama", seed=5)
    prompt = model.encode(STREAM[0])
    gen = list(selfspec.generate(model, STREAM[0], "vanilla", max_new_tokens=20).token_ids)
    pf = prefill(model, prompt, max_new_tokens=20, max_nodes=40)
    policy = SwiftPolicy(SwiftConfig(context_window=16))
    policy.bind(model)
    ctx = RoundContext(model, pf.cache, len(prompt), gen, SkipSet())
    assert policy.matchness(ctx, SkipSet()) == 1.0
    damaged = policy.matchness(ctx, SkipSet.of(range(6), range(6)))
    assert damaged < 1.0


def test_state_persists_per_model(tmp_path, tiny_llama):
    path = tmp_path / "swift.json"
    first = selfspec.Session(tiny_llama, "swift", state=str(path), **FAST)
    for prompt in STREAM[:2]:
        first.generate(prompt, max_new_tokens=30)
    saved = first.skip_policy.state
    data = json.loads(path.read_text())
    assert len(data) == 1 and next(iter(data.values()))["steps"] == saved.steps

    other = tiny_model("qwen2")
    selfspec.Session(other, "swift", state=str(path), **FAST).generate(STREAM[0], max_new_tokens=30)
    assert len(json.loads(path.read_text())) == 2, "each model keeps its own entry"

    second = selfspec.Session(tiny_llama, "swift", state=str(path), **FAST)
    second.skip_policy.bind(tiny_llama)
    assert second.skip_policy.state.best == saved.best
    assert second.skip_policy.state.steps == saved.steps
    out = second.generate(STREAM[2], max_new_tokens=30)
    assert out.token_ids == selfspec.generate(tiny_llama, STREAM[2], "vanilla", max_new_tokens=30).token_ids
    assert second.skip_policy.state.steps >= saved.steps


def test_corrupt_state_is_a_clear_error(tmp_path, tiny_llama):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(InvalidInputError, match="unreadable"):
        selfspec.Session(tiny_llama, "swift", state=str(path)).generate(STREAM[0], max_new_tokens=5)


def test_uniform_start_never_skips_first_or_last_layer():
    s = uniform_skip_set(30)
    assert 0 not in s.attention | s.mlp and 29 not in s.attention | s.mlp
    assert s.attention == s.mlp == frozenset(range(1, 29, 2))


def _profile(draft_ms_per_sublayer: float = 1.0) -> CostProfile:
    L = 10
    return CostProfile(
        key="synthetic",
        forward_ms={1: 25.0, 2: 26.0, 4: 28.0, 8: 40.0, 16: 60.0, 32: 100.0},
        drafts={"same": DraftCosts(draft_ms_per_sublayer, draft_ms_per_sublayer, 5.0, 1.0)},
        num_layers=L,
    )


def test_predicted_speedup_trades_acceptance_against_cost():
    prof = _profile()
    light, heavy = SkipSet.of(range(8), range(8)), SkipSet.of([1], [])
    assert predicted_speedup(prof, light, 0.9) > predicted_speedup(prof, heavy, 0.9)  # same acceptance, cheaper
    assert predicted_speedup(prof, light, 0.9) > predicted_speedup(prof, light, 0.5)  # same cost, better drafts
    assert predicted_speedup(prof, light, 0.0) < 1.0  # a draft that is never right only costs


@pytest.mark.parametrize(
    "options, message",
    [
        ({"skip_ratio": 1.5}, "skip_ratio"),
        ({"skip_ratio": "half"}, "skip_ratio"),
        ({"objective": "matchness"}, "needs a fixed skip_ratio"),
        ({"search": "genetic"}, "search"),
        ({"schedule": "gpu"}, "schedule"),
        ({"tree": "maybe"}, "true or false"),
        ({"budget": 0}, "budget"),
        ({"context_window": 1}, "context_window"),
        ({"draft_dtype": "int3"}, "draft_dtype"),
        ({"alpha": 0.9}, "no option"),
    ],
)
def test_bad_options(options, message):
    from selfspec.methods import build_policies

    with pytest.raises(InvalidInputError, match=message):
        build_policies("swift", options)


def test_cheap_precision_starts_from_the_full_draft(tiny_llama):
    """With float16 drafts the adaptive search starts from no skipping; with the model's precision, uniform."""
    from selfspec.methods import build_policies

    for dtype, expected in (("float16", SkipSet()), ("same", uniform_skip_set(tiny_llama.num_layers))):
        policy, drafter = build_policies("swift", {"draft_dtype": dtype})
        policy.bind(tiny_llama, drafter)
        assert policy.propose(None, tiny_llama.num_layers) == expected
        # the reason for the different start: float16 drafts run in another precision than the fp32 model
        assert (drafter.torch_dtype(tiny_llama) is not None) == (dtype == "float16"), dtype


def test_the_budget_counts_the_scoring_pass_about_to_run(tiny_llama):
    """A generation too short to earn a scoring pass within the budget never runs one (the demo's one-off prompt);
    a session long enough does, within the budget."""
    session = selfspec.Session(tiny_llama, "swift", **{**FAST, "budget": 0.05})
    policy = session.skip_policy
    session.generate(STREAM[0], max_new_tokens=40)
    policy._pass_seconds = 3600.0  # one pass would cost an hour: more than 5% of any decoding here
    steps = policy.state.steps
    session.generate(STREAM[1], max_new_tokens=40)
    assert policy.state.steps == steps and policy.state.optimise_seconds < 1.0
    policy._pass_seconds = 0.0  # free: the budget admits passes again
    session.generate(STREAM[2], max_new_tokens=40)
    assert policy.state.steps > steps


def test_the_search_budget_shrinks_while_nothing_pays(tiny_llama):
    """Speed objective: every quarter of give_up_after steps without a set predicted to pay halves the search's
    share of decoding time (down to an eighth); a paying set restores it."""
    session = selfspec.Session(tiny_llama, "swift", **{**FAST, "budget": 0.08, "give_up_after": 8})
    session.generate(STREAM[0], max_new_tokens=4)
    policy, state = session.skip_policy, session.skip_policy.state
    state.best_score = 0.7
    shares = []
    for steps in (0, 1, 2, 4, 6, 100):
        state.steps_open = steps
        shares.append(policy._budget_share())
    assert shares == [0.08, 0.08, 0.04, 0.02, 0.01, 0.01]
    state.best_score = 1.2
    assert policy._budget_share() == 0.08
