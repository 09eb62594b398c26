"""Synthetic GGUF files (bench/synthetic.py): a real family's layout with random Q4_K_M weights loads and runs as
any file does, with the K-quants' sub-scales, a tied table held as the head's interleaved copy alone, and the
central invariant (greedy drafts give vanilla's tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import selfspec
from selfspec.bench.synthetic import SHAPES, Shape, write_synthetic
from selfspec.core import quant
from selfspec.core.quant import activations
from selfspec.errors import InvalidInputError

TINY = Shape("llama", layers=3, hidden=256, ffn=512, heads=4, kv_heads=2, tied=True)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_synthetic(TINY, tmp_path_factory.mktemp("synthetic") / "tiny.gguf", seed=3)


def test_a_synthetic_file_has_the_q4_k_m_recipe(tiny_file):
    from gguf import GGUFReader

    reader = GGUFReader(tiny_file)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["token_embd.weight"] == "Q6_K"  # tied: llama.cpp gives the table the head's type
    assert kinds["blk.2.ffn_down.weight"] == "Q6_K" and kinds["blk.1.ffn_down.weight"] == "Q4_K"  # the last eighth
    assert kinds["blk.1.attn_q.weight"] == "Q4_K"
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == TINY.layers
    assert "tokenizer.ggml.tokens" in reader.fields  # the donor's tokenizer (the built-in SmolLM2's)


def test_a_q4_k_m_mix_makes_no_low_bit_copies(tiny_file):
    """A K-quant M mix keeps most weights at 4 bits: 4-bit copies of its Q6_K tensors would cut a draft's layer read
    by under LOW_BIT_MIN_SAVING, so none are offered (a 1.5B file's would take ~200 MB for 6% of the read); the
    rule follows the bytes, as the copies, once made, count them."""
    from selfspec.core.fused import LOW_BIT_MIN_SAVING

    with activations("int8"):
        model = selfspec.load(str(tiny_file))
        stack = model.engine._fused
        assert not stack.has_low_bit and not model.engine.low_bit_drafts
        own, low = stack.low_bit_bytes()  # the copies made all the same: what the estimate stands for
        assert low < own and low > (1 - LOW_BIT_MIN_SAVING) * own
        stack.release_low_bit()
        # a profile cached when such files still offered the copies: read back without them (never chosen)
        from dataclasses import replace

        from selfspec.cost import costs

        prof = costs.cost_profile(model)
        old = replace(prof, drafts={**prof.drafts, "q4": replace(prof.drafts["same"], base_ms=0.01)})
        assert old.best_precision(False) == "q4"  # as cached then: the copies would be picked, and made
        again = costs.fitted(old, model)
        assert "q4" not in again.drafts and again.forward_ms == prof.forward_ms and again.best_precision(False) != "q4"
        assert costs.fitted(replace(prof, drafts={"q4": prof.drafts["same"]}), model) is None  # lacks "same"


@pytest.mark.parametrize("mix, base, more, form", [("q3_k", "Q3_K", "Q4_K", "q3k/16"),
                                                   ("q2_k", "Q2_K", "Q3_K", "q2k/16"),
                                                   ("iq4_xs", "IQ4_XS", "IQ4_XS", "iq4k/32")])  # fmt: skip
def test_lower_bit_mixes_load_in_their_types_and_decode_losslessly(tmp_path, mix, base, more, form):
    """Files of the types users run 7-8B models in on small machines (Q3_K_M-, Q2_K-, IQ4_XS-like): every layer
    tensor stays quantised (Q3_K and Q2_K in 3 and 2 bits with their sub-scales, IQ4_XS as its 4-bit indices) and drafts
    keep vanilla's tokens."""
    from gguf import GGUFReader

    path = write_synthetic(TINY, tmp_path / f"{mix}.gguf", seed=5, mix=mix)
    kinds = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert kinds["blk.1.attn_q.weight"] == base and kinds["blk.2.ffn_down.weight"] == more
    with activations("int8"):
        model = selfspec.load(str(path))
        assert model.hf.model.layers[1].self_attn.q_proj.qweight.form_label == form
        assert not model.engine.low_bit_drafts  # every layer weight is read at 4 bits or fewer: nothing to requantise
        plain = selfspec.generate(model, "Tell me about the sea.", "vanilla", max_new_tokens=16)
        drafted = selfspec.generate(model, "Tell me about the sea.", "asd", max_new_tokens=16, preset="paper",
                                    draft_length=3)  # fmt: skip
    assert drafted.stats.drafted > 0 and drafted.token_ids == plain.token_ids


def test_unknown_shapes_and_foreign_donors_are_refused(tmp_path, tiny_file):
    with pytest.raises(InvalidInputError, match="unknown shape"):
        write_synthetic("qwen9-1t", tmp_path / "x.gguf")
    with pytest.raises(InvalidInputError, match="unknown mix"):
        write_synthetic(TINY, tmp_path / "x.gguf", mix="q1")
    with pytest.raises(InvalidInputError, match="needs a qwen2 GGUF"):
        write_synthetic(SHAPES["qwen2.5-1.5b"], tmp_path / "x.gguf", like=tiny_file)


def test_a_synthetic_model_decodes_losslessly_with_sub_scales(tiny_file):
    with activations("int8"):
        model = selfspec.load(str(tiny_file))
        layer = model.hf.model.layers[0].mlp.gate_proj.qweight
        assert layer.x16_form & quant.X16_SUB8 and layer.form_label == "q4k/32"
        head = model.adapter.quantized_head()
        assert head.rows_released and head.x16_form & quant.X16_SUB8  # the tied table: its copy alone
        ids = torch.tensor([1, 50, 700, 4000])
        embed = model.hf.get_input_embeddings()
        rows = embed.qweight.rows(ids)  # lookups decode the copy's rows: bit for bit the table's
        head.restore_rows()
        assert torch.equal(rows, head.rows(ids))
        prompt = "Write a short story about a robot."
        plain = selfspec.generate(model, prompt, "vanilla", max_new_tokens=24)
        drafted = selfspec.generate(model, prompt, "asd", max_new_tokens=24, preset="paper", draft_length=3)
    assert drafted.stats.drafted > 0
    assert drafted.token_ids == plain.token_ids


def test_llama3_shapes_carry_llama_3s_rotary_base_and_divisors(tmp_path):
    """As real Llama 3.1-3.3 files do: rotary base 500000 and llama.cpp's rope_freqs, which the load divides the
    rotary frequencies by (tests/test_gguf_rope.py checks them against transformers' llama3 table)."""
    from selfspec.bench.synthetic import LLAMA3_ROPE, LLAMA3_THETA, llama3_rope_factors

    shape = Shape("llama", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, tied=True, llama3_rope=True)
    model = selfspec.load(str(write_synthetic(shape, tmp_path / "llama3.gguf")))
    assert model.hf.config.rope_parameters["rope_theta"] == LLAMA3_THETA
    head_dim = shape.hidden // shape.heads
    plain = 1.0 / (LLAMA3_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = torch.from_numpy(llama3_rope_factors(LLAMA3_THETA, head_dim, **LLAMA3_ROPE))
    assert factors.max() == LLAMA3_ROPE["factor"] and factors.min() == 1.0
    assert torch.allclose(model.hf.model.rotary_emb.inv_freq, plain / factors, rtol=1e-6)


def test_a_gemma3_shape_takes_llama_cpps_fallback_types_and_decodes_losslessly(tmp_path):
    """Gemma 3's widths are not multiples of 256 weights: llama.cpp's Q4_K_M gives those rows Q5_0 / Q8_0, and so
    does the synthetic file; it loads with Gemma's extra norms and a head dimension of its own."""
    from gguf import GGUFReader

    shape = Shape("gemma3", layers=2, hidden=640, ffn=512, heads=2, kv_heads=1, tied=True, head_dim=128)
    path = write_synthetic(shape, tmp_path / "gemma.gguf", seed=1)
    kinds = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert kinds["token_embd.weight"] == "Q8_0" and kinds["blk.0.attn_q.weight"] == "Q5_0"
    assert kinds["blk.0.ffn_down.weight"] == "Q4_K" and kinds["blk.0.attn_output.weight"] == "Q4_K"
    assert kinds["blk.1.ffn_down.weight"] == "Q6_K" and kinds["blk.1.attn_v.weight"] == "Q8_0"  # the last eighth
    assert "blk.1.attn_q_norm.weight" in kinds and "blk.1.post_ffw_norm.weight" in kinds
    model = selfspec.load(str(path))
    assert model.hf.config.head_dim == 128 and model.hf.config.model_type == "gemma3_text"
    plain = selfspec.generate(model, "Hello there", "vanilla", max_new_tokens=16)
    drafted = selfspec.generate(model, "Hello there", "asd", max_new_tokens=16, preset="paper", draft_length=3)
    assert drafted.stats.drafted > 0 and drafted.token_ids == plain.token_ids


def test_a_requantized_file_holds_the_same_weights_in_q8_0_and_drafts_from_4_bit_copies(tiny_file, tmp_path):
    """``requantize``: every quantised matrix in Q8_0 blocks with the values the source held (Q8_0 rounds each
    to within half a step of its block's scale, plus 127 times that scale's rounding to a half), vectors kept;
    such a file's 8-bit weights are worth 4-bit copies, and ``lowbit`` drafting from them gives vanilla's
    tokens."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from selfspec.bench.synthetic import requantize

    out = requantize(tiny_file, tmp_path / "q8.gguf")
    src, dst = GGUFReader(tiny_file), GGUFReader(out)
    assert [t.name for t in src.tensors] == [t.name for t in dst.tensors]
    for a, b in zip(src.tensors, dst.tensors, strict=True):
        if len(a.shape) < 2:
            assert b.tensor_type == a.tensor_type
            continue
        assert b.tensor_type == GGMLQuantizationType.Q8_0
        x, y = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
        step = abs(x).reshape(-1, 32).max(axis=1, keepdims=True) / 127  # Q8_0's scale per block of 32
        half = abs(step.astype(np.float16).astype(np.float32) - step)  # the scale is stored as a half
        assert (abs(x - y).reshape(-1, 32) <= 0.5 * step + 127 * half + 1e-9).all(), a.name
    with activations("int8"):
        model = selfspec.load(str(out))
        assert model.engine._fused.has_low_bit
        prompt = [{"role": "user", "content": "Count to ten."}]
        base = selfspec.generate(model, prompt, "vanilla", max_new_tokens=24)
        low = selfspec.generate(model, prompt, "lowbit", max_new_tokens=24)
        assert low.token_ids == base.token_ids and low.stats.drafted > 0
    with pytest.raises(InvalidInputError, match="unknown type"):
        requantize(tiny_file, tmp_path / "x.gguf", "q5_1")


def test_requantize_names_a_missing_source_clearly(tmp_path, capsys):
    """``--requantize`` takes a file or a built-in model's name; anything else is a usage error, no traceback."""
    from selfspec.bench.synthetic import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--requantize", "no-such-model", "--out", str(tmp_path / "x.gguf")])
    assert exit_info.value.code == 2
    assert "no such file, nor a built-in model" in capsys.readouterr().err
