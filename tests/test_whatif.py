"""``selfspec whatif``: the replay of draft policies on vanilla outputs keeps its books right, and the traces it
replays are what the model and its draft predict."""

from __future__ import annotations

import pytest

from selfspec.api import Session
from selfspec.bench.whatif import (
    POLICIES,
    Costs,
    Trace,
    Tree,
    collect,
    lookup_chain,
    recycle_chain,
    replay,
    report,
)
from selfspec.cli.main import main
from selfspec.datasets import PromptItem
from selfspec.drafters.lookup import NGRAM_SIZES
from selfspec.drafters.suffix import NgramIndex
from selfspec.errors import InvalidInputError

FLAT = Costs({t: 1.0 + 0.1 * (t - 1) for t in range(1, 17)}, draft_step=0.5)


def _lookup(text: list[int], length: int) -> list[int]:
    index = NgramIndex(NGRAM_SIZES, keep=1)
    index.extend(text)
    return lookup_chain(index, text, length)


def test_lookup_takes_the_latest_continuation_of_the_longest_match():
    assert _lookup([1, 2, 3, 9, 8, 1, 2, 3], 2) == [9, 8]
    assert _lookup([5, 1, 7, 2, 1, 6, 3, 1], 3) == [6, 3, 1]  # "1" last followed by 6
    assert _lookup([1, 2, 3], 4) == []


def test_recycle_follows_each_tokens_latest_top_successor():
    assert recycle_chain({1: [2, 9], 2: [3], 3: [1]}, 1, 4) == [2, 3, 1, 2]
    assert recycle_chain({1: [2]}, 1, 3) == [2]  # 2 has no successor yet


def test_a_tree_accepts_the_longest_path_it_holds():
    tree = Tree()
    tree.add([1, 2, 3])
    tree.add([1, 4])
    assert len(tree) == 5  # root, 1, 2, 3, 4: the shared prefix is one node
    assert tree.accepted([1, 4, 5]) == 2 and tree.accepted([1, 2, 3, 7]) == 3 and tree.accepted([9]) == 0


def _trace(out: list[int], draft_right: bool) -> Trace:
    prompt = [7, 8, 9, 1, 2, 3, 4, 5]
    full = prompt + out
    draft = {j: (full[j] if draft_right else -1) for j in range(len(prompt), len(full))}
    top = [[full[j + 1]] if j + 1 < len(full) else [0] for j in range(len(full) - 1)]
    return Trace("copy", len(prompt), full, top, draft)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_produces_every_output_token_once(policy):
    traces = [_trace([1, 2, 3, 4, 5, 6], True), _trace([3, 1, 1, 2, 6, 6, 6], False)]
    r = replay(traces, FLAT, policy)
    assert r.tokens == sum(len(t.tokens) - t.prompt_len - 1 for t in traces)  # the first comes from the prefill
    assert r.rounds <= r.tokens and r.cost >= r.rounds  # a round costs at least one step


def test_a_right_draft_is_accepted_whole_and_priced_by_its_steps():
    trace = _trace(list(range(20, 33)), True)  # no n-gram of the output repeats: only the draft can be right
    skip = replay([trace], FLAT, "layerskip", draft_len=3)
    assert skip.mean_accepted == pytest.approx(12 / 3)  # 12 tokens after the prefill's, 3 drafted + 1 per round
    assert skip.cost == pytest.approx(3 * (3 * 0.5 + 1.3))
    assert replay([trace], FLAT, "lookup").mean_accepted == pytest.approx(1.0)  # nothing to copy
    wrong = replay([_trace(list(range(20, 33)), False)], FLAT, "layerskip")
    assert wrong.speedup < 1.0  # drafts that are never right cost time


def test_copying_pays_for_lookup_and_a_merged_tree_costs_its_nodes():
    trace = _trace([1, 2, 3, 4, 5, 9, 9, 9, 1, 2, 3, 4, 5], False)
    lookup = replay([trace], FLAT, "lookup")
    assert lookup.mean_accepted > 1.5 and lookup.speedup > 1.0
    merged = replay([trace], FLAT, "lookup+layerskip")
    assert merged.nodes > lookup.nodes and merged.speedup < lookup.speedup  # wrong drafts: nodes and steps paid


def test_unknown_policy():
    with pytest.raises(InvalidInputError, match="unknown policy"):
        replay([], FLAT, "eagle")


def test_collected_traces_are_the_vanilla_output_and_its_predictions(tiny_llama):
    prompts = [PromptItem("a", "t1", "the cat sat on the mat. the cat sat on"), PromptItem("b", "t2", "abc abc ab")]
    traces, costs = collect(tiny_llama, prompts, max_new_tokens=12)
    vanilla = Session(tiny_llama, "vanilla")
    for item, tr in zip(prompts, traces, strict=True):
        out = list(vanilla.generate(item.prompt, max_new_tokens=12).token_ids)
        assert tr.tokens == tiny_llama.encode(item.prompt) + out and tr.prompt_len == len(tr.tokens) - len(out)
        for j in range(tr.prompt_len, len(tr.tokens)):  # greedy: the model's top token is the output's next
            assert tr.top[j - 1][0] == tr.tokens[j]
        assert set(tr.draft) == set(range(tr.prompt_len, len(tr.tokens)))
    assert costs.verify[1] == 1.0 and all(costs.verify[t] >= 1.0 for t in costs.verify) and costs.draft_step > 0
    table = report(traces, costs, [replay(traces, costs, p) for p in POLICIES])
    assert all(f"| {p} |" in table for p in POLICIES) and "t1" in table and "t2" in table


def test_cli_refuses_categories_of_another_dataset(capsys):
    assert main(["whatif", "--dataset", "xsum", "--categories", "qa"]) == 2
    assert "--categories applies to --dataset spec-bench only" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_that_skips_nothing_chooses_the_models_token(tiny_llama, temperature):
    """With no sublayer skipped the draft is the full model: greedy, or coupled with the same noise, its token
    at every position is the vanilla output's (a wrong position offset of the noise fails this)."""
    from selfspec.bench.whatif import _trace
    from selfspec.core.sampling import SamplingParams
    from selfspec.core.skipset import SkipSet

    params = SamplingParams(temperature=temperature, seed=5)
    prompt = "the cat sat on the mat. the cat"
    out = list(Session(tiny_llama, "vanilla").generate(prompt, max_new_tokens=16, temperature=temperature,
                                                       seed=5).token_ids)  # fmt: skip
    ids = tiny_llama.encode(prompt)
    trace = _trace(tiny_llama, "t", ids, out, SkipSet(), params)
    assert [trace.draft[j] for j in range(len(ids), len(ids) + len(out))] == out


def test_collect_refuses_the_rejection_scheme(tiny_llama):
    from selfspec.core.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, seed=1, scheme="rejection")
    with pytest.raises(InvalidInputError, match="exact match"):
        collect(tiny_llama, [PromptItem("a", "t", "abc")], sampling=params)
