"""The fused native decoder stack (selfspec.core.fused): same model as the module path, rows independent of T.

Every check runs on quantised tiny models of all five architectures (Llama, Mistral's window, Qwen2's
biases, Qwen3's q/k norms, Gemma 3's sandwich norms, GELU and two rotary tables) and on the built-in models.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ARCHS, tiny_model

import selfspec
from selfspec.core.quant import quantize_linears
from selfspec.core.skipset import SkipSet

pytestmark = pytest.mark.threads  # runs on every thread, as a user's run does (make test: first, in one process)


def quantised_tiny(arch: str, bits: int = 4) -> selfspec.Model:
    model = tiny_model(arch, seed=3)
    quantize_linears(model.hf, bits)
    return selfspec.model_from_hf(model.hf, model.tokenizer, name=f"tiny-{arch}-int{bits}")


@pytest.fixture(scope="module", params=ARCHS)
def qtiny(request) -> selfspec.Model:
    return quantised_tiny(request.param)


def prefilled(model: selfspec.Model, prompt_len: int, *, fused: bool):
    engine = model.engine
    engine.fused_enabled = fused
    cache = engine.new_cache(max(128, prompt_len + 16))
    ids = torch.arange(prompt_len) % 50 + 5
    engine.forward(cache, ids, 0, prefill=True, last_only=True)
    return engine, cache


@pytest.fixture(autouse=True)
def fused_back_on(request):
    yield
    for name in ("qtiny",):
        if name in request.fixturenames:
            request.getfixturevalue(name).engine.fused_enabled = True


@pytest.mark.usefixtures("fp32_activations")
@pytest.mark.parametrize("prompt_len", [10, 40, 80])  # past Mistral's (24) and Gemma's (16) windows; 80: prompt kernel
def test_fused_stack_computes_the_modules_model(qtiny, prompt_len):
    assert qtiny.engine.fused, qtiny.engine.fused_reason
    new = torch.tensor([7, 8, 9, 10, 11])
    skip = SkipSet(attention=frozenset({1, 4}), mlp=frozenset({2}))
    for s in (SkipSet(), skip):
        engine, cache = prefilled(qtiny, prompt_len, fused=False)
        ref = engine.forward(cache, new, prompt_len, skip=s)
        engine, cache = prefilled(qtiny, prompt_len, fused=True)
        got = engine.forward(cache, new, prompt_len, skip=s)
        assert got.shape == ref.shape
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= 1e-4 * scale
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _assert_steps_chain_and_tree_agree(model: selfspec.Model, prompt_len: int) -> None:
    """One-token steps, a chain and a token tree after ``prompt_len`` tokens: each token's logits bit for bit."""
    engine, cache = prefilled(model, prompt_len, fused=True)
    a, b, c, d = 7, 8, 9, 10
    steps = [engine.forward(cache, torch.tensor([tok]), prompt_len + i)[0] for i, tok in enumerate((a, c, d))]
    engine, cache = prefilled(model, prompt_len, fused=True)
    chain = engine.forward(cache, torch.tensor([a, c, d]), prompt_len)
    assert all(torch.equal(chain[i], steps[i]) for i in range(3))
    # a chain's rows read their slots in order (no mask: the stack's causal rows); given as a mask, listed from it
    engine, cache = prefilled(model, prompt_len, fused=True)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(engine.forward(cache, torch.tensor([a, c, d]), prompt_len, tree_mask=causal), chain)
    # tree: a -> {b, c}, c -> d, linearised as a, b, c, d (d's ancestors a, c sit at slots 0 and 2)
    engine, cache = prefilled(model, prompt_len, fused=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    positions = prompt_len + torch.tensor([0, 1, 1, 2])
    tree = engine.forward(cache, torch.tensor([a, b, c, d]), prompt_len, positions=positions, tree_mask=mask)
    assert torch.equal(tree[0], steps[0]) and torch.equal(tree[2], steps[1]) and torch.equal(tree[3], steps[2])


@pytest.mark.parametrize("prompt_len", [10, 40])
def test_a_prompt_read_in_order_gets_the_numbers_a_causal_mask_gives(qtiny, prompt_len):
    """A prompt's rows on the fused stack read their slots in order (no mask, also past a sliding window, whose
    layers keep theirs); the same prompt under an explicit causal mask, its rows' slots listed from the mask rows
    in every layer, gives the same logits and cache bit for bit."""
    engine = qtiny.engine
    ids = torch.arange(prompt_len) % 50 + 5
    out = []
    for mask in (None, torch.ones(prompt_len, prompt_len, dtype=torch.bool).tril()):
        cache = engine.new_cache(prompt_len + 8)
        logits = engine.forward(cache, ids, 0, tree_mask=mask)
        out.append((logits, engine.forward(cache, torch.tensor([7]), prompt_len)))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("prompt_len", [10, 40])
def test_a_tokens_logits_do_not_depend_on_how_it_was_verified(qtiny, prompt_len):
    """One-token steps, a chain and a token tree give each token the same logits bit for bit."""
    _assert_steps_chain_and_tree_agree(qtiny, prompt_len)


LONG = 600  # visible keys in three of attention's blocks of 256 (fused_decoder.c, KEY_BLOCK)


@pytest.fixture(scope="module", params=ARCHS)
def long_tiny(request) -> selfspec.Model:
    model = tiny_model(request.param, seed=3, max_position_embeddings=1024)
    quantize_linears(model.hf, 4)
    return selfspec.model_from_hf(model.hf, model.tokenizer, name=f"tiny-{request.param}-long")


@pytest.mark.usefixtures("fp32_activations")
def test_attention_in_key_blocks_computes_the_modules_model(long_tiny):
    """Past 256 visible keys a row's attention runs block by block, the blocks' sums combined in order (a
    one-token step's blocks shared between threads): still the module path's model."""
    new = torch.tensor([7, 8, 9])
    engine, cache = prefilled(long_tiny, LONG, fused=False)
    ref = engine.forward(cache, new, LONG)
    engine, cache = prefilled(long_tiny, LONG, fused=True)
    got = engine.forward(cache, new, LONG)
    long_tiny.engine.fused_enabled = True
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_tokens_logits_past_a_key_block_do_not_depend_on_the_pass(long_tiny):
    """Past 256 keys, one-token steps (blocks split between threads), a chain and a token tree (a block at a
    time per row) give each token the same logits bit for bit."""
    _assert_steps_chain_and_tree_agree(long_tiny, LONG)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(6, 2, 64), (4, 1, 80), (4, 1, 72), (8, 2, 128), (4, 1, 256), (7, 1, 64),
                          (14, 2, 64)])  # fmt: skip
def test_query_heads_attended_together_get_a_lone_rows_logits(heads, kv_heads, head_dim):
    """A long pass attends several query heads of one key/value head together (shared value loads, one list of
    visible keys); a one-token step attends them one by one or fewer together: each token's logits are the same
    bit for bit, across head sizes that take the vector blocks alone (64, 128, 256: the scores' unrolled forms), with
    a scalar tail (80) and a partial vector chunk (72), and with 7 query heads a key/value head (Qwen2.5's), which
    go in uneven chunks (4 + 3 in the long pass, 2 + 2 + 2 + 1 in a one-token step of one key/value head)."""
    hidden = math.lcm(16 * heads, 32)  # quantised rows hold multiples of 32 weights; transformers: of `heads`
    model = tiny_model(
        "llama", seed=5, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim
    )
    quantize_linears(model.hf, 8)
    model = selfspec.model_from_hf(model.hf, model.tokenizer, name=f"tiny-llama-{heads}x{head_dim}")
    assert model.engine.fused, model.engine.fused_reason
    new = torch.arange(9) + 11
    engine, cache = prefilled(model, 40, fused=True)
    steps = [engine.forward(cache, new[i : i + 1], 40 + i)[0] for i in range(len(new))]
    engine, cache = prefilled(model, 40, fused=True)
    chain = engine.forward(cache, new, 40)
    assert all(torch.equal(chain[i], steps[i]) for i in range(len(new)))


@pytest.mark.usefixtures("fp32_activations")
def test_the_fused_stack_measures_asds_sublayer_cosines_like_the_modules(qtiny):
    """ASD's prefill statistics come from the fused pass too (its prompt then shares vanilla's arithmetic):
    the same cosine per computed sublayer as the module path, NaN for skipped ones."""
    ids = torch.arange(30) % 50 + 5
    skip = SkipSet(attention=frozenset({1}), mlp=frozenset({0}))
    got = {}
    for fused in (False, True):
        qtiny.engine.fused_enabled = fused
        out = []
        qtiny.engine.forward(qtiny.engine.new_cache(64), ids, 0, skip=skip, cosine_out=out, prefill=True)
        got[fused] = out[0]
    for part in ("attention", "mlp"):
        ref, fused = torch.tensor(getattr(got[False], part)), torch.tensor(getattr(got[True], part))
        assert torch.equal(ref.isnan(), fused.isnan()) and int(ref.isnan().sum()) == 1
        assert torch.allclose(fused[~fused.isnan()], ref[~ref.isnan()], atol=1e-5)


def test_quantised_tiny_models_decode_losslessly_on_the_fused_path(qtiny):
    prompt = "Hello there, how are you doing"
    base = selfspec.generate(qtiny, prompt, "vanilla", max_new_tokens=20)
    for method in ("swift", "asd", "pld", "auto"):
        assert selfspec.generate(qtiny, prompt, method, max_new_tokens=20).token_ids == base.token_ids, method


def test_the_fused_path_leaves_the_callers_embeddings_alone(qtiny):
    engine, cache = prefilled(qtiny, 10, fused=True)
    embeds = torch.randn(2, qtiny.engine.adapter.hidden_size)
    before = embeds.clone()
    engine.forward(cache, torch.tensor([0, 0]), 10, input_embeds=embeds)
    assert torch.equal(embeds, before)


def test_fp32_weights_keep_the_module_path(smollm2_fp32):
    assert not smollm2_fp32.engine.fused
    assert "quantised" in smollm2_fp32.engine.fused_reason


@pytest.mark.usefixtures("fp32_activations")
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_builtin_models_run_fused_and_agree_with_the_module_path(name, request):
    model = request.getfixturevalue(name)
    engine = model.engine
    assert engine.fused, engine.fused_reason
    ids = torch.tensor(model.tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:600])
    new = torch.tensor(model.tokenizer(" and then the cat sat down")["input_ids"][:4])
    out = {}
    try:
        for fused in (False, True):
            engine.fused_enabled = fused
            cache = engine.new_cache(700)  # 600 tokens: past Gemma 3's 512-token window
            engine.forward(cache, ids, 0, prefill=True, last_only=True)
            out[fused] = engine.forward(cache, new, len(ids))
    finally:
        engine.fused_enabled = True
    assert torch.equal(out[True].argmax(-1), out[False].argmax(-1))
    assert (out[True] - out[False]).abs().max().item() <= 1e-3 * out[False].abs().max().item()


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    """The native library built without AVX-512 (the plain-C paths of every file), once for this module."""
    import ctypes
    import subprocess

    from selfspec.core.quant import CFLAGS, SOURCES

    lib_path = tmp_path_factory.mktemp("portable") / "portable.so"
    subprocess.run(["gcc", *CFLAGS, "-mno-avx512f", "-o", str(lib_path), *map(str, SOURCES), "-lm"], check=True)
    return ctypes.CDLL(str(lib_path))


def _portable_and_native(model, lib):
    """A 4-token chain after a 30-token prompt through the portable library (whose one-token steps must give the
    chain's rows bit for bit) and through the native one: (portable logits, native logits, the native cache)."""
    from selfspec.core import fused

    engine = model.engine
    specs, _ = engine.adapter.fused_layers()
    native_stack = engine._fused
    new = torch.tensor([7, 8, 9, 10])
    try:
        engine._fused = fused.FusedStack(specs, lib=lib)
        _, cache = prefilled(model, 30, fused=True)
        portable = engine.forward(cache, new, 30)
        steps = [engine.forward(cache, new[i : i + 1], 30 + i)[0] for i in range(len(new))]
        assert all(torch.equal(steps[i], portable[i]) for i in range(len(new)))
    finally:
        engine._fused = native_stack
    _, cache = prefilled(model, 30, fused=True)
    return portable, engine.forward(cache, new, 30), cache


@pytest.mark.usefixtures("fp32_activations")
def test_the_portable_c_path_computes_the_same_model(portable_lib):
    """CPUs without AVX-512 build the plain-C path of both files: same logits within rounding, rows still exact."""
    portable, ref, _ = _portable_and_native(quantised_tiny("qwen3"), portable_lib)  # q/k norms: every norm path
    assert (portable - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_the_cache_holds_halves_under_int8_activations_and_floats_under_fp32(qtiny):
    """The speed mode keeps keys and values as IEEE halves (llama.cpp's default cache: half the bytes a long
    context's attention reads); fp32 activations keep transformers' floats.  Halves move the logits by their
    rounding only, and a token's logits still do not depend on how it was verified."""
    from selfspec.core.cache import KVCache
    from selfspec.core.quant import activations, int8_kernels_available

    for mode, dtype in (("int8", torch.float16), ("float32", torch.float32)):
        if mode == "int8" and not int8_kernels_available():
            continue
        with activations(mode):
            _, cache = prefilled(qtiny, 40, fused=True)
            assert cache.layer(0, 40)[0].dtype == dtype, mode
    engine = qtiny.engine
    ids, new = torch.arange(40) % 50 + 5, torch.tensor([7, 8, 9, 10])
    with activations("float32"):  # products alike: the two caches differ by the halves' rounding alone
        out = {}
        for dtype in (torch.float32, torch.float16):
            cache = KVCache(engine.num_layers, 64, dtype)
            engine.forward(cache, ids, 0, prefill=True, last_only=True)
            out[dtype] = engine.forward(cache, new, 40)
            steps = [engine.forward(cache, new[i : i + 1], 40 + i)[0] for i in range(len(new))]
            assert all(torch.equal(steps[i], out[dtype][i]) for i in range(len(new))), dtype
            assert cache.layer(1, 44)[1].dtype == dtype
    half, full = out[torch.float16], out[torch.float32]
    assert not torch.equal(half, full), "the halves were not used"
    assert torch.equal(half.argmax(-1), full.argmax(-1))
    assert (half - full).abs().max().item() <= 5e-3 * full.abs().max().item()


def test_the_portable_c_path_reads_and_writes_halves_as_the_vector_one(portable_lib):
    """Without AVX-512 the cache's halves are rounded and widened by plain C (_Float16) and attention's sums
    take the same fused multiply-adds in the same order: the same logits within rounding (norms and rotary
    part in their last bits), and a token's logits do not depend on how it was verified."""
    from selfspec.core.quant import activations, int8_kernels_available

    if not int8_kernels_available():
        pytest.skip("needs a CPU with AVX512-VNNI (the vector stack's halves and int8 products)")
    with activations("int8"):
        # head_dim 72: four vector chunks and a partial one in the scores, a 64-wide block and a scalar tail
        # in the weighted values
        model = tiny_model("llama", seed=5, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=72)
        quantize_linears(model.hf, 8)
        model = selfspec.model_from_hf(model.hf, model.tokenizer, name="tiny-llama-4x72")
        portable, ref, cache = _portable_and_native(model, portable_lib)
    assert cache.layer(0, 30)[0].dtype == torch.float16
    assert (portable - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_the_final_norm_on_the_stack_is_the_modules_norm(qtiny):
    """The engine's passes on the fused stack norm the head's input natively (the stack's own arithmetic): the
    model's module within float rounding, Gemma's 1 + weight included; the module itself elsewhere (autograd,
    other dtypes) and unless asked."""
    adapter = qtiny.engine.adapter
    norm = adapter.backbone.norm
    kept = norm.weight.detach().clone()
    try:
        with torch.no_grad():
            norm.weight.copy_(torch.randn_like(norm.weight))  # not the ones (or zeros) a tiny model starts with
        h = torch.randn(1, 5, adapter.hidden_size) * 3
        with torch.inference_mode():
            ref, got = norm(h), adapter.final_norm(h, native=True)
            assert got.shape == ref.shape and not torch.equal(got, h)
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(adapter.final_norm(h), ref)
            half = h.to(torch.bfloat16)
            assert torch.equal(adapter.final_norm(half, native=True), norm(half))
        grad = h.clone().requires_grad_()
        assert adapter.final_norm(grad, native=True).grad_fn is not None  # autograd keeps the module
    finally:
        with torch.no_grad():
            norm.weight.copy_(kept)
