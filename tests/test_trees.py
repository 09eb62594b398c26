"""Token trees: structure, attention mask, greedy acceptance on hand-built trees, and verification on a model."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from selfspec.decoding.acceptance import accept_greedy
from selfspec.decoding.trees import DraftTree

#        0 (root, token 10)
#       / \\
#     1:11  4:21
#     /  \\
#   2:12  5:22
#    |
#   3:13
TREE = DraftTree(tokens=(10, 11, 12, 13, 21, 22), parents=(-1, 0, 1, 2, 0, 1))


def test_structure():
    assert TREE.depths == [0, 1, 2, 3, 1, 2]
    assert TREE.depth == 3
    assert TREE.children == [[1, 4], [2, 5], [3], [], [], []]
    assert TREE.path_to(5) == [0, 1, 5]
    assert not TREE.is_chain
    assert DraftTree.chain(1, [2, 3]).is_chain
    assert TREE.positions(100).tolist() == [100, 101, 102, 103, 101, 102]


def test_mask_is_ancestors_and_self():
    mask = TREE.attention_mask()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert DraftTree.chain(1, [2, 3]).attention_mask() is None  # chains use the causal mask


@pytest.mark.parametrize(
    ("target", "path", "bonus"),
    [
        # target[i] = the full model's argmax after node i
        ((11, 12, 13, 99, 0, 0), [0, 1, 2, 3], 99),  # the whole chain, then the bonus
        ((21, 0, 0, 0, 77, 0), [0, 4], 77),  # the root's alternative leaf
        ((11, 22, 0, 0, 0, 55), [0, 1, 5], 55),  # an alternative at depth 2
        ((11, 40, 0, 0, 0, 0), [0, 1], 40),  # nothing matches at depth 2
        ((30, 0, 0, 0, 0, 0), [0], 30),  # nothing matches at all
    ],
)
def test_greedy_acceptance_walks_the_argmax(target, path, bonus):
    assert accept_greedy(TREE, target) == (path, bonus)


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree((1, 2, 3), (-1, 2, 0))
    with pytest.raises(ValueError, match="same token"):
        DraftTree((1, 2, 2), (-1, 0, 0))
    with pytest.raises(ValueError, match="root"):
        DraftTree((1, 2), (0, 0))


def test_tree_verification_equals_chains_and_keeps_the_accepted_path():
    """One pass over the linearised tree gives every branch's own logits; moving the accepted path into place
    leaves the cache as after a clean run of the accepted text."""
    model = tiny_model("llama", seed=3)
    engine = model.engine
    prompt = list(range(20, 50))
    S = len(prompt)
    cache = engine.new_cache(S + 16)
    engine.forward(cache, torch.tensor(prompt), 0)
    cache.commit(S)
    logits = engine.forward(
        cache, torch.tensor(TREE.tokens), S, positions=TREE.positions(S), tree_mask=TREE.attention_mask()
    )
    for leaf in (3, 4, 5):
        branch = TREE.path_to(leaf)
        ref_cache = engine.new_cache(S + 8)
        ref = engine.forward(ref_cache, torch.tensor(prompt + [TREE.tokens[n] for n in branch]), 0)
        torch.testing.assert_close(logits[branch], ref[S:], rtol=1e-4, atol=1e-4)

    path = TREE.path_to(5)  # keep root -> 11 -> 22
    cache.move([S + n for n in path], S)
    cache.commit(S + len(path))
    nxt = engine.forward(cache, torch.tensor([7]), cache.length)
    clean = engine.new_cache(S + 8)
    ref = engine.forward(clean, torch.tensor(prompt + [10, 11, 22, 7]), 0)
    torch.testing.assert_close(nxt[-1], ref[-1], rtol=1e-4, atol=1e-4)


def test_visible_prefix_hides_committed_entries():
    """``visible`` makes new tokens ignore committed slots beyond it (SWIFT scores drafts this way)."""
    model = tiny_model("llama", seed=3)
    engine = model.engine
    prompt, rest = list(range(20, 40)), [41, 42, 43]
    cache = engine.new_cache(64)
    engine.forward(cache, torch.tensor(prompt + rest), 0)
    cache.commit(len(prompt) + len(rest))
    S = len(prompt)
    # re-run `rest` at their own positions in scratch slots, seeing only the prompt
    got = engine.forward(cache, torch.tensor(rest), cache.length, positions=torch.arange(S, S + 3), visible=S)
    ref = engine.forward(engine.new_cache(64), torch.tensor(prompt + rest), 0)[S:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
