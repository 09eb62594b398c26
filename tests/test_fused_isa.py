"""Every build of the native library computes the same numbers: the fused stack's logits from the AVX-VNNI and
AVX2 builds (CPUs without AVX-512) and from the portable C build equal this machine's native build bit for bit.

Each build is compiled from the same sources with :data:`ISA_FLAGS` and swapped in as the engine's fused stack,
so one process compares them; the products outside the stack (the head) are the native library's in every run.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch
from test_int8_kernels import _cpu_has

import selfspec
from selfspec.core import fused
from selfspec.core.quant import CFLAGS, ISA_FLAGS, SOURCES, activations, int8_kernels_available, quantize_linears

pytestmark = [pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None,
                                 reason="x86-64 with gcc only"),
              pytest.mark.threads]  # (threads: every thread, as a user's run takes; fmt: skip)
PROMPT = 40  # below the prompt kernel's 65 rows: every pass takes the row kernels, which every build has


@pytest.fixture(scope="module")
def isa_libs(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """The library built for each narrower ISA this CPU can run, once for this module (the builds side by side:
    each compiler runs on one core)."""
    builds = {}
    for isa in ("avxvnni", "avx2", "portable"):
        if isa in ("avx2", "avxvnni") and not _cpu_has("avx2", "fma", "f16c"):
            continue
        if isa == "avxvnni" and not _cpu_has("avx_vnni"):
            continue
        path = tmp_path_factory.mktemp(isa) / f"{isa}.so"
        cmd = ["gcc", *CFLAGS, *ISA_FLAGS[isa], "-o", str(path), *map(str, SOURCES), "-lm"]
        builds[isa] = (path, cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    libs = {}
    for isa, (path, cmd, proc) in builds.items():
        _, err = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=err)
        libs[isa] = ctypes.CDLL(str(path))
    return libs


def _logits(model: selfspec.Model, lib: ctypes.CDLL | None, prompt: int = PROMPT) -> torch.Tensor:
    """The prompt's last logits, a 5-token chain's and 5 one-token steps' (a verification and the decoding that
    must agree with it), through the fused stack of `lib` (None: the native one): [11, V].  A prompt longer
    than PROMPT goes in passes of PROMPT rows."""
    engine = model.engine
    native = engine._fused
    if lib is not None:
        specs, _ = engine.adapter.fused_layers()
        engine._fused = fused.FusedStack(specs, lib=lib)
    try:
        cache = engine.new_cache(prompt + 16)
        ids = torch.arange(prompt) % 50 + 5
        for at in range(0, prompt, PROMPT):
            last = engine.forward(cache, ids[at : at + PROMPT], at, prefill=at == 0, last_only=True)
        new = torch.tensor([7, 8, 9, 10, 11])
        chain = engine.forward(cache, new, prompt)
        steps = torch.stack([engine.forward(cache, new[i : i + 1], prompt + i)[0] for i in range(len(new))])
    finally:
        engine._fused = native
    return torch.cat([last.reshape(1, -1), chain, steps])


def _assert_builds_agree(model: selfspec.Model, libs: dict[str, ctypes.CDLL], modes: tuple[str, ...],
                         prompt: int = PROMPT) -> None:
    assert model.engine.fused, model.engine.fused_reason
    for mode in modes:
        with activations(mode):
            ref = _logits(model, None, prompt)
            assert torch.equal(ref[1:6], ref[6:]), "a chain's rows differ from one-token steps"
            for isa, lib in libs.items():
                got = _logits(model, lib, prompt)
                assert torch.equal(got, ref), (isa, mode, (got - ref).abs().max().item())


def _modes() -> tuple[str, ...]:
    """float32 activations (float caches), and int8 ones (the speed mode: half caches) where they are vectorised"""
    return ("float32", "int8") if int8_kernels_available() else ("float32",)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_every_build_gives_the_built_in_models_the_same_logits(name, request, isa_libs):
    """SmolLM2 (SiLU, head size 64, 3 query heads per key/value head) and Gemma 3 (GELU, sandwich norms, q/k
    norms, head size 256): prompt, verification and one-token steps alike in every build."""
    _assert_builds_agree(request.getfixturevalue(name), isa_libs, _modes())


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_every_build_combines_attentions_key_blocks_alike(name, request, isa_libs):
    """After 600 tokens a row's attention runs in three blocks of keys combined in order (fused_decoder.c,
    KEY_BLOCK), a one-token step's blocks shared between threads: the same logits in every build."""
    _assert_builds_agree(request.getfixturevalue(name), isa_libs, ("int8",) if int8_kernels_available() else
                         ("float32",), prompt=600)  # fmt: skip


@pytest.mark.parametrize("head_dim", [72, 8])
def test_every_build_agrees_on_head_sizes_with_partial_chunks(head_dim, isa_libs):
    """Head sizes that are not multiples of 16: a partial vector chunk after full ones (72: the scores' masked
    tail, a scalar tail of the weighted values), and a head smaller than one chunk (8)."""
    from conftest import tiny_model

    model = tiny_model("llama", seed=5, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=head_dim)  # fmt: skip
    quantize_linears(model.hf, 8)
    model = selfspec.model_from_hf(model.hf, model.tokenizer, name=f"tiny-llama-4x{head_dim}")
    _assert_builds_agree(model, isa_libs, _modes())


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_every_build_writes_and_reads_8_bit_caches_alike(name, request, isa_libs):
    """``kv_cache="q8_0"``: each build quantises keys and values to the same 8-bit blocks and reads them back as
    the same floats (head sizes 64 and 256), so prompt, verification and one-token steps agree bit for bit."""
    from selfspec.core.quant import kv_cache

    with kv_cache("q8_0"):
        _assert_builds_agree(request.getfixturevalue(name), isa_libs, _modes())
