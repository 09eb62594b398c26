"""The kernel layer: every kernel agrees with F.linear, the plan never picks a second thread pool, the
user's model is left as it was, and a bad kernel cache is reported and rebuilt."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import char_tokenizer, tiny_config
from torch import nn

import selfspec
from selfspec.core import kernel_plan, kernels
from selfspec.core.kernels import KERNELS, KernelLinear, KernelPlan

CPU = torch.device("cpu")


def _usable(name: str, dtype: torch.dtype) -> bool:
    return KERNELS[name].unavailable(CPU, dtype) is None


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_every_kernel_matches_f_linear(name, rows, bias):
    if not _usable(name, torch.float32):
        pytest.skip(KERNELS[name].unavailable(CPU, torch.float32))
    torch.manual_seed(rows)
    lin = nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    expected = lin(x).detach()
    fast = KernelLinear(lin, KernelPlan({torch.float32: [(1 << 30, name)]}))
    with torch.inference_mode():
        got = fast(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_plan_lookup_follows_the_bounds():
    plan = KernelPlan({torch.float32: [(1, "torch"), (12, "onednn"), (1 << 30, "transposed")]})
    assert [plan.kernel(torch.float32, r).name for r in (1, 2, 12, 13, 256, 257, 10_000)] == [
        "torch", "onednn", "onednn", "transposed", "transposed", "transposed", "transposed"]  # fmt: skip
    assert plan.kernel(torch.bfloat16, 4).name == "torch", "a dtype the plan does not list uses torch's kernel"


def test_choice_never_takes_a_kernel_with_its_own_thread_pool():
    # OpenBLAS fastest everywhere on paper: its pool would fight torch's on the same cores, so it is never chosen
    ms = {"torch": {1: 30.0, 4: 40.0}, "onednn": {1: 15.0, 4: 29.0}, "openblas": {1: 5.0, 4: 5.0}}
    assert kernel_plan._choose(ms, (1, 4)) == [(1 << 30, "onednn")]
    # within the noise margin torch's own kernel stays
    assert kernel_plan._choose({"torch": {1: 10.0}, "onednn": {1: 9.8}}, (1,)) == [(1 << 30, "torch")]
    # a row count between grid points takes the nearer point's choice
    assert kernel_plan._choose({"torch": {1: 10.0, 8: 10.0}, "onednn": {1: 20.0, 8: 5.0}}, (1, 8)) == [
        (4, "torch"), (1 << 30, "onednn")]  # fmt: skip


def test_chosen_kernels_all_run_on_torchs_pool(tiny_llama):
    plan = tiny_llama.kernel_report.plan()
    assert plan.names(), "a CPU model gets a measured plan"
    assert not any(KERNELS[n].own_pool for n in plan.names())


def test_low_precision_drafts_are_scoped_and_follow_in_place_changes():
    torch.manual_seed(0)
    lin = KernelLinear(nn.Linear(64, 32), kernels.TORCH_ONLY)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        full = lin(x)
        with kernels.draft_precision(torch.bfloat16):
            low = lin(x)
        assert low.dtype == torch.float32 and not torch.equal(low, full)
        torch.testing.assert_close(low, full, rtol=0.05, atol=0.05)
        assert torch.equal(lin(x), full), "outside the block the full precision is back"
    with torch.no_grad():
        lin.weight.mul_(2.0)  # through the parameter: the version counter moves, the copy must be remade
    with torch.inference_mode(), kernels.draft_precision(torch.bfloat16):
        doubled = lin(x)
    assert not torch.allclose(doubled, low, atol=0.05), "the low-precision copy was not refreshed"
    torch.testing.assert_close(doubled - lin.bias, 2 * (low - lin.bias), rtol=0.05, atol=0.1)


def test_wrapping_leaves_the_users_model_stock():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager")
    hf.eval()
    classes = {name: type(m) for name, m in hf.named_modules()}
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    x = torch.tensor([[5, 6, 7, 8, 9]])
    before = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8, pad_token_id=0)
    model = selfspec.model_from_hf(hf, char_tokenizer())
    selfspec.generate(model, "Hello there", "swift", max_new_tokens=12)
    assert {name: type(m) for name, m in hf.named_modules()} == classes, "a module of the user's model was swapped"
    assert hf.config._attn_implementation == "eager", "the user's attention implementation was changed"
    assert all(torch.equal(v, state[k]) for k, v in hf.state_dict().items())
    after = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(before, after)
    assert all(type(m) is not KernelLinear for m in hf.modules())


def test_bad_or_stale_kernel_cache_is_reported_and_rebuilt(tiny_llama, capsys):
    linears, device = tiny_llama.adapter.linears, tiny_llama.adapter.device
    key = kernel_plan.plan_key(linears, device)
    path = kernel_plan._cache_dir() / f"{key}.json"
    good = tiny_llama.choose_kernels(force=True)
    assert path.is_file()
    bad_files = {
        "garbage": "{not json",
        "old version": json.dumps({**good.to_dict(), "version": 0}),
        "foreign kernel": json.dumps({**good.to_dict(), "choices": {"float32": [[1 << 30, "openblas"]]}}),
        "other machine": json.dumps({**good.to_dict(), "key": "cpu-float32-0000"}),
    }
    for what, text in bad_files.items():
        path.write_text(text)
        kernel_plan._MEMORY.clear()
        report = tiny_llama.choose_kernels()
        err = capsys.readouterr().err
        assert "unusable" in err and str(path) in err, what
        assert report.key == key and report.choices, what
        assert kernel_plan.KernelReport.from_dict(json.loads(path.read_text())).key == key, f"{what}: not rebuilt"


def test_kernels_torch_mode_and_bad_mode(tiny_llama):
    model = selfspec.model_from_hf(tiny_llama.hf, tiny_llama.tokenizer, kernels="torch")
    assert model.kernel_report.plan().names() == set()
    a = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=20)
    b = selfspec.generate(tiny_llama, "Hello there", "vanilla", max_new_tokens=20)
    assert a.token_ids == b.token_ids
    with pytest.raises(selfspec.SelfspecError, match="kernels must be one of"):
        selfspec.model_from_hf(tiny_llama.hf, tiny_llama.tokenizer, kernels="fastest")


def test_prepared_copies_are_counted_and_released(tiny_llama):
    adapter = tiny_llama.adapter
    with torch.inference_mode(), kernels.draft_precision(torch.float16):
        tiny_llama.engine.forward(tiny_llama.engine.new_cache(8), torch.tensor([3, 4, 5]), 0)
    with_copy = adapter.kernel_memory()
    weights = sum(m.weight.numel() for m in adapter.linears)
    assert with_copy >= 2 * weights, "the float16 copies are counted"
    adapter.release_draft_copies(None)
    assert adapter.kernel_memory() <= with_copy - 2 * weights


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_runs_torch_kernels_and_stays_lossless():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").to("cuda").eval()
    model = selfspec.model_from_hf(hf, char_tokenizer())
    assert model.kernel_report.plan().names() == set(), "CPU-only kernels never run on CUDA"
    base = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=24)
    for method in ("asd", "swift"):
        assert selfspec.generate(model, "Hello there", method, max_new_tokens=24).token_ids == base.token_ids


def test_kernels_json_carries_the_text_reports_figures(capsys, monkeypatch, smollm2):
    """`selfspec kernels --json` is valid JSON (no NaN), and its one-token step is the text report's figure: the
    same measured dict, one entry of it named as the text names it, against the same bound."""
    import importlib

    cli = importlib.import_module("selfspec.cli.main")  # the module (selfspec.cli.main is also the function)
    monkeypatch.setattr(cli, "load_model", lambda args: smollm2)
    assert cli.main(["kernels", "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert out["one_token_step_ms"] == out["step_ms"]["1"] > 0
    # the step against the bound: the median of rounds timing bandwidth and step back to back, its pair reported
    assert out["step_over_bound"] == pytest.approx(out["bound_step_ms"] / out["quantized_bound_ms"])
    assert out["quantized_bound_ms"] == pytest.approx(out["quantized_bytes"] / out["bandwidth_gbs"] / 1e6)
    rounds = out["step_over_bound_rounds"]
    assert len(rounds) == 3 and rounds == sorted(rounds) and out["step_over_bound"] == rounds[1]
    assert out["int8_kernels"] in ("AVX512-VNNI", "AVX2", "portable C")
    assert set(out["step_spread"]) == set(out["step_ms"]) and isinstance(out["busy"], bool)
