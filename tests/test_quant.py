"""Quantised weights: exact repacks of every supported GGUF type, the kernels' products, the GGUF loader's
errors and warnings, weight-only int8/int4 of HF models, and lossless decoding on quantised models."""

from __future__ import annotations

import ctypes
import platform
import shutil
import struct
import subprocess
import warnings

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_model

import selfspec
from selfspec.arch.gguf import _raw, _read_header
from selfspec.core.quant import (
    CFLAGS,
    PREFILL_ROWS,
    REPACKED_TYPES,
    SOURCE,
    QuantLinear,
    activations,
    from_gguf,
    quantize_linears,
    quantize_weight,
)
from selfspec.errors import InvalidInputError, SelfspecError
from selfspec.model.models import BUILTINS, _builtin_gguf

# these tests check the fp32-activation kernels against the dequantised model (int8: test_int8_kernels.py)
pytestmark = pytest.mark.usefixtures("fp32_activations")

# byte offsets of the fp16 fields of each block type (random bytes there could be NaN or inf)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108],
               "IQ4_NL": [0], "IQ4_XS": [0], "IQ3_S": [0], "IQ3_XXS": [0], "IQ2_XXS": [0], "IQ2_XS": [0],
               "IQ2_S": [0], "IQ1_S": [0]}  # fmt: skip


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 2e-2) -> np.ndarray:
    """Valid random GGUF data of type ``kind`` for a [rows, cols] weight: any bit pattern is a valid code;
    the fp16 scales are set to finite values of realistic size."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[kind]:
        values = rng.uniform(scale / 200, scale, size=(len(blocks), 1)).astype(np.float16)
        blocks[:, off : off + 2] = values.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", REPACKED_TYPES)
def test_repack_decodes_bit_for_bit_as_gguf(kind):
    rows, cols = 8, 512
    data = random_blocks(kind, rows, cols)
    qw = from_gguf(kind, data, rows, cols)
    ref = gguf.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    assert np.array_equal(qw.dequantize().numpy(), ref)


@pytest.mark.parametrize("name", list(BUILTINS))
def test_real_tensors_of_the_builtin_files_decode_exactly(name):
    """Each tensor type of the built-in GGUF files (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K), on its real data."""
    if BUILTINS[name].extra and not BUILTINS[name].installed():
        pytest.skip(f"{name} is installed on request only (selfspec models install {name})")
    path = _builtin_gguf(BUILTINS[name])
    _, tensors, _ = _read_header(path)
    seen = set()
    with path.open("rb") as f:
        for tensor_name, kind, shape, offset, nbytes in tensors:
            if kind in seen or len(shape) != 2:
                continue
            seen.add(kind)
            raw = _raw(f, offset, nbytes).reshape(shape[1], -1)
            qw = from_gguf(kind, raw, shape[1], shape[0])
            rows = min(shape[1], 2048)
            ref = gguf.dequantize(raw[:rows], gguf.GGMLQuantizationType[kind]).reshape(rows, shape[0])
            assert np.array_equal(qw.rows(torch.arange(rows)).numpy(), ref), (tensor_name, kind)
    assert seen & set(REPACKED_TYPES)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q5_1", "Q2_K", "Q3_K"])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, PREFILL_ROWS + 5])
def test_product_matches_the_dequantised_weight(kind, rows):
    data = random_blocks(kind, 96, 768, seed=rows)
    qw = from_gguf(kind, data, 96, 768)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ qw.dequantize().double().T
    got = qw.matmul(x).double()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def assert_rows_are_independent(qw, x: torch.Tensor) -> torch.Tensor:
    """Each row of ``qw.matmul(x)`` (13 rows) equals its one-row product and any split of the rows among calls;
    returns the product of all rows."""
    together = qw.matmul(x)
    for i in range(len(x)):
        assert torch.equal(qw.matmul(x[i : i + 1].contiguous())[0], together[i])
    for lo, hi in ((0, 5), (5, 11), (11, 13)):
        assert torch.equal(qw.matmul(x[lo:hi].contiguous()), together[lo:hi])
    return together


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "Q5_1", "Q3_K"])
@pytest.mark.parametrize("out_rows", [64, 37])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call(kind, out_rows):
    """What keeps speculative decoding lossless: a verified token's logits equal a one-token step's (any number of
    output rows; input rows in blocks of 8 with a tail; any split of the rows among calls)."""
    qw = from_gguf(kind, random_blocks(kind, out_rows, 768), out_rows, 768)
    x = torch.randn(13, 768, generator=torch.Generator().manual_seed(2))
    together = assert_rows_are_independent(qw, x)
    ref = x.double() @ qw.dequantize().double().T
    assert torch.allclose(together.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_rows_outside_the_table_are_refused():
    qw = from_gguf("Q8_0", random_blocks("Q8_0", 4, 64), 4, 64)
    with pytest.raises(IndexError):
        qw.rows(torch.tensor([4]))


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_quantisation_error_is_within_half_a_step(bits):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    qw = quantize_weight(w, bits)
    err = (qw.dequantize() - w).abs().reshape(48, 8, 32).amax(-1)
    assert torch.all(err <= qw.scale * 0.5 + 1e-6)


def test_quantised_linear_passes_gradients_to_its_input():
    layer = QuantLinear(quantize_weight(torch.randn(16, 64), 8))
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad[0], layer.qweight.dequantize().sum(0), atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_int_quantised_tiny_model_decodes_losslessly(bits):
    model = tiny_model("llama", seed=5)
    assert quantize_linears(model.hf, bits) > 0
    model = selfspec.model_from_hf(model.hf, model.tokenizer, name=f"tiny-int{bits}")
    assert model.quantization == "custom"
    base = selfspec.generate(model, "Hello there, how are", "vanilla", max_new_tokens=24)
    for method in ("swift", "asd"):
        assert selfspec.generate(model, "Hello there, how are", method, max_new_tokens=24).token_ids == base.token_ids


def test_quantised_weights_refuse_other_devices_and_dtypes():
    with pytest.raises(InvalidInputError, match="quantize none"):
        selfspec.load("smollm2-135m", dtype="bfloat16")
    with pytest.raises(InvalidInputError, match="quantize"):
        selfspec.load("smollm2-135m", quantize="int3")


def _copy_with_tensor_type(src, dst, tensor: str, kind: str) -> None:
    """Copy a GGUF file, declaring ``tensor`` to be of type ``kind`` and filling it with valid random data of
    that type (smaller than the original, so it fits where the original was)."""
    shutil.copyfile(src, dst)
    _, tensors, _ = _read_header(dst)
    _, _, shape, offset, _ = next(t for t in tensors if t[0] == tensor)
    with open(dst, "r+b") as f:
        head = f.read(64 << 20)
        key = tensor.encode()
        at = head.find(struct.pack("<Q", len(key)) + key)
        assert at > 0
        pos = at + 8 + len(key)
        (n_dims,) = struct.unpack_from("<I", head, pos)
        f.seek(pos + 4 + 8 * n_dims)
        f.write(struct.pack("<I", int(gguf.GGMLQuantizationType[kind])))
        f.seek(offset)
        f.write(random_blocks(kind, shape[1], shape[0], scale=2e-3).tobytes())


def test_unsupported_tensor_type_is_dequantised_with_a_warning(tmp_path):
    path = tmp_path / "smollm2-iq1s.gguf"
    _copy_with_tensor_type(_builtin_gguf(BUILTINS["smollm2-135m"]), path, "blk.3.ffn_down.weight", "IQ1_S")
    with pytest.warns(UserWarning, match=r"IQ1_S \(1 tensors\).*dequantised"):
        model = selfspec.load(str(path))
    down = model.hf.model.layers[3].mlp.down_proj
    assert isinstance(down, torch.nn.Linear) and not isinstance(down, QuantLinear)
    assert selfspec.generate(model, "One two three", "vanilla", max_new_tokens=4).token_ids


@pytest.mark.parametrize("kind, group", [("Q2_K", 16), ("Q3_K", 16), ("IQ4_XS", 32), ("IQ4_NL", 32), ("IQ3_XXS", 32),
                                         ("IQ2_XS", 16)])  # fmt: skip
def test_low_bit_k_and_iq4_tensors_stay_quantised_and_drafts_stay_lossless(kind, group, tmp_path):
    """Q2_K, Q3_K, IQ4_XS, IQ4_NL and the IQ2 / IQ3 tensors (Q2_K, Q3_K_M, IQ4_XS, IQ3_XXS, IQ2_XS files) are
    repacked, not dequantised to float32; under int8 activations (the default) a speculative method keeps
    vanilla's tokens on such a file."""
    path = tmp_path / f"smollm2-{kind}.gguf"
    _copy_with_tensor_type(_builtin_gguf(BUILTINS["smollm2-135m"]), path, "blk.3.ffn_down.weight", kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "dequantised" warning
        model = selfspec.load(str(path))
    down = model.hf.model.layers[3].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.qweight.source == kind
    assert down.qweight.group == group
    with activations("int8"):
        vanilla = selfspec.generate(model, "One two three four", "vanilla", max_new_tokens=12).token_ids
        drafted = selfspec.generate(model, "One two three four", "static", max_new_tokens=12,
                                    skip_set={"attention": [], "mlp": [20, 21, 22]})  # fmt: skip
    assert drafted.token_ids == vanilla and drafted.stats.drafted > 0, "verification passes of several rows ran"


def test_truncated_and_foreign_gguf_files_get_clear_errors(tmp_path):
    src = _builtin_gguf(BUILTINS["smollm2-135m"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(SelfspecError, match="truncated"):
        selfspec.load(str(cut))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(src.read_bytes()[:4096])
    with pytest.raises(SelfspecError, match="corrupt or truncated"):
        selfspec.load(str(header_only))
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(SelfspecError, match="not a GGUF file"):
        selfspec.load(str(foreign))


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_builtin_models_stay_quantised(name, request):
    model = request.getfixturevalue(name)
    assert model.quantization.startswith("gguf:")
    assert not any(type(m) is torch.nn.Linear for m in model.hf.modules())


def test_quantised_logits_are_the_dequantised_models_within_rounding(smollm2, smollm2_fp32):
    """Same weights, two ways: the quantised kernels against the fp32 checkpoint converted by transformers."""
    ids = torch.tensor([smollm2.encode("The quick brown fox jumps over the lazy dog. It was")])
    with torch.inference_mode():
        ours, ref = smollm2.hf(ids).logits[0], smollm2_fp32.hf(ids).logits[0]
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 with gcc only")
def test_portable_kernels_without_avx512_agree(tmp_path):
    """The plain-C path (CPUs without AVX-512) computes the same products."""
    lib_path = tmp_path / "portable.so"
    subprocess.run(["gcc", *CFLAGS, "-mno-avx512f", "-o", str(lib_path), str(SOURCE), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    for kind in ("Q4_K", "Q8_0", "Q6_K"):
        qw = from_gguf(kind, random_blocks(kind, 24, 512, seed=4), 24, 512)
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
        y = torch.empty(5, 24)
        minv = None if qw.minv is None else ctypes.c_void_p(qw.minv.data_ptr())
        args = [ctypes.c_long(5), ctypes.c_long(24), ctypes.c_long(512)]
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, qw.codes, qw.scale)]
        if qw.fmt == "q4":
            lib.selfspec_linear_q4(*args, *ptrs, minv, ctypes.c_void_p(y.data_ptr()))
        else:
            lib.selfspec_linear_q8(*args, ctypes.c_long(qw.group), *ptrs, minv, ctypes.c_void_p(y.data_ptr()))
        assert torch.allclose(y, qw.matmul(x), rtol=1e-5, atol=1e-4), kind


@pytest.fixture
def prefill_dtype_reset(monkeypatch):
    from selfspec.core import quant

    monkeypatch.setattr(quant, "_PREFILL_DTYPE", None)
    yield quant
    quant._PREFILL_DTYPE = None  # the next caller measures again


def test_prefill_dtype_is_float32_unless_asked(prefill_dtype_reset, monkeypatch):
    quant = prefill_dtype_reset
    monkeypatch.delenv(quant.PREFILL_DTYPE_ENV, raising=False)
    assert quant.prefill_dtype() == torch.float32
    for value, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        monkeypatch.setenv(quant.PREFILL_DTYPE_ENV, value)
        quant._PREFILL_DTYPE = None
        assert quant.prefill_dtype() == dtype
    monkeypatch.setenv(quant.PREFILL_DTYPE_ENV, "int3")
    quant._PREFILL_DTYPE = None
    with pytest.raises(SelfspecError, match="float32 or bfloat16"):
        quant.prefill_dtype()
    quant.set_prefill_dtype("bfloat16")
    assert quant.prefill_dtype() == torch.bfloat16
    assert quant.bfloat16_speedup() > 0


def test_bfloat16_prefill_stays_within_rounding_of_float32(prefill_dtype_reset):
    quant = prefill_dtype_reset
    model = tiny_model("llama", seed=7)
    quantize_linears(model.hf, 4)
    model = selfspec.model_from_hf(model.hf, model.tokenizer, name="tiny-int4-prefill")
    ids = torch.arange(100) % 60 + 3  # 100 rows: the tiled prefill path
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        quant._PREFILL_DTYPE = dtype
        cache = model.engine.new_cache(128)
        logits[dtype] = model.engine.forward(cache, ids, 0, prefill=True)
    ref, got = logits[torch.float32], logits[torch.bfloat16]
    assert not torch.equal(ref, got)  # the bf16 path did run
    assert (got - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95


needs_split_products = pytest.mark.skipif(
    not __import__("selfspec.core.quant", fromlist=["x"]).split_products_available(),
    reason="the prompt's split-bf16 products need a CPU with AVX512-BF16",
)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q6_K", "Q8_0", "Q5_1", "Q2_K", "Q3_K"])
@pytest.mark.parametrize("rows,out", [(PREFILL_ROWS, 96), (137, 70)])  # 70 outputs: a short last panel
def test_the_blocked_prompt_kernel_is_as_accurate_as_fp32(kind, rows, out, monkeypatch):
    """prompt_gemm.c (panels of 32 decoded output rows, 8 rows of x at a time) against fp64, on every storage
    form, with a panel that has fewer than 32 rows, and with a row count that is no multiple of 8."""
    from selfspec.core import quant

    if not quant.native().selfspec_prompt_gemm_available():
        pytest.skip("the blocked prompt kernel needs the kernels' AVX-512 build")
    qw = from_gguf(kind, random_blocks(kind, out, 768, seed=rows), out, 768)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(9)) * torch.rand(rows, 1) * 4
    ref = x.double() @ qw.dequantize().double().T
    monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, "gemm")
    with quant.bulk_rows():
        got = qw.matmul(x).double()
    monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, "rows")
    one_token_rows = qw.matmul(x).double()
    assert not torch.equal(got, one_token_rows)  # the blocked kernel did run
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= 3e-6 * scale
    assert float((one_token_rows - ref).abs().max()) <= 3e-6 * scale


@needs_split_products
def test_activations_split_exactly_into_three_bfloat16_pieces():
    """What makes the bf16 prompt kernel as exact as fp32: x == hi + mid + lo for every fp32 value in range."""
    from selfspec.core import quant

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 64, generator=gen) * torch.logspace(-30, 30, 64)  # magnitudes 1e-30 .. 1e30, both signs
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2**-23, -(2.0 - 2**-22)])  # every mantissa bit used
    pieces = torch.empty(3, 3 * 64, dtype=torch.int16)
    sums = torch.empty(3, 2)
    quant.native().selfspec_prefill_split(3, 64, 32, x.data_ptr(), pieces.data_ptr(), sums.data_ptr())
    hi, mid, lo = pieces.view(3, 32, 3, 2).view(torch.bfloat16).float().unbind(2)
    assert torch.equal(hi.reshape(3, 64) + mid.reshape(3, 64) + lo.reshape(3, 64), x)
    assert torch.allclose(sums, x.view(3, 2, 32).sum(-1), rtol=1e-5)


@needs_split_products
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q6_K", "Q8_0", "Q5_1", "Q2_K", "Q3_K"])
@pytest.mark.parametrize("rows", [PREFILL_ROWS, 130])
def test_prompt_products_are_as_accurate_as_fp32_on_decoded_tiles(kind, rows, monkeypatch):
    """Prefill-sized products: the split-bf16 kernel (every storage form: q4 with minimums, q8 in groups of 16
    and 32, with and without minimums; a short last row tile) against fp64, and against torch's fp32 product on
    decoded tiles, which it replaces."""
    from selfspec.core import quant

    qw = from_gguf(kind, random_blocks(kind, 96, 768, seed=rows), 96, 768)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(9)) * torch.rand(rows, 1) * 4
    ref = x.double() @ qw.dequantize().double().T
    with quant.bulk_rows():
        monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, "split")
        split = qw.matmul(x).double()
        monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, "tiles")
        tiles = qw.matmul(x).double()
    assert not torch.equal(split, tiles)  # two different kernels did run
    scale = float(ref.abs().max())
    err_split, err_tiles = float((split - ref).abs().max()), float((tiles - ref).abs().max())
    assert err_split <= 2e-6 * scale, (err_split / scale, err_tiles / scale)
    assert err_split <= 3 * err_tiles + 1e-7 * scale


@pytest.mark.parametrize("kernel", ["rows", "gemm", pytest.param("split", marks=needs_split_products)])
def test_prefill_kernels_keep_the_real_models_logits(smollm2, monkeypatch, kernel):
    """The default model's prompt pass through each fp32 prompt kernel against the same pass on fp32 tiles."""
    from selfspec.core import quant

    if kernel in ("rows", "gemm") and not quant.native().selfspec_vector_kernels():
        pytest.skip(f"the {kernel} prompt kernel needs the kernels' AVX-512 build (quant.prefill_kernel refuses it)")
    ids = torch.tensor(smollm2.encode("The quick brown fox jumps over the lazy dog. " * 12))
    assert len(ids) >= PREFILL_ROWS
    logits = {}
    for name in (kernel, "tiles"):
        monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, name)
        cache = smollm2.engine.new_cache(len(ids) + 8)
        logits[name] = smollm2.engine.forward(cache, ids, 0, prefill=True)
    got, ref = logits[kernel], logits["tiles"]
    assert not torch.equal(got, ref)  # two different kernels did run
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_rows_prompt_kernel_computes_each_row_as_a_one_token_step(smollm2, monkeypatch):
    """With the rows prompt kernel the prompt's logits are bit for bit those of feeding it one token at a time:
    one arithmetic for prefill, decoding and verification."""
    from selfspec.core import quant

    if not quant.native().selfspec_vector_kernels():
        pytest.skip("the rows prompt kernel needs the kernels' AVX-512 build")
    monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, "rows")
    ids = torch.tensor(smollm2.encode("The quick brown fox jumps over the lazy dog. " * 12))
    assert len(ids) >= PREFILL_ROWS
    engine = smollm2.engine
    whole = engine.forward(engine.new_cache(len(ids)), ids, 0, prefill=True)
    cache = engine.new_cache(len(ids))
    steps = torch.cat([engine.forward(cache, ids[i : i + 1], i) for i in range(len(ids))])
    assert torch.equal(whole, steps)


def test_an_unknown_prefill_kernel_is_a_clear_error(monkeypatch):
    from selfspec.core import quant
    from selfspec.errors import SelfspecError

    monkeypatch.setenv(quant.PREFILL_KERNEL_ENV, "fastest")
    with pytest.raises(SelfspecError, match="SELFSPEC_PREFILL_KERNEL must be one of rows, gemm, split, tiles"):
        quant.prefill_kernel()


def test_a_pass_reads_every_product_but_not_an_embedding_table_of_its_own():
    from torch import nn

    from selfspec.core.quant import QuantEmbedding, QuantLinear, quantize_weight, quantized_bytes

    table, proj = quantize_weight(torch.randn(64, 32), 8), quantize_weight(torch.randn(16, 32), 4)
    untied = nn.ModuleList([QuantEmbedding(table), QuantLinear(proj)])
    assert quantized_bytes(untied, read=True) == proj.step_bytes  # a step looks up one row of the table
    assert quantized_bytes(untied) == table.nbytes + proj.nbytes
    tied = nn.ModuleList([QuantEmbedding(table), QuantLinear(table), QuantLinear(proj)])
    assert quantized_bytes(tied, read=True) == table.step_bytes + proj.step_bytes  # the head reads it all


def _mapped(tmp_path, kind: str, rows: int, cols: int, perm=None):
    """(MappedTable over a file holding random ``kind`` blocks, the in-memory repack of the same blocks)."""
    from selfspec.core.quant import MappedTable

    data = random_blocks(kind, rows, cols, seed=rows)
    path = tmp_path / f"{kind}.bin"
    path.write_bytes(b"\0" * 96 + data.tobytes())  # the tensor at an offset, as in a GGUF file
    blocks = np.memmap(path, dtype=np.uint8, mode="r", offset=96, shape=data.shape)
    full = from_gguf(kind, data, rows, cols)
    return MappedTable(kind, blocks, rows, cols, perm), (full if perm is None else full.permute_rows(perm))


@pytest.mark.parametrize("kind", REPACKED_TYPES)
def test_a_table_left_in_the_file_looks_up_the_repacks_rows_bit_for_bit(kind, tmp_path):
    from selfspec.core.quant import QuantEmbedding, quantized_bytes

    table, full = _mapped(tmp_path, kind, 40, 512)
    ids = torch.tensor([[3, 0, 39, 3], [7, 7, 21, 1]])  # repeats, both ends of the table
    assert (table.fmt, table.group, table.step_bytes) == (full.fmt, full.group, full.step_bytes)
    for scale in (None, 2.5):
        assert torch.equal(QuantEmbedding(table, scale)(ids), QuantEmbedding(full, scale)(ids))
    assert torch.equal(table.dequantize(), full.dequantize())
    assert torch.equal(table.repacked().codes, full.codes)
    assert table.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 512)
    for bad in (40, -1):
        with pytest.raises(IndexError):
            table.rows(torch.tensor([bad]))
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    assert table.file_bytes == 40 * 512 // block * size and quantized_bytes(QuantEmbedding(table)) == 0  # in the file


def test_a_table_left_in_the_file_keeps_the_architectures_row_order(tmp_path):
    perm = np.random.default_rng(0).permutation(48)
    table, full = _mapped(tmp_path, "Q4_K", 48, 256, perm)
    ids = torch.arange(48)
    assert torch.equal(table.rows(ids), full.rows(ids))
    assert torch.equal(table.repacked().scale, full.scale)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_tied_embedding_is_repacked_and_shared_with_the_head(name, request):
    """Their files have no output tensor: the head multiplies the embedding's table, so it stays repacked."""
    from selfspec.core.quant import QuantWeight

    model = request.getfixturevalue(name)
    table = model.hf.get_input_embeddings().qweight
    assert isinstance(table, QuantWeight) and model.hf.get_output_embeddings().qweight is table


@pytest.mark.parametrize("kind", REPACKED_TYPES)
def test_a_head_made_packed_is_the_released_repack(kind, monkeypatch):
    """``from_gguf(packed=True)`` (an untied head under int8 activations) holds what repacking, packing and
    releasing the row form holds, a few blocks of 16 rows at a time; q8 forms with minima keep their rows."""
    from selfspec.core import quant

    data = random_blocks(kind, 48, 256, seed=5)
    ref = from_gguf(kind, data, 48, 256)
    expected = [t.clone() for t in (ref.codes, ref.scale) + ((ref.minv,) if ref.minv is not None else ())]
    released = ref.release_rows()
    monkeypatch.setattr(quant, "CHUNK_BYTES", 1)  # 16 rows a time: three pieces
    packed = from_gguf(kind, data, 48, 256, packed=True)
    assert packed.rows_released == released
    if released:
        for mine, theirs in zip(packed.x16(), ref.x16(), strict=True):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs)
        assert packed.nbytes == ref.nbytes
    ids = torch.tensor([0, 17, 47, 17])
    assert torch.equal(packed.rows(ids), ref.rows(ids))  # (token lookups read the copy)
    restored = [packed.codes, packed.scale] + ([packed.minv] if packed.minv is not None else [])
    assert all(torch.equal(a, b) for a, b in zip(restored, expected, strict=True))


@pytest.mark.parametrize(("kind", "nan"), [("Q4_K", False), ("Q5_K", False), ("Q6_K", False), ("Q8_0", False),
                                          ("Q8_0", True), ("Q5_0", False), ("Q5_0", True)])
@pytest.mark.parametrize("cols", [256, 768])
def test_blocks_packed_in_c_are_the_numpy_packs_bytes(kind, nan, cols, monkeypatch):
    """gguf_repack.c packs Q4_K, Q5_K, Q6_K, Q5_0 and Q8_0 blocks straight into the interleaved copy: codes,
    scale tables and minima byte for byte what the numpy repack and pack_x16 make, over random blocks (every code
    bit pattern) of several 256-weight blocks a row, in pieces of 16 rows.  A NaN half scale (Q8_0, Q5_0: no half
    equals it, so numpy keeps fp32 scales) sends the weight down the numpy path."""
    from selfspec.core import quant

    if quant._native_repack(kind, cols) is None:
        pytest.skip("no native kernels here")
    data = random_blocks(kind, 48, cols, seed=11)
    if nan:
        size = {"Q8_0": 34, "Q5_0": 22}[kind]  # a block's bytes; its half scale first
        data[30, size * 3 : size * 3 + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    calls = []
    natively = quant._packed_natively
    monkeypatch.setattr(quant, "_packed_natively", lambda *a: calls.append(a[0]) or natively(*a))
    monkeypatch.setattr(quant, "CHUNK_BYTES", 1)  # 16 rows a time: three pieces
    mine = from_gguf(kind, data, 48, cols, packed=True)
    assert calls == [kind]
    monkeypatch.setattr(quant, "_NATIVE_REPACK", False)
    theirs = from_gguf(kind, data, 48, cols, packed=True)
    assert calls == [kind]
    form = [(w.fmt, w.group, w.x16_bits, w.nbytes) for w in (mine, theirs)]
    assert form[0] == form[1]
    assert (mine.x16()[1].dtype == torch.float32) == nan
    for a, b in zip(mine.x16(), theirs.x16(), strict=True):  # (bytes: a NaN equals nothing)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                                b.reshape(-1).view(torch.uint8)))
    ids = torch.tensor([0, 17, 30, 47])
    assert np.array_equal(mine.rows(ids).numpy(), theirs.rows(ids).numpy(), equal_nan=True)


def test_embedding_lookups_of_recent_tokens_are_the_tables_rows(smollm2):
    """Short lookups (a decoding step's ids) go through the decoded rows of recent tokens: bit for bit the
    table's rows, a new tensor each call (callers may write into it), the rows kept bounded."""
    from selfspec.core import quant

    embed = smollm2.hf.get_input_embeddings()
    assert isinstance(embed, quant.QuantEmbedding)
    ids = torch.tensor([[5, 17, 5, 40000]])
    first = embed(ids)
    assert torch.equal(first, embed.qweight.rows(ids.reshape(-1)).reshape(1, 4, -1))
    first.zero_()  # the caller's tensor, not a kept row
    assert torch.equal(embed(ids), embed.qweight.rows(ids.reshape(-1)).reshape(1, 4, -1))
    for t in range(embed._recent_max + 40):
        embed(torch.tensor([t]))
    assert len(embed._recent) == embed._recent_max
    with pytest.raises(IndexError):
        embed(torch.tensor([embed.num_embeddings]))


def test_a_prompts_lookup_keeps_its_rows_for_the_steps_after_it(smollm2):
    """A long lookup (a prompt) leaves its distinct ids' rows among the recent rows, each a copy of its own:
    a step's lookup of one of them is a hit, bit for bit the row the prompt's lookup gave, whatever the caller
    did with that lookup's tensor; at most the newest ``_recent_max`` distinct ids are kept."""
    from selfspec.core import quant

    embed = quant.QuantEmbedding(smollm2.hf.get_input_embeddings().qweight)  # a fresh table of recent rows
    ids = torch.tensor([[9, 300, 9, 41000, 77, 300, 12, 5, 6, 7, 8]])  # longer than a step's lookup, repeats
    rows = embed(ids)
    expected = rows.clone()
    rows.zero_()  # the caller's tensor, not the kept rows
    assert set(embed._recent) == {9, 300, 41000, 77, 12, 5, 6, 7, 8}
    embed.qweight.rows = None  # a hit decodes nothing (a miss would fail here)
    try:
        assert torch.equal(embed(torch.tensor([300])), expected[0, 1][None])
        assert torch.equal(embed(torch.tensor([[41000, 9]])), expected[0, [3, 0]][None])
    finally:
        del embed.qweight.rows  # the method again
    many = torch.arange(embed._recent_max + 50)
    embed(many)
    assert len(embed._recent) == embed._recent_max and embed._recent_max + 49 in embed._recent
    assert 0 not in embed._recent  # the oldest went first
