"""int8-activation products of quantised weights (int8_kernels.c): accuracy against the dequantised weight,
row independence (what keeps speculative decoding lossless), the portable C path computing the very same
numbers, non-finite activations staying visible, and the process-wide switch reaching the fused stack."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_quant import assert_rows_are_independent, random_blocks

from selfspec.core import quant
from selfspec.core.quant import (
    CFLAGS,
    CODE_BITS,
    IQ4_LEVELS,
    ISA_FLAGS,
    LUT4,
    SOURCES,
    activations,
    from_gguf,
    int8_kernels_available,
    low_bit_copy,
    pack_x16,
    quantize_weight,
)
from selfspec.errors import SelfspecError

# q4 and q8 forms; Q6_K: groups of 16; Q2_K, Q3_K: codes in groups of 16, with and without minima; IQ4: levels
# looked up; IQ3_XXS, IQ2_XS: grid values as byte codes (groups of 32 and 16)
KINDS = ["Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q6_K", "Q8_0", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ2_XS"]


@pytest.fixture
def int8_activations():
    with activations("int8"):
        yield


@pytest.mark.usefixtures("int8_activations")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_int8_products_match_the_dequantised_weight_within_activation_rounding(kind, rows):
    qw = from_gguf(kind, random_blocks(kind, 96, 768, seed=rows), 96, 768)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ qw.dequantize().double().T
    got = qw.matmul(x).double()
    scale = float(ref.abs().max())
    # activations rounded to 8 bits per block of 32: errors of a few tenths of a percent of the largest output
    assert float((got - ref).abs().max()) <= 2e-2 * scale
    assert float((got - ref).abs().mean()) <= 5e-3 * scale
    with activations("float32"):  # the other mode is still there, and exact
        exact = qw.matmul(x).double()
    assert torch.allclose(exact, ref, rtol=1e-5, atol=1e-5 * scale)
    assert not torch.equal(exact, got)  # the int8 path really ran


@pytest.mark.usefixtures("int8_activations")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "Q2_K"])
def test_an_int8_rows_result_does_not_depend_on_how_many_rows_share_the_call(kind):
    qw = from_gguf(kind, random_blocks(kind, 64, 768), 64, 768)
    assert_rows_are_independent(qw, torch.randn(13, 768, generator=torch.Generator().manual_seed(2)))


@pytest.mark.usefixtures("int8_activations")
def test_weights_whose_rows_are_not_a_multiple_of_16_keep_fp32_products():
    qw = from_gguf("Q8_0", random_blocks("Q8_0", 37, 256), 37, 256)
    assert qw.x16() is None
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ qw.dequantize().double().T
    assert torch.allclose(qw.matmul(x).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.usefixtures("int8_activations")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activations_give_non_finite_outputs(bad):
    """A NaN would vanish in rounding to int8; the block's scale carries it instead, as fp32 products would."""
    qw = from_gguf("Q4_1", random_blocks("Q4_1", 32, 256), 32, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    x[1, 100] = bad
    y = qw.matmul(x)
    assert torch.isfinite(y[0]).all()
    assert not torch.isfinite(y[1]).any()


def _x16_code(raw, bits: int, g: int, nb: int, gi: int, r: int, e: int) -> int:
    """Code e of group gi, row r of block nb, read from the interleaved bytes by int8_kernels.c's header."""
    if bits == 8:
        return int(raw[nb, gi, (e // 4) * 64 + 4 * r + e % 4])
    if bits in (2, 3):  # the two low bits, then (3 bits) the third from the 32 bytes after them
        low = (int(raw[nb, gi, 4 * r + e % 4]) >> (2 * (e // 4))) & 3
        third = (int(raw[nb, gi, 64 + 4 * (r % 8) + e % 4]) >> (e // 4 + 4 * (r // 8))) & 1 if bits == 3 else 0
        return low | third << 2
    half = 16 if bits in (4, 5, LUT4) else 8  # codes e and e + half share a byte
    byte = int(raw[nb, gi, ((e % half) // 4) * 64 + 4 * r + e % 4])
    code = byte & 15 if e < half else byte >> 4
    if bits == 4:
        return code
    if bits == LUT4:  # an index into IQ4's levels, taken as the q8 code level + 128
        return int(IQ4_LEVELS[code]) + 128
    high = int(raw[nb, gi, (256 if bits == 5 else 128) + 4 * r + e % 4])
    per = bits - 4
    return code | ((high >> (per * (e // 4))) & ((1 << per) - 1)) << 4


def _x16_scale(table: torch.Tensor, nb: int, gi: int, r: int, g: int, groups: int) -> float:
    """Scale (or minimum) of group gi, row r of block nb, read from an interleaved table by int8_kernels.c's header:
    fp32, halves, or sub-scales (a signed byte per group and row, then a half per 256 weights and row)."""
    if table.dtype != torch.uint8:
        return float(table[nb, gi, r])
    raw = table.numpy()[nb]
    small = int(raw[gi * 16 + r : gi * 16 + r + 1].view(np.int8)[0])
    at = groups * 16 + (gi * g // 256) * 32 + 2 * r
    return small * float(raw[at : at + 2].copy().view(np.float16)[0])


@pytest.mark.parametrize("kind, bits", [("Q4_1", 4), ("Q6_K", 6), ("Q8_0", 8), ("Q5_0", 5), ("Q5_K", 5),
                                        ("Q4_K", 4), ("Q3_K", 3), ("Q2_K", 2), ("IQ4_NL", LUT4),
                                        ("IQ4_XS", LUT4)])  # fmt: skip
def test_x16_packing_keeps_every_code_scale_and_minimum(kind, bits):
    """The interleaved copy holds the same weight: decode it by its layout (int8_kernels.c's header); 5- and 6-bit
    types take their compact forms (a nibble plus one or two high bits per code), Q3_K and Q2_K their 3 and 2 bits,
    IQ4 its 4-bit indices (LUT4), the K-quants and IQ4_XS their sub-scales."""
    qw = from_gguf(kind, random_blocks(kind, 32, 256), 32, 256)
    codes, scale, minv = pack_x16(qw)
    assert qw.x16_bits == bits
    # the kernel computes a symmetric type's minimum: -4, -8, -16, -32 or -128 * scale
    assert (minv is None) == (kind in ("Q5_0", "Q6_K", "Q8_0", "Q3_K", "IQ4_NL", "IQ4_XS"))
    g = qw.group
    groups = 256 // g
    raw = codes.numpy().reshape(2, groups, -1)
    assert raw.shape[2] == 16 * g * CODE_BITS.get(bits, bits) // 8  # bytes per group of 16 rows
    sym_min = 128 if bits == LUT4 else 1 << (bits - 1)
    w = torch.empty(32, 256, dtype=torch.float64)
    for n in range(32):
        nb, r = divmod(n, 16)
        for k in range(256):
            gi, e = divmod(k, g)
            code = _x16_code(raw, bits, g, nb, gi, r, e)
            d = _x16_scale(scale, nb, gi, r, g, groups)
            m = -sym_min * d if minv is None else _x16_scale(minv, nb, gi, r, g, groups)
            w[n, k] = d * code + m
    assert torch.allclose(w, qw.dequantize().double(), atol=1e-6), kind


def test_compact_codes_can_be_turned_off(monkeypatch):
    """SELFSPEC_COMPACT_CODES=0 (A/B runs): 5- and 6-bit codes take a byte each in the interleaved copy too."""
    monkeypatch.setattr(quant, "_COMPACT", False)
    qw = from_gguf("Q5_0", random_blocks("Q5_0", 32, 256), 32, 256)
    assert qw.x16_bits == 8 and qw.x16()[0].numel() == 32 * 256


@pytest.mark.usefixtures("int8_activations")
@pytest.mark.parametrize("kind, held_bits", [("Q3_K", 3.5625), ("Q2_K", 3.125), ("IQ4_NL", 4.5), ("IQ4_XS", 4.3125)])
def test_low_bit_and_iq4_products_read_their_own_bits(kind, held_bits, monkeypatch):
    """Q3_K's and Q2_K's codes take 3 and 2 bits in the interleaved copy, IQ4's indices 4 (bits a weight: the codes,
    the sub-scales or half scales, Q2_K's minima; the files hold 3.4, 2.6, 4.5 and 4.25), so Q2_K / Q3_K_M /
    IQ4_XS files of 7-8B models fit memory near their size; IQ4's looked-up levels give the byte form's products
    bit for bit (the same integer codes), the others the dequantised weight's within activation rounding."""
    rows, k = 64, 768
    qw = from_gguf(kind, random_blocks(kind, rows, k, seed=11), rows, k)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(12))
    y = qw.matmul(x)
    assert qw.step_bytes * 8 / (rows * k) == held_bits
    monkeypatch.setattr(quant, "_COMPACT", False)
    wide = from_gguf(kind, random_blocks(kind, rows, k, seed=11), rows, k)
    assert wide.x16_bits == 8 and wide.step_bytes > 1.5 * qw.step_bytes
    if kind.startswith("IQ4"):
        assert torch.equal(wide.matmul(x), y)
    ref = x.double() @ qw.dequantize().double().T
    assert float((y.double() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


def test_an_unknown_activation_mode_is_a_clear_error():
    with pytest.raises(SelfspecError, match="activations must be one of"):
        quant.set_activations("int4")


def _cpu_has(*flags: str) -> bool:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return all(f in line.split() for f in flags)


@pytest.mark.skipif(not int8_kernels_available(), reason="needs vector int8 kernels (x86 here)")
@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 with gcc only")
@pytest.mark.parametrize("isa, kind_code", [("avxvnni", 3), ("avx2", 2), ("portable", 0)])
def test_every_int8_path_computes_the_same_numbers(tmp_path, isa, kind_code):
    """CPUs without AVX-512 VNNI get bit-identical products: from AVX-VNNI's 256-bit vpdpbusd, from AVX2's
    vpmaddubsw (which saturates, so q8 codes take the sign trick), or from the plain C loops; the reference is
    this machine's own native build."""
    if isa in ("avx2", "avxvnni") and not _cpu_has("avx2", "fma"):
        pytest.skip("this CPU has no AVX2")
    if isa == "avxvnni" and not _cpu_has("avx_vnni"):
        pytest.skip("this CPU has no AVX-VNNI")
    lib_path = tmp_path / f"{isa}.so"
    subprocess.run(["gcc", *CFLAGS, *ISA_FLAGS[isa], "-o", str(lib_path), *map(str, SOURCES), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    assert lib.selfspec_int8_kernels() == kind_code
    with activations("int8"):
        # Q5_0, Q5_K, Q6_K: compact 5- and 6-bit codes; Q3_K, Q2_K: 3 and 2 bits; IQ4: looked up; the last: a
        # symmetric 4-bit draft copy
        for kind in ("Q4_K", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "Q8_0->q4"):
            for T in (1, 5, 9):
                source = kind.split("->")[0]
                qw = from_gguf(source, random_blocks(source, 48, 512, seed=4), 48, 512)
                qw = low_bit_copy(qw) if "->" in kind else qw
                x = 3 * torch.randn(T, 512, generator=torch.Generator().manual_seed(5 + T))
                y = torch.empty(T, 48)
                codes, scale, minv = qw.x16()
                p = ctypes.c_void_p
                status = lib.selfspec_linear_x16(ctypes.c_int(qw.x16_form), ctypes.c_long(T),
                                                 ctypes.c_long(48), ctypes.c_long(512), ctypes.c_long(qw.group),
                                                 p(x.data_ptr()), p(codes.data_ptr()), p(scale.data_ptr()),
                                                 None if minv is None else p(minv.data_ptr()), None,
                                                 p(y.data_ptr()))  # fmt: skip
                assert status == 0
                assert torch.equal(y, qw.matmul(x)), (kind, T)


def test_the_fused_stack_follows_the_activation_mode(smollm2):
    """Switching the mode switches every product of the engine, the fused stack's included: the logits move by
    activation rounding only, and one-token steps still equal a chain's rows bit for bit in each mode."""
    engine = smollm2.engine
    ids = torch.tensor(smollm2.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"])
    new = torch.tensor(smollm2.tokenizer(" and then the cat")["input_ids"][:3])
    out = {}
    for mode in ("float32", "int8"):
        with activations(mode):
            cache = engine.new_cache(64)
            engine.forward(cache, ids, 0, prefill=True, last_only=True)
            chain = engine.forward(cache, new, len(ids))
            cache = engine.new_cache(64)
            engine.forward(cache, ids, 0, prefill=True, last_only=True)
            steps = [engine.forward(cache, new[i : i + 1], len(ids) + i)[0] for i in range(len(new))]
            assert all(torch.equal(chain[i], steps[i]) for i in range(len(new))), mode
            out[mode] = chain
    assert not torch.equal(out["float32"], out["int8"])
    assert (out["float32"] - out["int8"]).abs().max() <= 0.05 * out["float32"].abs().max()


@pytest.mark.parametrize("kind, compact", [("Q4_1", True), ("Q4_K", True), ("Q8_0", True), ("Q6_K", True),
                                           ("Q5_0", True), ("Q5_1", True), ("Q5_K", True), ("Q5_1", False),
                                           ("Q6_K", False), ("Q3_K", True), ("Q3_K", False), ("IQ4_NL", True),
                                           ("IQ4_XS", True), ("IQ4_XS", False), ("Q2_K", True)])  # fmt: skip
def test_a_released_row_form_is_rebuilt_bit_for_bit(kind, compact, monkeypatch):
    """Under int8 activations a layer's weight may keep its interleaved copy only; reading the row form rebuilds
    it exactly (with 5-bit codes at a byte each, q8 weights with minima keep both: their stored minimum - 128 *
    scale would lose bits)."""
    monkeypatch.setattr(quant, "_COMPACT", compact)
    qw = from_gguf(kind, random_blocks(kind, 48, 512, seed=6), 48, 512)
    before = [None if t is None else t.clone() for t in (qw.codes, qw.scale, qw.minv)]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    with activations("int8"):
        y = qw.matmul(x)
        held = qw.nbytes
        released = qw.release_rows()
        assert released == (compact or kind != "Q5_1")
        if released:
            assert qw.rows_released and qw.nbytes < held and qw.row_pointers() == (None, None, None)
        assert torch.equal(qw.matmul(x), y)  # the products never needed the row form
    after = (qw.codes, qw.scale, qw.minv)  # rebuilt on reading
    assert not qw.rows_released
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_fused_stack_keeps_layer_weights_in_one_form_under_int8(smollm2):
    """The default model's decoder layers hold their interleaved copies only (the prompt takes the int8 row
    kernels too); switching to fp32 activations rebuilds the row forms, and the logits of each mode stay."""
    engine = smollm2.engine
    ids = torch.tensor(smollm2.tokenizer("Memory is a feature, too.")["input_ids"])

    def logits():
        cache = engine.new_cache(32)
        return engine.forward(cache, ids, 0, prefill=True)

    with activations("int8"):
        first = logits()
        stack = engine._fused
        assert stack.released_bytes > 50e6  # SmolLM2's layers: about 79 MB
    with activations("float32"):
        fp32 = logits()
        assert stack.released_bytes == 0
    with activations("int8"):
        assert torch.equal(logits(), first)
        assert stack.released_bytes > 50e6
    with activations("float32"):
        assert torch.equal(logits(), fp32)


@pytest.mark.parametrize("kind, compact", [("Q8_0", True), ("Q4_0", True), ("Q4_1", True), ("Q5_0", False),
                                           ("Q5_0", True), ("Q5_1", True), ("Q5_K", True), ("Q6_K", True),
                                           ("Q3_K", True), ("Q2_K", True), ("IQ4_XS", True)])  # fmt: skip
def test_rows_of_a_released_table_are_looked_up_from_its_interleaved_copy(kind, compact, monkeypatch):
    """Token embeddings and the draft vocabulary read rows of a tied table whose row form is released: the
    same rows, without rebuilding the whole table (byte, nibble and compact 5- and 6-bit codes decoded in place
    by the native kernels, the 2- and 3-bit and IQ4 forms gathered first)."""
    monkeypatch.setattr(quant, "_COMPACT", compact)
    qw = from_gguf(kind, random_blocks(kind, 64, 256, seed=8), 64, 256)
    ids = torch.tensor([0, 17, 63, 17, 40])
    want_rows = qw.rows(ids)
    want = [None if t is None else t[ids] for t in (qw.codes, qw.scale, qw.minv)]
    with activations("int8"):
        assert qw.release_rows()
    got = qw.row_slices(ids)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert torch.equal(qw.rows(ids), want_rows)
    assert qw.rows_released  # neither call rebuilt the row form


@pytest.mark.parametrize("bits", [4, 8])
def test_released_rows_with_fp32_scales_are_looked_up_bit_for_bit(bits):
    """A weight quantised here (``--quantize int4`` / ``int8``) keeps fp32 scales in its interleaved copy: its
    rows decode from the copy as from the row form."""
    qw = quantize_weight(torch.randn(64, 256, generator=torch.Generator().manual_seed(3)), bits)
    ids = torch.tensor([63, 0, 31, 16, 15])
    want = qw.rows(ids)
    with activations("int8"):
        assert qw.release_rows()
    assert qw.__dict__["_x16"][1].dtype == torch.float32
    assert torch.equal(qw.rows(ids), want) and qw.rows_released


def test_a_model_loaded_under_int8_keeps_one_form_of_its_weights():
    """Loaded under int8 activations, the tied head and embedding table and every decoder layer hold their
    interleaved copies only; the draft vocabulary still scores exactly the head's rows."""
    import selfspec

    with activations("int8"):
        model = selfspec.load("smollm2-135m")
        head = model.adapter.quantized_head()
        assert head.rows_released
        assert model.engine._fused.released_bytes > 50e6
        out = selfspec.generate(model, "Name three colours.", "vanilla", max_new_tokens=8)
        assert len(out.token_ids) == 8 and head.rows_released  # lookups and products kept it so
    vocab = model.engine.draft_vocab
    x = torch.randn(2, head.in_features, generator=torch.Generator().manual_seed(9))
    with activations("int8"):
        assert torch.equal(vocab.product(x), head.matmul(x)[:, vocab.ids[: vocab.size]])


@pytest.mark.usefixtures("int8_activations")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_0->q4", "Q4_K", "Q5_K", "Q6_K",
                                  "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])  # fmt: skip
def test_half_scales_give_the_products_of_fp32_scales_bit_for_bit(kind, monkeypatch):
    """Types whose scales are halves in the file (and the 4-bit draft copies) keep them as halves in the
    interleaved copy, the K-quants as their sub-scales (a byte per group times a half per 256 weights): fewer bytes
    a scale read, widened exactly, so every product equals the fp32-scale one."""
    source = kind.split("->")[0]
    qw = from_gguf(source, random_blocks(source, 48, 512, seed=8), 48, 512)
    qw = low_bit_copy(qw) if "->" in kind else qw
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    y = qw.matmul(x)
    # K-quant (and IQ4_XS) scales are products of a half and a 4-, 6- or 8-bit integer
    sub = kind in ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")
    assert qw.x16()[1].dtype == (torch.uint8 if sub else torch.float16)
    assert qw.x16_form & (quant.X16_SUB8 if sub else quant.X16_SCALE16)
    monkeypatch.setattr(quant, "_half_scales", lambda *args: False)
    monkeypatch.setattr(quant, "_SUB_SCALES", False)
    wide = from_gguf(source, random_blocks(source, 48, 512, seed=8), 48, 512)
    wide = low_bit_copy(wide) if "->" in kind else wide
    assert wide.x16()[1].dtype == torch.float32
    assert torch.equal(wide.matmul(x), y)
    assert wide.step_bytes > qw.step_bytes


ARM_TOOLS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")


def _x16_hashes(tmp_path, name: str, compiler: list[str], run: list[str]) -> list[str]:
    """The lines of tests/native/x16_hash.c built by ``compiler`` (its flags included) and run by ``run``."""
    exe = tmp_path / name
    harness = Path(__file__).with_name("native") / "x16_hash.c"
    subprocess.run([*compiler, "-o", str(exe), str(harness), *map(str, SOURCES), "-lm"], check=True,
                   capture_output=True)  # fmt: skip
    return subprocess.run([*run, str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 with gcc only")
@pytest.mark.skipif(any(shutil.which(t) is None for t in ARM_TOOLS),
                    reason="needs an aarch64 cross compiler and qemu-user (.ci/run installs them where it can)")
@pytest.mark.parametrize("march, kind_code", [("armv8.2-a+dotprod", 4), ("armv8-a", 0)])
def test_arm_builds_compute_the_same_numbers(tmp_path, march, kind_code):
    """ARM CPUs (Apple silicon, Graviton, Ampere) get the same products: with the dot product extension from
    sdot, without it from the portable loops as the compiler vectorises them for NEON; built for aarch64 and run
    under qemu, every x16 form (4-, 5-, 6- and 8-bit codes; fp32, half and sub-scales; with and without minima)
    hashes to the bits of this machine's own build."""
    flags = [f for f in CFLAGS if f != "-shared"]  # executables of the library's sources and the harness
    ref = _x16_hashes(tmp_path, "native", ["gcc", *flags], [])
    arm = _x16_hashes(tmp_path, f"arm-{kind_code}",
                      ["aarch64-linux-gnu-gcc", "-static", f"-march={march}",
                       *(f for f in flags if f != "-march=native")], ["qemu-aarch64"])  # fmt: skip
    assert arm[0] == f"kind {kind_code}"
    assert len(arm) == len(ref) > 10 and arm[1:] == ref[1:]
