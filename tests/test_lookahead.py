"""Lookahead decoding (selfspec.drafters.lookahead): the window and pool as the paper defines them, lossless
output (also in tests/test_lossless_tiny.py, test_coupled_sampling.py and test_real_models.py), clear errors."""

from __future__ import annotations

import pytest
from conftest import tiny_model

import selfspec
from selfspec.core.sampling import GREEDY_SAMPLER
from selfspec.decoding.protocols import DraftOutcome
from selfspec.drafters.lookahead import LookaheadDrafter
from selfspec.errors import InvalidInputError


def proposed(drafter: LookaheadDrafter, history: list[int]) -> DraftOutcome:
    out = drafter.propose(history, model=None, cache=None, skip=None, budget=50, sampler=GREEDY_SAMPLER)
    assert out is not None
    return out


def test_the_tree_holds_the_window_and_the_pools_ngrams_for_the_root():
    d = LookaheadDrafter(window=3, ngram=3, guesses=2)
    d.begin()
    d._levels = [[0, 11, 12], [20, 21, 22]]  # level 0 (column 0 is the root), level 1
    d.pool = {7: [(30, 31), (40, 41)], 8: [(50, 51)]}
    tree = proposed(d, [5, 6, 7]).tree
    paths = {tuple(tree.tokens[n] for n in tree.path_to(leaf)) for leaf, kids in enumerate(tree.children) if not kids}
    # verification branch: the root's n-grams; lookahead branch: column i's levels below level 0's chain up to i
    assert paths == {(7, 30, 31), (7, 40, 41), (7, 20), (7, 11, 21), (7, 11, 12, 22)}
    assert len(tree) == 1 + (3 - 1) + 3 * (3 - 2) + 2 * (3 - 1)  # 1 + (W - 1) + W (N - 2) + G (N - 1)
    assert d.max_nodes >= len(tree)


def test_equal_guesses_under_one_parent_are_one_node():
    d = LookaheadDrafter(window=3, ngram=3, guesses=2)
    d.begin()
    d._levels = [[0, 9, 9], [9, 9, 9]]
    d.pool = {7: [(9, 9)]}
    tree = proposed(d, [7]).tree
    for kids in tree.children:
        toks = [tree.tokens[k] for k in kids]
        assert len(toks) == len(set(toks))
    assert len(tree) < 1 + (3 - 1) + 3 * (3 - 2) + 2 * (3 - 1)


def test_each_columns_trajectory_enters_the_pool_and_the_window_moves_on():
    d = LookaheadDrafter(window=3, ngram=3, guesses=4)
    d.begin()
    d._levels = [[0, 11, 12], [20, 21, 22]]
    out = proposed(d, [7])
    tree = out.tree
    choices = [0] * len(tree)
    for i, node in enumerate(d._nodes[-1]):  # the model's token after each last-level guess
        choices[node] = 100 + i
    d.verified(out, choices, [0])  # nothing accepted beyond the root
    assert d.pool == {7: [(20, 100)], 11: [(21, 101)], 12: [(22, 102)]}
    assert d._levels == [[20, 21, 22], [100, 101, 102]]
    d._levels = [[0, 11, 12], [20, 21, 22], [30, 31, 32]]  # N = 4
    d.N = 4
    out = proposed(d, [7])
    choices = [0] * len(out.tree)
    for i, node in enumerate(d._nodes[-1]):
        choices[node] = 100 + i
    d.verified(out, choices, [0, 1])  # one token accepted beyond the root: the window moves once more, its
    assert d._levels == [[30, 31, 32], [100, 101, 102], [30, 31, 32]]  # last level refilled from the first


def test_the_pool_keeps_the_latest_distinct_ngrams():
    d = LookaheadDrafter(window=2, ngram=2, guesses=2)
    for gram in [(1,), (2,), (1,), (3,)]:
        d._remember(5, gram)
    assert d.pool[5] == [(2,), (3,)]


def test_lookahead_accepts_its_own_ngrams_on_repetitive_text():
    model = tiny_model("llama", seed=7)
    prompt = "abcabcabcabcabcabc abcabc"
    base = selfspec.generate(model, prompt, "vanilla", max_new_tokens=40)
    out = selfspec.generate(model, prompt, "lookahead", max_new_tokens=40)
    assert out.token_ids == base.token_ids
    assert out.stats.accepted > 0 and out.stats.forwards < base.stats.forwards


@pytest.mark.parametrize(
    "options", [{"window": 0}, {"ngram_size": 1}, {"guesses": -1}, {"window": 1, "ngram_size": 2}]
)
def test_bad_window_sizes_are_refused(options):
    model = tiny_model("llama")
    with pytest.raises(InvalidInputError, match="lookahead needs"):
        selfspec.generate(model, "abc", "lookahead", max_new_tokens=4, **options)


def test_the_rejection_scheme_is_refused_with_the_way_out():
    model = tiny_model("llama")
    with pytest.raises(InvalidInputError, match="coupled"):
        selfspec.generate(model, "abcabc", "lookahead", max_new_tokens=8, temperature=0.8, seed=0,
                          sampling_scheme="rejection")  # seeded: an unseeded first token may be EOS (no round)


def test_the_window_is_sized_for_the_device_unless_given():
    assert LookaheadDrafter()._resolved("cpu") == (3, 2, 3)
    assert LookaheadDrafter()._resolved("cuda") == (15, 5, 15)  # the paper's setting, where compute is spare
    assert LookaheadDrafter(window=4)._resolved("cuda") == (4, 5, 15)
    d = LookaheadDrafter()
    assert d.max_nodes == 1 + 14 + 15 * 3 + 15 * 4  # the cache has room for either before the device is known
