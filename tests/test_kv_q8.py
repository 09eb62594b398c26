"""8-bit key/value caches (``kv_cache="q8_0"``, selfspec.core.cache's Q8 blocks): what the C code writes is
torch's encoding bit for bit, a token's logits still do not depend on how it was verified, and every method
decodes exactly vanilla's tokens under them (the cache changes the model's numbers, alike for every method)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import selfspec
from selfspec.core.cache import Q8, KVCache, q8_decode, q8_encode, q8_width
from selfspec.core.quant import kv_cache, quantize_linears, set_kv_cache
from selfspec.errors import InvalidInputError


def test_blocks_hold_codes_and_a_scale_and_round_ties_to_even():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)
    x[0, 32] = 127.0  # scale 1: 2.5 -> 2, 3.5 -> 4, -0.5 -> -0
    x[0, 33:36] = torch.tensor([2.5, 3.5, -0.5])
    x[1, :32] = float("nan")
    x[1, 32] = float("inf")
    b = q8_encode(x)
    assert b.dtype == torch.int8 and b.shape == (2, q8_width(64)) == (2, 72)
    assert b[0, 36 + 32 : 36 + 36].view(torch.float32).item() == 1.0
    assert b[0, 36 : 36 + 4].tolist() == [127, 2, 4, 0]
    y = q8_decode(b)
    step = 3.0 / 127
    assert (y[0, :32] - x[0, :32]).abs().max().item() <= step / 2 * (1 + 1e-6)
    assert torch.equal(y[0, 32:36], torch.tensor([127.0, 2.0, 4.0, 0.0]))
    assert torch.isnan(y[1]).all(), "a block holding a NaN or an infinity reads back as NaN"
    assert torch.equal(q8_encode(y[0:1]), b[0:1]), "decoded values encode to the same blocks"
    with pytest.raises(ValueError, match="multiples of 32"):
        q8_width(48)


def test_the_module_paths_cache_writes_and_reads_the_same_blocks():
    cache = KVCache(1, 8, Q8)
    k, v = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    rk, rv = cache._write(0, 2, k, v)
    assert rk.shape == (1, 2, 5, 64) and rk.dtype == torch.float32
    assert torch.equal(rk[:, :, 2:], q8_decode(q8_encode(k))) and torch.equal(rv[:, :, 2:], q8_decode(q8_encode(v)))
    assert torch.equal(cache.layer(0, 5)[0], rk)


@pytest.fixture(scope="module")
def tiny32() -> selfspec.Model:
    """A quantised tiny Llama with head size 32: one 8-bit block a row."""
    model = tiny_model("llama", seed=7, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    quantize_linears(model.hf, 8)
    return selfspec.model_from_hf(model.hf, model.tokenizer, name="tiny-llama-2x32")


def test_the_c_code_writes_torchs_blocks_and_rows_stay_exact(tiny32):
    engine = tiny32.engine
    assert engine.fused, engine.fused_reason
    ids, new = torch.arange(40) % 50 + 5, torch.tensor([7, 8, 9, 10])
    floats, blocks = KVCache(engine.num_layers, 64, torch.float32), KVCache(engine.num_layers, 64, Q8)
    for cache in (floats, blocks):
        engine.forward(cache, ids, 0, prefill=True, last_only=True)
    for store in ("_keys", "_values"):  # layer 0's keys and values do not depend on the cache before them
        exact = getattr(floats, store)[0][:, :, :40]
        assert torch.equal(getattr(blocks, store)[0][:, :, :40], q8_encode(exact)), store
    chain = engine.forward(blocks, new, 40)
    steps = torch.stack([engine.forward(blocks, new[i : i + 1], 40 + i)[0] for i in range(len(new))])
    assert torch.equal(chain, steps)
    half = KVCache(engine.num_layers, 64, torch.float16)
    engine.forward(half, ids, 0, prefill=True, last_only=True)
    ref = engine.forward(half, new, 40)
    assert not torch.equal(chain, ref), "the blocks were not used"
    assert (chain - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("method", ["pld", "vocab", "asd", "swift"])
def test_every_method_decodes_vanillas_tokens_on_an_8_bit_cache(smollm2, method):
    prompt = [{"role": "user", "content": "List three uses of a hash map, with a line of Python for each."}]
    with kv_cache("q8_0"):
        base = selfspec.generate(smollm2, prompt, "vanilla", max_new_tokens=40).token_ids
        got = selfspec.generate(smollm2, prompt, method, max_new_tokens=40).token_ids
        cache = smollm2.engine.new_cache(8)
    assert cache.dtype == Q8
    assert got == base


def test_a_tokens_keys_and_values_take_56_percent_of_the_halves_bytes(smollm2):
    """SmolLM2: 30 layers, keys and values of 3 heads of 64 values: 23,040 bytes a token as halves, 12,960 as
    8-bit blocks (72 bytes a row of 64)."""
    with kv_cache("f16"):
        assert smollm2.engine.kv_bytes_per_token() == 30 * 2 * 3 * 64 * 2
    with kv_cache("q8_0"):
        assert smollm2.engine.kv_bytes_per_token() == 30 * 2 * 3 * 72


def test_a_reused_prefix_on_an_8_bit_cache_gives_a_whole_prefills_tokens(smollm2):
    first = [{"role": "user", "content": "Name a prime number larger than 100."}]
    with kv_cache("q8_0"):
        session = selfspec.Session(smollm2, "vanilla")
        answer = session.generate(first, max_new_tokens=16).text
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And another?"}]
        reused = session.generate(second, max_new_tokens=24)
        fresh = selfspec.Session(smollm2, "vanilla", prefix_cache=0).generate(second, max_new_tokens=24)
    assert session.prefix_store.stats().hits >= 1
    assert reused.token_ids == fresh.token_ids


def test_an_8_bit_cache_is_refused_where_it_cannot_be_kept(smollm2_fp32):
    """Asked for by name, on a model that cannot keep it: a clear error.  Set process-wide, a model on torch's
    modules keeps its own dtype (the setting is the fused stack's)."""
    with pytest.raises(InvalidInputError, match="kv_cache must be one of"):
        selfspec.load("smollm2-135m", kv_cache="q4")
    try:
        with pytest.raises(InvalidInputError, match="fused CPU stack"):
            selfspec.load("smollm2-135m", quantize="none", kv_cache="q8_0")
    finally:
        set_kv_cache("auto")
    with kv_cache("q8_0"):
        assert smollm2_fp32.engine.new_cache(16).dtype is None
    odd = tiny_model("llama", seed=7, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)  # head size 16
    quantize_linears(odd.hf, 8)
    odd = selfspec.model_from_hf(odd.hf, odd.tokenizer, name="tiny-llama-4x16")
    with kv_cache("q8_0"), pytest.raises(InvalidInputError, match="multiples of 32, not 16"):
        odd.engine.new_cache(16)
