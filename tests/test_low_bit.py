"""Low-bit self-drafts (draft precision ``q4``, method ``lowbit``): draft passes read 4-bit copies of a quantised
model's 5-8-bit layer weights (core/quant.py ``low_bit_copy``, core/fused.py); verification keeps the model's own
weights, so every method stays lossless whatever the copies round to."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.quant import LOW_BIT_DRAFT, int8_activations, low_bit_copy, quantize_weight
from selfspec.cost.costs import draft_precisions
from selfspec.errors import InvalidInputError


def test_low_bit_copy_is_symmetric_4_bit_within_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    q8 = quantize_weight(w, 8)
    low = low_bit_copy(q8)
    assert low.fmt == "q4" and low.symmetric and (low.out_features, low.in_features, low.group) == (48, 96, 32)
    # codes and one scale per group: a half in the int8 kernels' copy
    assert not low.has_minima and low.step_bytes == 48 * 96 // 2 + (2 if int8_activations() else 4) * 48 * 3
    assert torch.equal(low.scale, low.scale.half().float())  # the scales are halves exactly
    ref = q8.dequantize().reshape(48, 3, 32)
    step = ref.abs().amax(-1) / 8  # one 4-bit step per group of 32 (Q4_0's scale)
    err = (low.dequantize().reshape(48, 3, 32) - ref).abs()
    # a full step only where +8 d clamps to 7 d (d rounded to a half: up to 2^-11 of itself)
    assert torch.all(err <= step.unsqueeze(-1) * (1 + 2**-8) + 1e-6)
    assert float((err <= step.unsqueeze(-1) / 2 + 1e-6).float().mean()) > 0.95
    q4 = quantize_weight(w, 4)
    assert low_bit_copy(q4) is q4  # nothing to save: shared


def test_the_native_copy_is_torchs_quantisation_bit_for_bit():
    """low_bit_copy's native passes (quant_kernels.c) give the codes and scales of quantize_weight's torch ops:
    ties of magnitude (the first one taken), all-zero groups, values exactly half a step apart (rounded half to
    even), a group's extreme at -8 d and at +8 d (clamped to 15), and rows of real weights."""
    from selfspec.core.quant import _symmetric_q4

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 256, generator=gen)
    w[0, :32] = 0.0  # a zero group: d = 0, every code 8
    w[1, :32] = torch.tensor([1.0, -1.0] * 16)  # ties of magnitude: the first one sets the sign of d
    w[2, :32] = torch.arange(32, dtype=torch.float32) / 4 - 4  # codes exactly between two steps
    w[3, 32:64] *= 0.0
    w[3, 40] = 3.0  # a positive extreme: d < 0, its code 8 - 8 = 0
    w[4] = torch.round(w[4] * 8) / 8  # many exact ties at the step
    w[5:] = quantize_weight(w[5:], 8).dequantize()  # what the copies are made of: decoded rows
    ref, got = quantize_weight(w, 4, symmetric=True), _symmetric_q4(w)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale) and torch.equal(got.minv, ref.minv)
    assert got.symmetric and got.fmt == "q4" and (got.out_features, got.in_features) == (40, 256)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_symmetric_q4_products_match_its_row_form(rows):
    """The interleaved copy stores no minimum (the int8 kernels compute -8 d): the same numbers as the row
    form, which keeps it; and the row form rebuilt from the copy is the original."""
    from selfspec.core.quant import activations

    w = low_bit_copy(quantize_weight(torch.randn(64, 128, generator=torch.Generator().manual_seed(1)), 8))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    codes, scale, minv = w.codes.clone(), w.scale.clone(), w.minv.clone()
    idx = torch.tensor([0, 17, 63])
    before = w.rows(idx)
    assert torch.allclose(before[0, :16], minv[0, 0] + scale[0, 0] * (codes[0, :16] & 15).float())
    with activations("int8"):
        assert w.x16()[2] is None
        y = w.matmul(x)
        assert w.release_rows()
        assert torch.equal(w.rows(idx), before)  # rows read from the copy: the row form's minimum, -8 d
        assert torch.equal(w.matmul(x), y)
    w.restore_rows()
    assert torch.equal(w.codes, codes) and torch.equal(w.scale, scale) and torch.equal(w.minv, minv)


def test_low_bit_drafts_read_the_copies_and_leave_the_full_model_alone(gemma3):
    engine = gemma3.engine
    assert engine.low_bit_drafts and "q4" in draft_precisions(gemma3)  # Q5_0 / Q6_K layer weights here
    own, low = engine.low_bit_bytes()
    assert low < 0.9 * own  # Gemma 3 270M: 66 of 79 MB (its 5- and 6-bit codes read at their own width)
    ids = torch.tensor(gemma3.encode("The quick brown fox jumps over the lazy dog because"))
    cache = engine.new_cache(len(ids) + 4)
    engine.forward(cache, ids[:-1], 0, prefill=True)
    full = engine.forward(cache, ids[-1:], len(ids) - 1)
    same = engine.forward(cache, ids[-1:], len(ids) - 1, draft=True)
    lowbit = engine.forward(cache, ids[-1:], len(ids) - 1, precision=LOW_BIT_DRAFT)
    member = engine.draft_vocab.member
    assert torch.equal(same[:, member], full[:, member])  # the draft in the model's own weights
    assert not torch.equal(lowbit[:, member], full[:, member])  # the copies were read
    assert torch.isfinite(lowbit[:, member]).all()
    assert torch.equal(engine.forward(cache, ids[-1:], len(ids) - 1), full)  # the full model unchanged


@pytest.mark.parametrize("method, options", [("lowbit", {}), ("lowbit", {"draft_length": 4}),
                                             ("asd", {"draft_dtype": "q4"}), ("auto", {"draft_dtype": "q4"})])
def test_low_bit_drafts_keep_vanillas_tokens(gemma3, method, options):
    prompts = ("The capital of France is", "def fibonacci(n):\n    ")
    drafted = 0
    for prompt in prompts:
        ref = selfspec.generate(gemma3, prompt, "vanilla", max_new_tokens=40)
        out = selfspec.generate(gemma3, prompt, method, max_new_tokens=40, **options)
        assert out.token_ids == ref.token_ids, prompt
        drafted += out.stats.drafted
        assert out.stats.draft_precision in ("q4", None)
    kw = {"temperature": 0.7, "top_p": 0.9, "seed": 11}
    ref = selfspec.generate(gemma3, "Once upon a time", "vanilla", max_new_tokens=40, **kw)
    assert selfspec.generate(gemma3, "Once upon a time", method, max_new_tokens=40, **options, **kw).token_ids == \
        ref.token_ids  # fmt: skip
    if method == "lowbit":
        assert drafted > 0  # D&V's confidence exit: drafts whatever the machine's costs


def test_lowbit_on_a_model_with_4_bit_layers_drafts_in_its_own_weights(smollm2):
    assert not smollm2.engine.low_bit_drafts  # Q4_1 throughout: a copy would save nothing
    assert "q4" not in draft_precisions(smollm2)
    out = selfspec.generate(smollm2, "The capital of France is", "lowbit", max_new_tokens=24)
    ref = selfspec.generate(smollm2, "The capital of France is", "vanilla", max_new_tokens=24)
    assert out.token_ids == ref.token_ids and out.stats.draft_precision == "same"


def test_lowbit_needs_a_quantised_model(tiny_llama):
    assert "q4" not in draft_precisions(tiny_llama)
    with pytest.raises(InvalidInputError, match="q4"):
        selfspec.generate(tiny_llama, "Hello", "lowbit", max_new_tokens=8)



def _cheap_low_bit(agreement: float):
    """A read-bound profile whose q4 draft reads half the layers' bytes and agrees ``agreement`` of the time."""
    from dataclasses import replace

    from selfspec.cost.costs import DraftCosts, read_bound_profile

    def source(model_or_engine):
        prof = read_bound_profile(model_or_engine)
        same = prof.drafts["same"]
        q4 = DraftCosts(same.attention_ms / 2, same.mlp_ms / 2, same.base_ms, agreement)
        return replace(prof, drafts={**prof.drafts, "q4": q4})

    return source


@pytest.mark.parametrize(("agreement", "options", "source", "precision"), [
    (0.95, {}, "lowbit", "q4"),  # the copies agree and save: auto drafts with them
    (0.5, {}, "asd", "same"),  # they do not agree: ASD's choice in the model's own weights
    (0.95, {"variant": "cs"}, "asd", "q4"),  # an option of ASD's names the source (its skip sets, in q4)
    (0.95, {"draft_dtype": "same"}, "asd", "same"),
])  # fmt: skip
def test_auto_takes_the_low_bit_source_where_the_profile_does(gemma3, agreement, options, source, precision):
    from selfspec.core import clock
    from selfspec.methods import default_self_draft

    with clock.simulated(_cheap_low_bit(agreement)):
        assert default_self_draft(gemma3, options) == source
        out = selfspec.Session(gemma3, "auto", **options).generate("The capital of France is", max_new_tokens=24)
        ref = selfspec.generate(gemma3, "The capital of France is", "vanilla", max_new_tokens=24)
        assert out.token_ids == ref.token_ids
        assert out.stats.draft_precision == precision


def test_auto_keeps_asd_where_there_is_nothing_to_copy(smollm2):
    from selfspec.methods import default_self_draft

    assert default_self_draft(smollm2, {}) == "asd"


@pytest.mark.parametrize(("saving", "agreement", "head_only", "expected"), [
    (0.5, 0.95, False, "q4"),  # half the layers' cost, full verification the only kind: q4
    (0.5, 0.95, True, "q4"),  # ... and still more than head-only rounds in the model's own weights earn
    (0.2, 0.95, True, "same"),  # a fifth less, but verified by full passes: head-only rounds earn more
    (0.2, 0.95, False, "same"),  # a fifth less at 95% agreement: the own weights' drafts, kept at 99%, earn more
    (0.5, 0.9, False, "same"),  # half the cost, but a tenth of the tokens lost: priced, not gated
])  # fmt: skip
def test_the_auto_precision_weighs_head_only_verification(gemma3, saving, agreement, head_only, expected):
    """``draft_dtype=auto`` prices each precision's chains (step cost and agreement together), with head-only
    verification for the model's own where it applies (CostProfile.best_precision)."""
    from dataclasses import replace

    from selfspec.cost.costs import DraftCosts, read_bound_profile

    prof = read_bound_profile(gemma3)
    same = prof.drafts["same"]
    layers = prof.num_layers * (same.attention_ms + same.mlp_ms)
    q4 = DraftCosts(0.0, 0.0, same.base_ms + (1 - saving) * layers, agreement)  # all in base: every layer kept
    prof = replace(prof, drafts={**prof.drafts, "q4": q4})
    assert prof.best_precision(head_only) == expected
    own = prof.chain_speedup("same", head_only)
    assert (prof.chain_speedup("q4", False) >= 1.05 * own) == (expected == "q4")  # the rule, in its own terms


def test_low_bit_drafts_follow_the_activation_mode(gemma3):
    """The copies serve int8 products (packed, row form dropped) and fp32 ones (row form rebuilt): a draft in
    either mode after the other gives that mode's logits."""
    from selfspec.core.quant import activations

    engine = gemma3.engine
    ids = torch.tensor(gemma3.encode("A short test of both activation modes"))

    def draft():
        cache = engine.new_cache(len(ids) + 2)
        engine.forward(cache, ids[:-1], 0)
        return engine.forward(cache, ids[-1:], len(ids) - 1, precision=LOW_BIT_DRAFT)

    with activations("int8"):
        a = draft()
    with activations("fp32"):
        b = draft()
    with activations("int8"):
        assert torch.equal(draft(), a)
    member = engine.draft_vocab.member
    assert torch.isfinite(b[:, member]).all() and not torch.equal(a[:, member], b[:, member])
    assert int(a[:, member].argmax()) == int(b[:, member].argmax())
