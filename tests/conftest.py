"""Shared fixtures: tiny random models of every supported architecture, and the real built-in models.

Tiny models get a character-level tokenizer built here (no download), so the
whole API (prompts, chat template, decoding) runs on them in milliseconds.
The real models are loaded once per session; the first load converts their
GGUF files (about a minute for SmolLM2, two for Gemma 3), later ones hit the cache.
"""

from __future__ import annotations

import os
import shutil
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import selfspec
from selfspec.core import native_thread

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


VOCAB = len(SPECIALS) + len(CHARS)


@pytest.fixture(autouse=True)
def engine_calls_where_made():
    """A test that made a server worker or a batch (which hand engine passes to one native thread) leaves calls
    running where they are made, and the test thread's torch thread count restored (core/native_thread.py)."""
    yield
    if native_thread.enabled():
        native_thread.disable()


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Point ``SELFSPEC_CACHE`` at a session temp dir, so tests never write the user's cache.

    The converted real-model checkpoints (``models/``, ``gguf/``), the GGUF metadata
    (``gguf-meta/``) and the compiled kernels (``native/``) are linked from the user's
    cache, so that they are made once ever rather than once per session;
    cost profiles are copied (tests may rewrite them), so that they are not re-measured.
    """
    user = Path(os.environ.get("SELFSPEC_CACHE", Path.home() / ".cache" / "selfspec"))
    cache = tmp_path_factory.mktemp("selfspec-cache")
    for name in ("models", "gguf", "gguf-meta", "native"):
        (user / name).mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(user / name, target_is_directory=True)
    if (user / "profiles").is_dir():
        shutil.copytree(user / "profiles", cache / "profiles")
    old = os.environ.get("SELFSPEC_CACHE")
    os.environ["SELFSPEC_CACHE"] = str(cache)
    yield cache
    if old is None:
        del os.environ["SELFSPEC_CACHE"]
    else:
        os.environ["SELFSPEC_CACHE"] = old


@pytest.fixture(autouse=True)
def machine_independent_costs(request, monkeypatch):
    """Every test decides with the read-bound profile of its model's shape and a simulated clock
    (:mod:`selfspec.core.clock`), so that whether a round drafts does not depend on the CPU running the
    suite, and sees no other load on its CPUs (``clock.OtherLoad``: what other processes took of them is the
    machine's state, not the test's; a kernel-variant test with a fake timer, timed over microseconds, once read
    one tick of another process as a busy machine and kept the default); tests of measurement itself are marked
    ``real_clock``."""
    if request.node.get_closest_marker("real_clock") is not None:
        yield
        return
    from selfspec.core import clock
    from selfspec.cost.costs import read_bound_profile

    class Quiet(clock.OtherLoad):
        def __exit__(self, *exc: object) -> None:
            self.cores = 0.0

    monkeypatch.setattr(clock, "OtherLoad", Quiet)
    with clock.simulated(read_bound_profile):
        yield


def tiny_config(arch: str, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB + 4,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=24, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if arch == "gemma3_text":
        layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * (common["num_hidden_layers"] // 3)
        return Gemma3TextConfig(head_dim=16, sliding_window=16, layer_types=layer_types, query_pre_attn_scalar=16,
                                **common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **overrides) -> selfspec.Model:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation="sdpa")
    # Random init gives near-uniform logits; sharpen them so greedy decoding is well defined and drafts can match.
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    hf.eval()
    return selfspec.model_from_hf(hf, char_tokenizer(), name=f"tiny-{arch}")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for a test (restored after it): a tiny model's decoding is Python and small
    torch operations, where a second intra-op thread only waits; the statistical sampling tests, thousands of
    tiny decodings each, took 40 s instead of 53 s on one thread (2026-11-29, 2-core Intel VM)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


@pytest.fixture(scope="session", params=ARCHS)
def tiny(request) -> selfspec.Model:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> selfspec.Model:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2() -> selfspec.Model:
    return selfspec.load("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32() -> selfspec.Model:
    """SmolLM2 dequantised to fp32 (the kernel layer's products, which quantised weights bypass)."""
    return selfspec.load("smollm2-135m", quantize="none")


@pytest.fixture(scope="session")
def gemma3() -> selfspec.Model:
    return selfspec.load("gemma3-270m")


def hf_greedy(model: selfspec.Model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding, the reference every method must reproduce."""
    x = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(model.eos_token_ids),
            pad_token_id=model.tokenizer.pad_token_id or 0,
            top_p=None,
            top_k=None,
            temperature=None,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture
def fp32_activations():
    """Products of quantised weights keep float32 activations within the test (what the fp32-fidelity tests
    check); the int8 mode has tests of its own (test_int8_kernels.py)."""
    from selfspec.core.quant import activations

    with activations("float32"):
        yield
