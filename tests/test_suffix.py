"""Suffix drafting: the trees it grows from earlier occurrences, its pricing, and the bounds on its memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_lookup import FlatProfile

from selfspec.core.sampling import GREEDY_SAMPLER
from selfspec.cost.economy import VerifyCurve
from selfspec.drafters.lookup import OPTIMISM
from selfspec.drafters.suffix import NgramIndex, SessionStore, SuffixDrafter
from selfspec.errors import InvalidInputError


def drafter(slope: float = 0.02, **kw) -> SuffixDrafter:
    d = SuffixDrafter(**kw)
    d._costs = VerifyCurve(FlatProfile(slope))
    return d


def propose(d: SuffixDrafter, history: list[int], budget: int = 20, sampler=GREEDY_SAMPLER):
    return d.propose(history, model=SimpleNamespace(), cache=None, skip=None, budget=budget, sampler=sampler)


def paths(tree) -> set[tuple[int, ...]]:
    """Every root-to-leaf token sequence of a tree (root excluded)."""
    kids = tree.children
    return {tuple(tree.tokens[n] for n in tree.path_to(leaf)[1:]) for leaf in range(len(tree)) if not kids[leaf]}


def test_disagreeing_occurrences_make_a_branch_each_and_the_frequent_one_comes_first():
    d = drafter(max_ngram=2, max_draft=2)
    # "1 2" was followed by "3 4" twice and by "5 6" once
    out = propose(d, [1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2])
    assert paths(out.tree) == {(3, 4), (5, 6)}
    assert out.tree.tokens[1] == 3  # the most likely node is drafted first
    assert out.passes == 0 and out.steps == out.tree.depth == 2


def test_a_single_occurrence_drafts_a_chain_like_prompt_lookup():
    d = drafter(max_draft=3)
    out = propose(d, [1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert out.tree.is_chain and out.tree.tokens == (3, 4, 5, 9)


def test_nothing_is_drafted_where_verifying_costs_more_than_it_earns():
    d = drafter(slope=0.9)  # a second token in the pass costs nearly a whole step
    for n in d.sizes:
        d._drafted[n], d._accepted[n] = 100.0, 5.0  # and matches were rarely accepted
    assert propose(d, [1, 2, 3, 1, 2]) is None


def test_rejection_sampling_gets_a_chain_of_point_masses():
    class RecordsQ:
        records_q = True

    model = SimpleNamespace(adapter=SimpleNamespace(vocab_size=10), engine=SimpleNamespace(device="cpu"))
    d = drafter(max_ngram=2, max_draft=2)
    out = d.propose([1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2], model=model, cache=None, skip=None,
                    budget=20, sampler=RecordsQ())  # fmt: skip
    assert out.tree.is_chain and out.tree.tokens[1:] == (3, 4)
    assert [int(q.argmax()) for q in out.tree.q[:-1]] == [3, 4] and out.tree.q[-1] is None


def test_acceptance_is_learnt_from_the_share_of_the_tree_that_was_tried():
    d = drafter(max_ngram=1, max_draft=1)
    history = [7, 1, 7, 2, 7]  # "7" was followed by 1 and by 2: two one-token branches of share 1/2 each
    out = propose(d, history)
    assert sorted(out.tree.tokens[1:]) == [1, 2]
    before = d.acceptance(1)
    ms = 1 + 0.02 * (len(out.tree) - 1)  # as the profile says
    d.observe(out, [0], tokens=1, round_ms=ms, draft_ms=0.0, verify_ms=ms)  # neither was the model's token
    assert d._drafted[1] == pytest.approx(1.0) and d._accepted[1] == 0.0
    assert d.acceptance(1) < before


def test_the_session_store_lends_earlier_outputs_to_later_generations():
    d = drafter(max_draft=3)
    d.begin()
    propose(d, [50, 51, 1])  # prompt [50, 51], then the output ...
    propose(d, [50, 51, 1, 2, 3, 4, 5])
    d.begin()  # a new generation: the last output (1 2 3 4 5) joins the store
    out = propose(d, [60, 61, 2, 3])  # "2 3" never occurred in this text
    assert out is not None and out.tree.tokens[1:] == (4, 5)


def test_a_long_repetitive_text_keeps_the_index_small():
    idx = NgramIndex((1, 2, 4), keep=4)
    idx.add_document([1, 2, 3] * 5000)
    assert len(idx.index) <= 9  # three distinct n-grams per size
    assert all(len(where) <= 4 for where in idx.index.values())


def test_the_store_stays_within_its_capacity():
    store = SessionStore((1, 2), capacity=100)
    for i in range(50):
        store.add(list(range(100 * i, 100 * i + 30)))
    assert len(store.index) <= 100 and sum(len(doc) for doc in store.docs) == len(store.index)
    assert store.docs[-1] == list(range(4900, 4930))  # the newest document is kept ...
    assert store.index.continuations((4900, 4901), 3, 4) == [[4902, 4903, 4904]]
    assert store.index.continuations((0, 1), 3, 4) == []  # ... the oldest went


def test_continuations_stop_at_the_end_of_their_document():
    idx = NgramIndex((1,))
    idx.add_document([1, 2, 3])
    idx.add_document([4, 1, 9])
    assert idx.continuations((1,), 5, 8) == [[9], [2, 3]]  # the latest first, none crossing into the next


@pytest.mark.parametrize("kw", [{"min_ngram": 3, "max_ngram": 2}, {"max_draft": 0}, {"max_nodes": 1},
                                {"store_tokens": -1}])  # fmt: skip
def test_bad_options_are_refused(kw):
    with pytest.raises(InvalidInputError):
        SuffixDrafter(**kw)


def test_drafts_that_are_always_rejected_are_priced_out_within_a_few_rounds():
    d = drafter(slope=0.1)  # each extra verified token costs a tenth of a step
    history = [1, 2, 3, 4] * 10  # every n-gram matches, with one continuation each
    sizes = []
    for _ in range(50):
        out = propose(d, history)
        sizes.append(0 if out is None else len(out.tree) - 1)
        if out is not None:
            ms = 1 + 0.1 * (len(out.tree) - 1)  # as the profile says
            d.observe(out, [0], tokens=1, round_ms=ms, draft_ms=0.0, verify_ms=ms)  # the first token is wrong
    assert sizes[0] >= 3, "a fresh long match earns a long draft"
    assert sizes == sorted(sizes, reverse=True), "every rejection shortens the drafts (or keeps them)"
    # until nothing is drafted: even one token no longer pays its verification, the estimate's uncertainty included
    # (smoothed_acceptance's optimism: about 33 rejections where the estimate alone needed 20)
    assert not any(sizes[40:])


def test_a_size_that_failed_its_first_drafts_is_drafted_again_and_reports_its_expected_gain():
    """The tree is chosen by the acceptance with its uncertainty (smoothed_acceptance's optimism), so one-token
    matches that failed their first 4 drafts are drafted again, priced (last_gain) as the choice was made: the
    estimate alone (0.15) would not pay for the second verified row."""
    d = drafter(slope=0.14, max_ngram=1)
    d._drafted[1] = 4.0  # 0 of 4 accepted: 0.15
    out = propose(d, [5, 6, 7, 8, 5])
    assert out is not None and out.tree.tokens[1:] == (6,)
    assert d.last_gain == pytest.approx((1 + d.acceptance(1, OPTIMISM)) / 1.14)
    assert (1 + d.acceptance(1)) / 1.14 < 1.02
    d._drafted[1] = 40.0  # 0 of 40: the evidence is clear
    assert propose(d, [5, 6, 7, 8, 5]) is None
