"""The adapters' rotary tables (arch/adapters.py ``LlamaAdapter.rotary``): a position's cos and sin looked up in
tables made once are the ones the model's own rotary module gives for that position alone, for every rotary kind
of a layer (Gemma 3's local and global), at single positions, a tree's repeated positions and past the first
table's rows; kinds whose angles depend on the call's longest position keep the module."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from selfspec.arch import adapters


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_looked_up_rows_are_the_modules_rows(arch):
    adapter = tiny_model(arch).adapter
    h = torch.zeros(1, 1, 8)
    cases = [[0], [5], [adapters.ROTARY_ROWS - 1], [adapters.ROTARY_ROWS + 17], [7, 8, 8, 9, 12], list(range(40, 90))]
    for case in cases:
        positions = torch.tensor([case])
        got = adapter.rotary(h, positions)
        want = adapter._rotary_rows(h, positions)
        assert got.keys() == want.keys()
        for kind in want:
            for a, b in zip(got[kind], want[kind], strict=True):
                assert a.shape == b.shape and a.is_contiguous()
                assert torch.equal(a, b), (arch, case, kind)
    size = adapter.__dict__["_rotary_cache"][1]
    assert size == 2 * adapters.ROTARY_ROWS, "the tables grew past their first rows"


def test_position_dependent_kinds_run_the_module(monkeypatch):
    adapter = tiny_model("llama").adapter
    calls = []
    real = adapter._rotary_rows
    monkeypatch.setattr(adapter, "_rotary_rows", lambda h, p: calls.append(p.shape[-1]) or real(h, p))
    monkeypatch.setattr(adapter.backbone.rotary_emb, "rope_type", "dynamic")
    adapter.rotary(torch.zeros(1, 1, 8), torch.tensor([[3]]))
    assert calls == [1], "a dynamic kind is computed for the call's own positions"
    monkeypatch.setattr(adapter.backbone.rotary_emb, "rope_type", "default")
    adapter.rotary(torch.zeros(1, 1, 8), torch.tensor([[3]]))
    adapter.rotary(torch.zeros(1, 1, 8), torch.tensor([[4]]))
    assert calls == [1, adapters.ROTARY_ROWS], "a static kind's table is made once"


def test_new_or_changed_frequencies_remake_the_tables():
    adapter = tiny_model("llama").adapter
    h, at = torch.zeros(1, 1, 8), torch.tensor([[11]])
    before = adapter.rotary(h, at)["default"][0].clone()
    module = adapter.backbone.rotary_emb
    module.inv_freq = module.inv_freq * 0.5  # replaced (as a GGUF's rope_freqs are set)
    halved = adapter.rotary(h, at)["default"][0]
    assert not torch.equal(halved, before) and torch.equal(halved, adapter._rotary_rows(h, at)["default"][0])
    module.inv_freq.mul_(0.5)  # changed in place
    quartered = adapter.rotary(h, at)["default"][0]
    assert not torch.equal(quartered, halved) and torch.equal(quartered, adapter._rotary_rows(h, at)["default"][0])


def test_tables_made_while_decoding_serve_a_training_pass():
    """S3D trains after the model has decoded: the tables made in a decoding's inference mode must be ordinary
    tensors, which autograd may save for the backward pass."""
    adapter = tiny_model("llama").adapter
    with torch.inference_mode():
        adapter.rotary(torch.zeros(1, 1, 8), torch.tensor([[3]]))
    for at in (torch.tensor([[3]]), torch.tensor([[1, 2, 3]])):
        cos, _ = adapter.rotary(torch.zeros(1, 1, 8), at)["default"]
        assert not cos.is_inference()
        q = torch.randn(cos.shape, requires_grad=True)
        (q * cos).sum().backward()
        assert torch.equal(q.grad, cos)
