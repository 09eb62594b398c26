"""Rotary scaling that a GGUF file carries and transformers' GGUF config leaves out: llama.cpp's ``rope_freqs``
factors (how Llama 3.1-3.3 files hold their "llama3" scaling) and the ``rope.scaling.*`` keys (linear, YaRN).
Without them a model runs with wrong rotary angles and no error; checked against transformers' own formulas."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import selfspec
from selfspec.arch.gguf import rope_scaling, scale_rope
from selfspec.bench.synthetic import llama3_rope_factors, rewrite_gguf
from selfspec.errors import UnsupportedModelError
from selfspec.model.models import BUILTINS, _builtin_gguf

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 48}  # fmt: skip  # a short original context: most frequencies scaled
PROMPT = "Water boils at"


def _llama3_factors(config) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs`` for LLAMA3."""
    return llama3_rope_factors(config.rope_parameters["rope_theta"], config.head_dim, LLAMA3["factor"],
                               LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"],
                               LLAMA3["original_max_position_embeddings"])  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_file():
    return _builtin_gguf(BUILTINS["smollm2-135m"])


def test_rope_freqs_factors_give_transformers_llama3_angles(tmp_path, smollm2_file, fp32_activations):
    plain = selfspec.load(str(smollm2_file))
    config = plain.hf.config
    scaled_file = rewrite_gguf(smollm2_file, tmp_path / "llama3-rope.gguf",
                               tensors={"rope_freqs.weight": _llama3_factors(config)})  # fmt: skip
    scaled = selfspec.load(str(scaled_file))
    reference = config.__class__.from_dict({**config.to_dict(), "rope_parameters": {
        **config.rope_parameters, **LLAMA3}})  # fmt: skip
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](reference)
    assert torch.allclose(scaled.hf.model.rotary_emb.inv_freq, inv_freq, rtol=1e-6)
    assert not torch.allclose(plain.hf.model.rotary_emb.inv_freq, inv_freq, rtol=1e-3)
    # the whole engine (fused stack, prefill, cache) decodes with them: as the plain file with transformers'
    # llama3 table put in by hand, and not as the plain file
    tokens = selfspec.generate(scaled, PROMPT, "vanilla", max_new_tokens=24).token_ids
    unscaled = selfspec.generate(plain, PROMPT, "vanilla", max_new_tokens=24).token_ids
    plain.hf.model.rotary_emb.inv_freq = inv_freq.clone()
    assert selfspec.generate(plain, PROMPT, "vanilla", max_new_tokens=24).token_ids == tokens != unscaled


def test_linear_scaling_keys_divide_every_frequency(tmp_path, smollm2_file):
    linear = rewrite_gguf(smollm2_file, tmp_path / "linear.gguf",
                          fields={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})  # fmt: skip
    model = selfspec.load(str(linear))
    plain = selfspec.load(str(smollm2_file))
    assert torch.allclose(model.hf.model.rotary_emb.inv_freq * 4, plain.hf.model.rotary_emb.inv_freq, rtol=1e-6)


def test_gemma3_linear_scaling_is_the_global_layers_only(gemma3):
    """Gemma 3 4B+ files carry linear x8: llama.cpp and transformers scale the global layers' table only."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = AutoConfig.for_model(**gemma3.hf.config.to_dict())
    scale_rope(config, rope_scaling({"type": "linear", "factor": 8.0}, Path("gemma-3-4b.gguf")))
    scaled, plain = Gemma3RotaryEmbedding(config), gemma3.hf.model.rotary_emb
    assert torch.allclose(scaled.full_attention_inv_freq * 8, plain.full_attention_inv_freq, rtol=1e-6)
    assert torch.equal(scaled.sliding_attention_inv_freq, plain.sliding_attention_inv_freq)


def test_yarn_keys_make_transformers_yarn_table(smollm2):
    """YaRN as transformers computes it (the formulas of llama.cpp's ``rope_yarn``: ramp between the corrected
    dimensions, attention factor 0.1 ln(factor) + 1); the original context defaults to the file's own."""
    config = AutoConfig.for_model(**smollm2.hf.config.to_dict())
    scale_rope(config, rope_scaling({"type": "yarn", "factor": 8.0}, Path("yarn.gguf")))
    assert config.rope_parameters["original_max_position_embeddings"] == config.max_position_embeddings
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    plain = smollm2.hf.model.rotary_emb.inv_freq
    assert attention == pytest.approx(0.1 * math.log(8.0) + 1)
    assert torch.allclose(inv_freq[:4], plain[:4]) and torch.allclose(inv_freq[-4:] * 8, plain[-4:], rtol=1e-6)


def test_scaling_keys_map_to_transformers_or_are_refused(tmp_path):
    where = tmp_path / "x.gguf"
    assert rope_scaling({}, where) is None
    assert rope_scaling({"type": "none"}, where) is None
    assert rope_scaling({"type": "linear", "factor": 1.0}, where) is None
    assert rope_scaling({"type": "yarn", "factor": 4.0, "original_context_length": 32768}, where) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        rope_scaling({"type": "longrope", "factor": 4.0}, where)
    with pytest.raises(UnsupportedModelError, match="attn_factor"):
        rope_scaling({"type": "yarn", "factor": 4.0, "attn_factor": 0.5}, where)


def test_the_fp32_conversion_keeps_rope_freqs_and_scaling_keys(tmp_path, smollm2_file):
    """``--quantize none`` (a GPU user's way to run a GGUF file) converts the file to a transformers checkpoint:
    its rotary tables equal the quantised load's, the divisors kept beside the config, the keys in it."""
    factors = np.linspace(1.0, 3.0, 32).astype(np.float32)
    keys = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    scaled_file = rewrite_gguf(smollm2_file, tmp_path / "scaled.gguf", tensors={"rope_freqs.weight": factors},
                               fields=keys)  # fmt: skip
    quantised = selfspec.load(str(scaled_file))
    converted = selfspec.load(str(scaled_file), quantize="none")
    expected = selfspec.load(str(smollm2_file)).hf.model.rotary_emb.inv_freq / 2 / torch.from_numpy(factors)
    assert torch.allclose(quantised.hf.model.rotary_emb.inv_freq, expected, rtol=1e-6)
    assert torch.allclose(converted.hf.model.rotary_emb.inv_freq, expected, rtol=1e-6)
    assert converted.hf.config.rope_parameters["rope_type"] == "linear"
