"""KV cache rollback, entry moves, tree masks and the cosine statistics of the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.core.skipset import SkipSet

MODEL = tiny_model("gemma3_text", seed=1)  # sliding windows + two RoPE bases: the hardest case
ENGINE = MODEL.engine
L = ENGINE.num_layers


def _prefill_reference(ids: list[int]):
    cache = ENGINE.new_cache(len(ids) + 1)
    logits = ENGINE.forward(cache, torch.tensor(ids), 0)
    return cache, logits


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(3, 90), min_size=1, max_size=30),
    rounds=st.lists(st.tuples(st.lists(st.integers(3, 90), min_size=1, max_size=6), st.integers(0, 6)), max_size=5),
    skip=st.sets(st.integers(0, L - 1), max_size=L),
)
def test_rollback_keeps_exactly_the_accepted_entries(prompt, rounds, skip):
    """Random drafts with random accept lengths: the committed cache equals a clean prefill of the accepted text."""
    cache = ENGINE.new_cache(len(prompt) + 8 * len(rounds) + 8)
    ENGINE.forward(cache, torch.tensor(prompt), 0)
    cache.commit(len(prompt))
    accepted = list(prompt)
    skip_set = SkipSet.of(skip, skip)
    for draft, keep in rounds:
        c = cache.length
        for j, t in enumerate(draft):  # draft writes (partial layers) beyond the committed length
            ENGINE.forward(cache, torch.tensor([t]), c + j, skip=skip_set)
        ENGINE.forward(cache, torch.tensor(draft), c)  # verification writes every layer
        keep = min(keep, len(draft))
        cache.commit(c + keep)
        accepted += draft[:keep]
    ref, _ = _prefill_reference(accepted)
    n = len(accepted)
    assert cache.length == n
    for layer in range(L):
        k, v = cache.layer(layer, n)
        rk, rv = ref.layer(layer, n)
        torch.testing.assert_close(k, rk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)


def test_next_token_after_rollback_matches_clean_run():
    prompt = list(range(10, 40))
    cache = ENGINE.new_cache(64)
    ENGINE.forward(cache, torch.tensor(prompt), 0)
    cache.commit(len(prompt))
    ENGINE.forward(cache, torch.tensor([5, 6, 7, 8]), len(prompt))  # verify 4, accept 1
    cache.commit(len(prompt) + 1)
    logits = ENGINE.forward(cache, torch.tensor([9]), cache.length)
    _, ref = _prefill_reference(prompt + [5, 9])
    torch.testing.assert_close(logits[-1], ref[-1], rtol=1e-4, atol=1e-4)


def test_tree_mask_equals_separate_chains():
    """Two branches sharing a root, linearised with a tree mask, give each chain's own logits."""
    prompt = list(range(20, 45))  # longer than the sliding window (16)
    S = len(prompt)
    # tree: r -> a -> b   and   r -> x ; linearised as [r, a, b, x] with depths [0, 1, 2, 1]
    r, a, b, x = 11, 12, 13, 14
    tree = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool
    )
    positions = torch.tensor([S, S + 1, S + 2, S + 1])
    cache = ENGINE.new_cache(S + 8)
    ENGINE.forward(cache, torch.tensor(prompt), 0)
    cache.commit(S)
    tree_logits = ENGINE.forward(cache, torch.tensor([r, a, b, x]), S, positions=positions, tree_mask=tree)
    _, chain1 = _prefill_reference(prompt + [r, a, b])
    _, chain2 = _prefill_reference(prompt + [r, x])
    torch.testing.assert_close(tree_logits[:3], chain1[S:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tree_logits[3], chain2[S + 1], rtol=1e-4, atol=1e-4)

    # keep the branch r -> x: move its entries into place, then decoding continues as after a clean prefill
    cache.move([S, S + 3], S)
    cache.commit(S + 2)
    nxt = ENGINE.forward(cache, torch.tensor([15]), S + 2)
    _, ref = _prefill_reference(prompt + [r, x, 15])
    torch.testing.assert_close(nxt[-1], ref[-1], rtol=1e-4, atol=1e-4)


def test_cosine_statistics_shape_and_range():
    out: list = []
    cache = ENGINE.new_cache(32)
    ENGINE.forward(cache, torch.tensor(list(range(5, 25))), 0, cosine_out=out)
    (cos,) = out
    assert len(cos.attention) == len(cos.mlp) == L
    assert all(-1.0 <= c <= 1.0 for c in cos.attention + cos.mlp)


def test_skipped_sublayers_change_the_output_and_write_no_cache():
    cache = ENGINE.new_cache(32)
    ids = torch.tensor(list(range(5, 15)))
    full = ENGINE.forward(cache, ids, 0)
    skip_all_attention = SkipSet.of(range(L), [])
    fresh = ENGINE.new_cache(32)
    partial = ENGINE.forward(fresh, ids, 0, skip=skip_all_attention)
    assert not torch.allclose(full, partial)
    assert all(k is None for k in fresh._keys)  # no attention ran, so nothing was written


def test_lean_attention_equals_the_modules_own_forward_bit_for_bit(tiny):
    """The adapter's lean attention (same torch operations without transformers' plumbing) against the HF
    module's forward: prefill, one-token steps (no mask, and a sliding window's mask) and a tree pass."""
    assert tiny.adapter.lean_attention
    engine = tiny.engine
    prompt = torch.arange(40) % 50 + 3

    def run(lean: bool) -> list[torch.Tensor]:
        tiny.adapter.lean_attention = lean
        try:
            cache = engine.new_cache(64)
            outs = [engine.forward(cache, prompt, 0)]
            cache.commit(40)
            outs.append(engine.forward(cache, torch.tensor([7]), 40))
            cache.commit(41)
            tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
            outs.append(engine.forward(cache, torch.tensor([5, 9, 11, 4]), 41, tree_mask=tree,
                                       positions=torch.tensor([41, 42, 42, 43])))  # fmt: skip
            return outs
        finally:
            tiny.adapter.lean_attention = True

    for lean, plain in zip(run(True), run(False), strict=True):
        assert torch.equal(lean, plain)


def test_argmax_only_gives_the_logits_argmax(tiny_llama):
    engine = tiny_llama.engine
    ids = torch.arange(21) % 40 + 3
    logits = engine.forward(engine.new_cache(32), ids, 0)
    assert torch.equal(engine.forward(engine.new_cache(32), ids, 0, argmax_only=True), logits.argmax(-1))
    last = engine.forward(engine.new_cache(32), ids, 0, argmax_only=True, last_only=True)
    assert last.tolist() == [int(logits[-1].argmax())]


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_the_native_slot_copy_moves_what_torch_moves(dtype):
    """A tree's accepted path made contiguous: the C copy of every buffer (layers of different shapes; float
    entries, or the halves the fused stack keeps) gives the very tensors the torch fallback gives, and an
    out-of-order request takes the fallback."""
    from selfspec.core.cache import KVCache

    def filled(seed: int) -> KVCache:
        gen = torch.Generator().manual_seed(seed)
        cache = KVCache(3, 12, dtype)
        for layer, (heads, dim) in enumerate([(2, 4), (1, 8), (3, 4)]):
            k = torch.randn(1, heads, 12, dim, generator=gen)
            cache._write(layer, 0, k, -k)
        return cache

    for src, dst in [([5, 7, 8], 5), ([4, 6, 9, 11], 4), ([3, 4], 3), ([9, 3], 2)]:
        native, fallback = filled(1), filled(1)
        fallback._layout = False  # torch's copies
        native.move(src, dst)
        fallback.move(src, dst)
        assert native.layer(0, 12)[0].dtype == (dtype or torch.float32)
        for layer in range(3):
            pairs = zip(native.layer(layer, 12), fallback.layer(layer, 12), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
    assert filled(1)._native_layout() is not None, "the native copy was exercised"
