"""The CUDA path (torch's kernels; the fused CPU stack never runs there): every method keeps vanilla's greedy
tokens and seeded samples on tiny random models of three architectures, in float32 and bfloat16.  Skipped
without a CUDA GPU (CI has none); run on one with ``pytest tests/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import char_tokenizer, tiny_config

import selfspec
from selfspec.methods import METHODS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

SKIP_SET = {"attention": [1, 3], "mlp": [4]}  # for the methods that take a given set


def _cuda_model(arch: str, dtype: torch.dtype) -> selfspec.Model:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # sharper logits: greedy well defined, drafts can match
    return selfspec.model_from_hf(hf.to("cuda", dtype).eval(), char_tokenizer(), name=f"tiny-{arch}-{dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_every_method_keeps_vanillas_tokens_on_cuda(arch, dtype):
    model = _cuda_model(arch, dtype)
    assert model.engine.device.type == "cuda" and not model.engine.fused
    seeded = dict(temperature=0.7, top_p=0.9, seed=3)
    base = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=24).token_ids
    sampled = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=24, **seeded).token_ids
    drafted = 0
    for method in METHODS:
        if method in ("vanilla", "s3d", "lowbit"):  # s3d needs a trained adapter, lowbit a quantised model
            continue
        opts = {"skip_set": SKIP_SET} if method in ("static", "selfsd") else {}
        got = selfspec.generate(model, "Hello there", method, max_new_tokens=24, **opts)
        assert got.token_ids == base, method
        assert selfspec.generate(model, "Hello there", method, max_new_tokens=24, **opts, **seeded).token_ids == sampled
        drafted += got.stats.drafted
    assert drafted > 0, "some method drafted"


def test_load_takes_device_and_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    model = selfspec.load(str(tmp_path), device="cuda", dtype="bfloat16")
    assert model.engine.device.type == "cuda" and next(model.hf.parameters()).dtype == torch.bfloat16
    assert len(selfspec.generate(model, "Hi", "swift", max_new_tokens=8).token_ids) == 8
