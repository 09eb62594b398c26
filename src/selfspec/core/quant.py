"""Weights kept quantised: GGUF tensors in their stored form, products computed without dequantising.

A quantised GGUF (Q4_K_M is what most local users run) holds each weight as a small
integer code with a scale (and a minimum) per group of 16 or 32 weights.  Here such
a tensor becomes a :class:`QuantWeight` in one of two exact repacks (decoding gives
bit for bit what ``gguf.dequantize`` gives):

* ``q4``: 4-bit codes, groups of 32, fp32 scale and minimum per group (Q4_0, Q4_1, Q4_K);
* ``q8``: one byte per code, groups of 16 or 32, fp32 scale and optional minimum per
  group (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K; 2- to 6-bit codes take a byte each;
  IQ4_NL and IQ4_XS as the byte levels their 4-bit indices pick; IQ2_XXS, IQ2_XS, IQ2_S,
  IQ3_XXS, IQ3_S as their grid values times signs, ``GRID_TYPES``).

Under int8 activations products read an interleaved copy (:func:`pack_x16`, ``int8_kernels.c``) whose codes take
their own width (Q2_K's 2 bits, Q3_K's 3, Q5's 5, Q6_K's 6; IQ4's 4-bit indices, the levels looked up in the
kernels); the IQ2 / IQ3 types' copies hold a byte a code.

Other GGUF types (IQ1_S, IQ1_M, whose values are not integers times a scale, ...) have no
repack: the loader dequantises those tensors with a warning naming the type.

Products run in ``quant_kernels.c``, compiled once per machine with the system C
compiler (``-O3 -march=native``) into the cache folder and loaded with ctypes; its
threads are torch's own OpenMP pool.  Each output row is computed in the same order
whatever the number of rows in the call, so verifying ten drafted tokens gives each
the logits a one-token step would (greedy speculative decoding stays lossless).
The prompt's products take a kernel of their own (:func:`prefill_kernel`): by default a
blocked product of decoded weight panels (``prompt_gemm.c``, in the fused stack); on request
the one-token kernels themselves (rows of x in passes that fit the L1 cache), bf16 dot
products of exact activation splits (``prefill_gemm.c``), torch's BLAS on decoded fp32
tiles, or bfloat16 products.  All but the one-token kernels are not row-for-row equal to
one-token products, so only passes whose rows are never compared with one-token steps (the
prompt, which every method prefills alike) may take them.

``quantize_weight`` makes the same forms from an fp32 matrix for ``--quantize int8|int4``
on HF checkpoints (Q8_0-like symmetric int8, Q4_1-like asymmetric int4, groups of 32).

Run ``python -m selfspec.core.quant`` to build the library (``make install`` does).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SelfspecError
from ..io import cache_dir
from . import hugepages, kernels

SOURCE = Path(__file__).with_name("quant_kernels.c")
SOURCES = (SOURCE, Path(__file__).with_name("fused_decoder.c"),  # one library: the fused layers call the products
           Path(__file__).with_name("prefill_gemm.c"), Path(__file__).with_name("prompt_gemm.c"),
           Path(__file__).with_name("int8_kernels.c"), Path(__file__).with_name("gguf_repack.c"))  # fmt: skip
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
ISA_ENV = "SELFSPEC_ISA"  # native (default) | avxvnni | avx2 | portable: which x86 vector code the build may use
ISA_FLAGS = {"native": (), "avxvnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni"),
             "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}  # fmt: skip
PREFILL_ROWS = 65  # within bulk_rows(), calls with at least this many rows take the prompt kernel
PREFILL_KERNEL_ENV = "SELFSPEC_PREFILL_KERNEL"  # gemm | rows | split | tiles (see prefill_kernel)
PREFILL_KERNELS = ("rows", "gemm", "split", "tiles")
TILE_ELEMENTS = 1 << 21  # fp32 elements per decoded tile (8 MB)


class NativeUnavailable(SelfspecError):
    """The quantised kernels could not be built or loaded here (no C compiler, unsupported platform)."""


_BULK: ContextVar[bool] = ContextVar("selfspec_bulk_rows", default=False)


@contextlib.contextmanager
def bulk_rows() -> Iterator[None]:
    """Within this block, products of many rows may take the prompt's own kernel (prompt prefill only; see
    :func:`prefill_kernel` and :func:`prefill_dtype`)."""
    token = _BULK.set(True)
    try:
        yield
    finally:
        _BULK.reset(token)


_PREFILL_DTYPE: torch.dtype | None = None
PREFILL_DTYPE_ENV = "SELFSPEC_PREFILL_DTYPE"
PREFILL_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                  "bf16": torch.bfloat16}  # fmt: skip


def set_prefill_dtype(name: str) -> None:
    """Process-wide: the dtype the prompt's many-row products compute in (see :func:`prefill_dtype`)."""
    global _PREFILL_DTYPE
    key = str(name).strip().lower()
    if key not in PREFILL_DTYPES:
        raise SelfspecError(f"prefill dtype must be float32 or bfloat16, not {name!r}")
    _PREFILL_DTYPE = PREFILL_DTYPES[key]


def prefill_dtype() -> torch.dtype:
    """The dtype the prompt's many-row products compute in: float32 (default: the quantised model's outputs
    equal the dequantised model's within float rounding) or, on request (``--prefill-dtype bfloat16``,
    ``load(prefill_dtype=...)`` or ``SELFSPEC_PREFILL_DTYPE``), bfloat16: 4x faster products on CPUs with
    AVX512-BF16 or AMX, weights and activations rounded to 8 mantissa bits (greedy outputs then part from the
    fp32 model's after some dozens of tokens, README).  Only the prefill takes this path, which every method
    shares, so speculative decoding stays lossless either way."""
    if _PREFILL_DTYPE is None:
        set_prefill_dtype(os.environ.get(PREFILL_DTYPE_ENV, "").strip() or "float32")
    assert _PREFILL_DTYPE is not None
    return _PREFILL_DTYPE


def bfloat16_speedup() -> float:
    """How much faster torch multiplies a prefill-sized product in bfloat16 than in float32 here (measured)."""
    import time

    a, b = torch.randn(256, 512), torch.randn(1024, 512)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = a.to(dtype), b.to(dtype)
        torch.mm(x, w.T)  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            torch.mm(x, w.T)
        best[dtype] = time.perf_counter() - t0
    return best[torch.float32] / best[torch.bfloat16]


_ACTIVATIONS: str | None = None
ACTIVATIONS_ENV = "SELFSPEC_ACTIVATIONS"
ACTIVATION_MODES = ("auto", "int8", "float32")


def _mode_named(what: str, name: str, modes: tuple[str, ...], aliases: dict[str, str]) -> str:
    """``name`` as one of a process-wide setting's ``modes`` (case and spaces ignored, ``aliases`` mapped)."""
    key = str(name).strip().lower()
    key = aliases.get(key, key)
    if key not in modes:
        raise SelfspecError(f"{what} must be one of {', '.join(modes)}, not {name!r}")
    return key


@contextlib.contextmanager
def _setting_within(variable: str, setter, name: str) -> Iterator[None]:
    """Within this block, ``setter(name)``; the module's ``variable`` as it was afterwards."""
    old = globals()[variable]
    setter(name)
    try:
        yield
    finally:
        globals()[variable] = old


def set_activations(name: str) -> None:
    """Process-wide: how decoding products of quantised weights treat their activations (see
    :func:`int8_activations`); takes effect for models loaded afterwards."""
    global _ACTIVATIONS
    _ACTIVATIONS = _mode_named("activations", name, ACTIVATION_MODES, {"fp32": "float32"})


def activations(name: str) -> contextlib.AbstractContextManager[None]:
    """Within this block, :func:`set_activations` ``name`` (tests, and comparing the two modes in one process)."""
    return _setting_within("_ACTIVATIONS", set_activations, name)


_INT8_KIND: int | None = None  # selfspec_int8_kernels() of the loaded library; -1: no native library here
_INT8_NAMES = {1: "AVX512-VNNI", 2: "AVX2", 3: "AVX-VNNI", 4: "ARM sdot", 0: "portable C",
               -1: "none (no native kernels)"}  # fmt: skip


def _int8_kind() -> int:
    """Which code computes the int8-activation products (int8_kernels.c: ``selfspec_int8_kernels``), -1 where the
    native library cannot be built or loaded."""
    global _INT8_KIND
    if _INT8_KIND is None:
        try:
            _INT8_KIND = int(native().selfspec_int8_kernels())
        except NativeUnavailable:
            return -1
    return _INT8_KIND


def int8_kernels_available() -> bool:
    """Whether the int8-activation products run on hand-written vector instructions here (``int8_kernels.c``:
    AVX512-VNNI, AVX-VNNI, AVX2's vpmaddubsw or ARM's sdot; see :func:`int8_kernels_name`), not the portable
    loops."""
    return _int8_kind() > 0


def int8_kernels_prefetch() -> bool:
    """Whether the int8 products prefetch their weights in software (``selfspec_set_int8_prefetch`` has an effect):
    the x86 vector builds (AVX512-VNNI, AVX2, AVX-VNNI); ARM's sdot and the portable loops leave it to the CPU."""
    return _int8_kind() in (1, 2, 3)


def int8_kernels_name() -> str:
    """Which instructions compute the int8-activation products: "AVX512-VNNI", "AVX-VNNI", "AVX2", "ARM sdot" or
    "portable C"."""
    return _INT8_NAMES.get(_int8_kind(), "portable C")


def int8_activations() -> bool:
    """Whether products of quantised weights (outside the prompt's kernel) quantise their activations to int8,
    as llama.cpp's CPU kernels do: ``auto`` (default) wherever the native kernels are built (vector code on
    AVX512-VNNI, AVX-VNNI, AVX2 and ARM's sdot; the portable loops elsewhere, which still beat the float32 ones:
    SmolLM2's one-token step 19.5 against 168 ms in an x86 build without AVX2 or FMA), ``int8`` always,
    ``float32`` never (``--activations``, ``load(activations=...)`` or ``SELFSPEC_ACTIVATIONS``).  int8 products
    of 4-16 rows are 2-4x faster (one row: the same, bound by reading the weights; README "int8 activations") and
    move the model's logits by a few tenths of a percent, so greedy outputs can part from the fp32-activation
    ones; every method and vanilla decoding share the same products, so speculative decoding stays lossless
    either way."""
    if _ACTIVATIONS is None:
        set_activations(os.environ.get(ACTIVATIONS_ENV, "").strip() or "auto")
    if _ACTIVATIONS == "auto":
        return _int8_kind() >= 0
    return _ACTIVATIONS == "int8"


_KV_CACHE: str | None = None
KV_CACHE_ENV = "SELFSPEC_KV_CACHE"
KV_CACHE_MODES = ("auto", "f16", "f32", "q8_0")


def set_kv_cache(name: str) -> None:
    """Process-wide: how the fused stack stores keys and values (see :func:`kv_cache_dtype`); takes effect for
    caches made afterwards."""
    global _KV_CACHE
    _KV_CACHE = _mode_named("kv_cache", name, KV_CACHE_MODES, {"float16": "f16", "float32": "f32", "q8": "q8_0"})


def kv_cache(name: str) -> contextlib.AbstractContextManager[None]:
    """Within this block, :func:`set_kv_cache` ``name`` (tests, and comparing caches in one process)."""
    return _setting_within("_KV_CACHE", set_kv_cache, name)


def kv_cache_mode() -> str:
    """The setting of :func:`set_kv_cache` (``--kv-cache``, ``load(kv_cache=...)`` or ``SELFSPEC_KV_CACHE``)."""
    if _KV_CACHE is None:
        set_kv_cache(os.environ.get(KV_CACHE_ENV, "").strip() or "auto")
    return _KV_CACHE


def kv_cache_dtype() -> torch.dtype:
    """How the fused stack (:mod:`selfspec.core.fused`) stores keys and values.  ``auto`` (default): IEEE halves
    where products take int8 activations (the speed mode, as llama.cpp's default f16 cache: half the bytes a
    long context's attention reads, and a one-token step's attention is bound by reading them), float32 under
    ``float32`` activations (transformers' own numbers, which the fidelity checks compare with); ``f16``,
    ``f32``; ``q8_0``: 8-bit blocks (``torch.int8`` buffers, :data:`selfspec.core.cache.Q8`: 1.125 bytes a
    value, 56% of the halves' bytes, for long contexts and several sequences at once; the logits move by the
    codes' rounding).  A cache's dtype is fixed when it is made; vanilla decoding and every method share it, so
    speculative decoding stays lossless under each."""
    mode = kv_cache_mode()
    if mode == "auto":
        return kv_cache_auto_dtype()
    return {"f16": torch.float16, "f32": torch.float32, "q8_0": torch.int8}[mode]


def kv_cache_auto_dtype() -> torch.dtype:
    """What ``auto`` stores: halves under int8 activations, else float32 (see :func:`kv_cache_dtype`)."""
    return torch.float16 if int8_activations() else torch.float32


def split_products_available() -> bool:
    """Whether this CPU can run ``prefill_gemm.c`` (fp32 accuracy from bf16 dot products of exact pieces;
    AVX512-BF16)."""
    try:
        return bool(native().selfspec_prefill_available())
    except NativeUnavailable:
        return False


def prefill_kernel() -> str:
    """Which kernel computes the prompt's float32 products (``SELFSPEC_PREFILL_KERNEL``):

    * ``rows`` with int8 activations (the default where they are on): the prompt through the int8 row kernels
      of ``int8_kernels.c``, each prompt row computed as a one-token step computes it (SmolLM2 Q4_1 356 / 601
      tokens 170 / 390 ms against 272 / 495 with ``gemm``; Gemma 3 356 tokens 170 against 285);
    * ``gemm`` (default where the library has its AVX-512 build and activations are fp32): ``prompt_gemm.c``,
      a blocked product of
      weight panels decoded 32 output rows at a time and 8 rows of x, in the fused layer stack (about 83% of
      this CPU's FMA peak against 60% for the one-token kernels on 356 rows);
    * ``rows``: the decoding kernels themselves, their rows of x in passes that fit the L1 cache, the whole
      prompt through the fused layer stack: every prompt row is computed exactly as a one-token step computes it
      (SmolLM2 prefill of 100 / 356 / 1000 tokens 79 / 311 / 1186 ms against 107 / 368 / 1341 with ``split``);
    * ``split``: ``prefill_gemm.c``, bf16 dot products of exact 3-piece activation splits (AVX512-BF16);
    * ``tiles``: torch's fp32 GEMM on decoded weight tiles (default elsewhere).
    """
    name = os.environ.get(PREFILL_KERNEL_ENV, "").strip().lower()
    if not name:
        if int8_activations():
            return "rows"
        return "gemm" if _vector_kernels() else "tiles"
    if name not in PREFILL_KERNELS:
        raise SelfspecError(f"{PREFILL_KERNEL_ENV} must be one of {', '.join(PREFILL_KERNELS)}, not {name!r}")
    if name in ("gemm", "rows") and not _vector_kernels():
        raise SelfspecError(f"{PREFILL_KERNEL_ENV}={name} needs the kernels' AVX-512 build (this CPU has none)")
    if name == "split" and not split_products_available():
        raise SelfspecError(f"{PREFILL_KERNEL_ENV}=split needs a CPU with AVX512-BF16 (this one has none)")
    return name


def _vector_kernels() -> bool:
    try:
        return bool(native().selfspec_vector_kernels())
    except NativeUnavailable:
        return False


def prefill_has_own_kernel() -> bool:
    """Whether the prompt's products take a path of their own outside the fused stack (a bf16 prefill dtype, or
    the ``split`` or ``tiles`` kernel); if not, the prompt runs through the fused stack where there is one
    (with ``gemm``, its products of many rows in the blocked prompt kernel)."""
    return prefill_dtype() != torch.float32 or prefill_kernel() not in ("rows", "gemm")


def bulk_active() -> bool:
    """Whether the current pass is inside :func:`bulk_rows` (the prompt's prefill)."""
    return _BULK.get()


# -- the compiled library ---------------------------------------------------------------------------------------

_LIB: ctypes.CDLL | None = None
_LIB_LOCK = threading.Lock()


def isa() -> str:
    """``SELFSPEC_ISA``: ``native`` (every instruction this CPU has), or, on x86, ``avxvnni`` (the code a CPU with
    AVX-VNNI but no AVX-512 gets, client Intel from Alder Lake: int8 products by the 256-bit vpdpbusd; plain
    ``avx2`` where the CPU lacks AVX-VNNI), ``avx2`` (a CPU without either: vpmaddubsw) or ``portable`` (plain C),
    to run and test those paths here."""
    name = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if name not in ISA_FLAGS:
        raise SelfspecError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, not {name!r}")
    if name != "native" and platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        raise SelfspecError(f"{ISA_ENV}={name} narrows x86 builds; this machine is {platform.machine()}")
    return name


def build_flags() -> tuple[str, ...]:
    """The C compiler's flags for the kernels: :data:`CFLAGS` narrowed by :func:`isa`."""
    return CFLAGS + ISA_FLAGS[isa()]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def library_path() -> Path:
    """Where the library for this source, compiler and machine lives in the cache."""
    cc = _compiler() or "none"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(
        b"|".join([*(src.read_bytes() for src in SOURCES), " ".join(build_flags()).encode(), version.encode(),
                   _cpu_signature().encode()])  # fmt: skip
    ).hexdigest()[:16]
    return cache_dir("native", f"quant_kernels-{platform.machine()}-{key}.so")


def _cpu_signature() -> str:
    """The CPU model and flags (-march=native code must not run on another CPU sharing the cache)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def build(*, verbose: bool = False) -> Path:
    """Compile the kernels for this machine into the cache (once); return the library's path."""
    target = library_path()
    if target.is_file():
        return target
    cc = _compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler found (install gcc, or set CC) to build the quantised kernels")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [cc, *build_flags(), "-o", str(tmp), *map(str, SOURCES), "-lm"]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"could not run the C compiler {cc}: {exc}") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = (proc.stderr.strip().splitlines() or ["?"])[0][:300]
        raise NativeUnavailable(f"building the quantised kernels failed ({cc}): {first}")
    os.replace(tmp, target)
    return target


def native() -> ctypes.CDLL:
    """The loaded kernel library (built on first use)."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            try:
                lib = ctypes.CDLL(str(build()))
            except OSError as exc:
                raise NativeUnavailable(f"could not load the quantised kernels: {exc}") from None
            p, n = ctypes.c_void_p, ctypes.c_long
            lib.selfspec_linear_q4.argtypes = [n, n, n, p, p, p, p, p]
            lib.selfspec_linear_q8.argtypes = [n, n, n, n, p, p, p, p, p]
            lib.selfspec_rows_q4.argtypes = [n, p, n, p, p, p, p]
            lib.selfspec_rows_q8.argtypes = [n, p, n, n, p, p, p, p]
            lib.selfspec_rows_x16.argtypes = [n, p, n, n, ctypes.c_int, ctypes.c_int, p, p, p, p]
            lib.selfspec_rows_x16.restype = ctypes.c_int
            for f in (lib.selfspec_linear_q4, lib.selfspec_linear_q8, lib.selfspec_rows_q4, lib.selfspec_rows_q8):
                f.restype = None
            lib.selfspec_prompt_gemm.argtypes = [ctypes.c_int, n, n, n, n, p, p, p, p, p, p]
            lib.selfspec_prompt_gemm.restype = ctypes.c_int
            lib.selfspec_linear_x16.argtypes = [ctypes.c_int, n, n, n, n, p, p, p, p, p, p]
            lib.selfspec_repack_q4k.argtypes = [n, n, p, p, p, p]
            lib.selfspec_repack_q4k.restype = None
            lib.selfspec_repack_q6k.argtypes = [n, n, p, p, p]
            lib.selfspec_repack_q6k.restype = None
            lib.selfspec_repack_q80.argtypes = [n, n, p, p, p]
            lib.selfspec_repack_q80.restype = n
            lib.selfspec_repack_q50.argtypes = [n, n, p, p, p]
            lib.selfspec_repack_q50.restype = n
            lib.selfspec_repack_q5k.argtypes = [n, n, p, p, p, p]
            lib.selfspec_repack_q5k.restype = None
            lib.selfspec_linear_x16.restype = ctypes.c_int
            lib.selfspec_int8_kernels.restype = ctypes.c_int
            lib.selfspec_set_int8_prefetch.argtypes = [n]
            lib.selfspec_set_int8_prefetch.restype = None
            lib.selfspec_int8_prefetch.restype = n
            lib.selfspec_set_int8_prefetch_hint.argtypes = [ctypes.c_int]
            lib.selfspec_set_int8_prefetch_hint.restype = None
            lib.selfspec_int8_prefetch_hint.restype = ctypes.c_int
            lib.selfspec_set_int8_split.argtypes = [n]
            lib.selfspec_set_int8_split.restype = None
            lib.selfspec_int8_split.restype = n
            lib.selfspec_x16_interleave.argtypes = [n, n, p, p, ctypes.c_uint32]
            lib.selfspec_x16_interleave.restype = None
            lib.selfspec_low_bit_big.argtypes = [n, n, p, p]
            lib.selfspec_low_bit_big.restype = None
            lib.selfspec_low_bit_codes.argtypes = [n, n, p, p, p]
            lib.selfspec_low_bit_codes.restype = None
            lib.selfspec_set_pass_threads.argtypes = [ctypes.c_int]
            lib.selfspec_set_pass_threads.restype = None
            lib.selfspec_pass_threads.restype = ctypes.c_int
            lib.selfspec_rms_norm_rows.argtypes = [n, n, p, p, ctypes.c_float, ctypes.c_float, p]
            lib.selfspec_rms_norm_rows.restype = None
            lib.selfspec_move_slots.argtypes = [n, p, p, p, n, p, n, n, n]
            lib.selfspec_move_slots.restype = None
            lib.selfspec_prefill_available.restype = ctypes.c_int
            if lib.selfspec_prefill_available():
                lib.selfspec_prefill_split.argtypes = [n, n, n, p, p, p]
                lib.selfspec_prefill_split.restype = None
                lib.selfspec_prefill_gemm.argtypes = [n, n, n, n, ctypes.c_int, p, p, p, p, p, p]
                lib.selfspec_prefill_gemm.restype = ctypes.c_int
            _LIB = lib
    return _LIB


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# GGUF types whose codes the interleaved copy holds at their own width (int8_kernels.c's compact forms): type ->
# (bits, group, whether a minimum is stored).  The row form keeps them as a byte per code.  Q3_K's codes (-4..3)
# take 3 bits, Q2_K's (0..3) 2; IQ4's indices stay 4-bit, looked up in the kernels (LUT4: the levels as q8 codes).
LUT4 = 12  # int8_kernels.c's form of IQ4's 4-bit indices
COMPACT_TYPES = {"Q5_0": (5, 32, False), "Q5_1": (5, 32, True), "Q5_K": (5, 32, True), "Q6_K": (6, 16, False),
                 "Q3_K": (3, 16, False), "Q2_K": (2, 16, True), "IQ4_NL": (LUT4, 32, False),
                 "IQ4_XS": (LUT4, 32, False)}  # fmt: skip
COMPACT_BYTES = {2: 64, 3: 96, 5: 320, 6: 192, LUT4: 256}  # bytes of one group of 16 rows' codes in each form
CODE_BITS = {LUT4: 4}  # bits a code takes where the form's number is not that
COMPACT_ENV = "SELFSPEC_COMPACT_CODES"  # 0: these types' codes take a byte each in the interleaved copy too (A/B)
_COMPACT = os.environ.get(COMPACT_ENV, "1").strip() != "0"


# GGUF types whose scales (and minima) are IEEE halves in the file: their interleaved copies keep them so (exactly)
HALF_SCALE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")
X16_SCALE16 = 0x100  # int8_kernels.c: a product's form = bits per code | this flag for half scales
# The K-quants' scales are small integers times a half per 256 weights: their interleaved copies keep that form
# (int8_kernels.c's X16_SUB8: a signed byte per group, a half per 256 weights; exact), 1.1-1.25 bytes a scale
SUB_SCALE_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")
X16_SUB8 = 0x200
SUB_SCALES_ENV = "SELFSPEC_SUB_SCALES"  # 0: the K-quants' copies hold fp32 scales (A/B)
_SUB_SCALES = os.environ.get(SUB_SCALES_ENV, "1").strip() != "0"


def compact_codes() -> bool:
    """Whether the codes of ``COMPACT_TYPES`` take their own width in the interleaved copy (default; see
    COMPACT_ENV)."""
    return _COMPACT


def sub_scales() -> bool:
    """Whether the K-quants' interleaved copies keep their scales as sub-scales (default; see SUB_SCALES_ENV)."""
    return _SUB_SCALES


def x16_bits(fmt: str, source: str, group: int, minima: bool) -> int:
    """The interleaved copy's form of a weight of this form: 4 (q4), 2, 3, 5, 6 or LUT4 (a q8 weight from a GGUF
    type of ``COMPACT_TYPES``), else 8 (a byte per code)."""
    if fmt == "q4":
        return 4
    spec = COMPACT_TYPES.get(source) if _COMPACT else None
    return spec[0] if spec is not None and spec[1:] == (group, minima) else 8


# -- the weight ---------------------------------------------------------------------------------------------------


@dataclass
class QuantWeight:
    """A weight ``[out, in]`` in one of the two repacked forms (see the module docstring).  Under int8
    activations a weight only ever multiplied (a decoder layer's) may hold its interleaved copy alone
    (:meth:`release_rows`); ``codes``, ``scale`` and ``minv`` then rebuild the row form when something reads it."""

    fmt: str  # "q4" | "q8"
    out_features: int
    in_features: int
    group: int  # weights per scale: 32 (q4, q8) or 16 (q8 from Q6_K)
    _codes: torch.Tensor | None  # q4: uint8 [out, in/2]; q8: int8 [out, in]
    _scale: torch.Tensor | None  # fp32 [out, in/group]
    _minv: torch.Tensor | None  # fp32 [out, in/group] (q8: None when every minimum is 0)
    source: str  # the GGUF type (or "int8"/"int4") it came from
    symmetric: bool = False  # q4 only: every minimum is -8 * scale, and the interleaved copy stores none

    def __post_init__(self) -> None:
        if self.in_features % 32:
            raise SelfspecError(f"quantised rows must hold a multiple of 32 weights, not {self.in_features}")
        if self.fmt == "q4" and self._minv is None and self._scale is not None:
            self._minv = torch.zeros_like(self._scale)
        self._released = False

    @classmethod
    def from_x16(cls, fmt: str, out_features: int, in_features: int, group: int,
                 packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], source: str,
                 bits: int) -> QuantWeight:  # fmt: skip
        """A weight held as its interleaved copy alone (``bits`` per code), as after :meth:`release_rows` (see
        :func:`from_gguf`)."""
        w = cls(fmt, out_features, in_features, group, None, None, None, source)
        w.__dict__["_x16"] = packed
        w.__dict__["_x16_bits"] = bits
        w._released = True
        return w

    @property
    def codes(self) -> torch.Tensor:
        self.restore_rows()
        return self._codes

    @property
    def scale(self) -> torch.Tensor:
        self.restore_rows()
        return self._scale

    @property
    def minv(self) -> torch.Tensor | None:
        self.restore_rows()
        return self._minv

    @property
    def device(self) -> torch.device:
        """Where the weight's tensors live (without rebuilding a released row form)."""
        held = self._codes if self._codes is not None else self.__dict__["_x16"][0]
        return held.device

    @property
    def rows_released(self) -> bool:
        return self._released

    def release_rows(self) -> bool:
        """Drop the row form when the interleaved copy holds the weight exactly (q4, the compact forms of
        ``COMPACT_TYPES``, and 8-bit codes without minima, whose stored minimum -128 * scale would lose bits);
        returns whether it was dropped."""
        packed = self.x16()
        if packed is None or (self.x16_bits == 8 and self._minv is not None):
            return False
        self._codes = self._scale = self._minv = None
        self.__dict__.pop("_sub", None)  # (the copy holds it)
        self._released = True
        self.__dict__.pop("_bound", None)  # pointers into the row form
        return True

    def row_pointers(self) -> tuple[int | None, int | None, int | None]:
        """Addresses of the row form (codes, scale, minimum), None where absent or released; never rebuilds it."""
        return _ptr(self._codes), _ptr(self._scale), _ptr(self._minv)

    def restore_rows(self) -> None:
        """Rebuild the row form from the interleaved copy (the inverse of :func:`pack_x16`) if it was dropped."""
        if not self._released:
            return
        codes, scale, minv = self.__dict__["_x16"]
        n, k, g = self.out_features, self.in_features, self.group
        groups, j = k // g, (4 if self.fmt == "q4" else g // 4)
        if self.x16_bits in COMPACT_BYTES:
            every = np.arange(n)
            self._codes = torch.from_numpy(_compact_rows(codes.numpy(), self.x16_bits, groups, every // 16,
                                                         every % 16, self.has_minima).reshape(n, k))  # fmt: skip
        else:
            raw = np.ascontiguousarray(codes.numpy().reshape(n // 16, groups, j, 16, 4).transpose(0, 3, 1, 2, 4))
            if self.fmt == "q4":
                self._codes = torch.from_numpy(raw.reshape(n, k // 2))
            else:
                self._codes = torch.from_numpy((raw ^ np.uint8(0x80)).view(np.int8).reshape(n, k))

        def unpack(t: torch.Tensor) -> torch.Tensor:  # (half scales and sub-scales widen exactly)
            table = _x16_table(t, groups, g, k)
            return torch.from_numpy(np.ascontiguousarray(table.transpose(0, 2, 1)).reshape(n, groups))

        self._scale = unpack(scale)
        self._minv = None if minv is None else unpack(minv)
        if self.fmt == "q4" and self._minv is None:  # symmetric: -8 d, as the kernels compute it
            self._minv = self._scale * np.float32(-8)
        self._released = False

    @property
    def nbytes(self) -> int:
        """Bytes held: the row form, and the interleaved copy for int8 products once it exists."""
        parts = [self._codes, self._scale, self._minv, *(self.__dict__.get("_x16") or ())]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def step_bytes(self) -> int:
        """Bytes a product reads: one form of the weight (under int8 activations the interleaved copy, whose codes
        of ``COMPACT_TYPES`` take their own width; else the row form; a symmetric weight's copy has no minima
        either)."""
        packed = self.__dict__.get("_x16")
        if packed is not None and int8_activations():  # the copy as made (half scales where exact)
            return sum(t.numel() * t.element_size() for t in packed if t is not None)
        groups = self.out_features * (self.in_features // self.group)
        bits = self.x16_bits if int8_activations() and self.out_features % 16 == 0 else (4 if self.fmt == "q4" else 8)
        codes = self.out_features * self.in_features * CODE_BITS.get(bits, bits) // 8
        half = int8_activations() and _half_scales(self, bits, not self.has_minima)  # (as pack_x16 will hold it)
        per = 2 if half else 4
        if int8_activations() and self.__dict__.get("_sub") is not None and _sub_scale_form(self, bits):
            per = 1 + 2 * self.group / 256  # a byte per group, a half per 256 weights
        return codes + int(per * groups) * (2 if self.has_minima else 1)

    @property
    def has_minima(self) -> bool:
        """Whether the weight stores a minimum per group (q4 unless symmetric; q8 when not symmetric)."""
        if self.fmt == "q4":
            return not self.symmetric
        if self._released:  # only a compact copy keeps minima exactly
            return self.__dict__["_x16"][2] is not None
        return self._minv is not None

    @property
    def x16_bits(self) -> int:
        """Bits per code in the interleaved copy (see :func:`x16_bits`; fixed once the copy is made)."""
        bits = self.__dict__.get("_x16_bits")
        if bits is None:
            minima = self._minv is not None and not (self.fmt == "q4" and self.symmetric)
            bits = x16_bits(self.fmt, self.source, self.group, minima)
        return bits

    @property
    def x16_code_bits(self) -> int:
        """Bits one code takes in the interleaved copy (IQ4's form, LUT4: 4)."""
        return CODE_BITS.get(self.x16_bits, self.x16_bits)

    @property
    def x16_form(self) -> int:
        """The interleaved copy's form for the kernels: bits per code, | X16_SCALE16 where its scales are halves,
        | X16_SUB8 where they are a K-quant's sub-scales."""
        packed = self.x16()
        kind = None if packed is None else packed[1].dtype
        return self.x16_bits | {torch.float16: X16_SCALE16, torch.uint8: X16_SUB8}.get(kind, 0)

    @property
    def form_label(self) -> str:
        """The form products read, for reports: ``q8/32`` (row form), or under int8 activations the interleaved
        copy's bits per code with ``h`` for half scales (``q5h/32``: Q5_0's compact codes and half scales)."""
        if not (int8_activations() and self.x16() is not None):
            return f"{self.fmt}/{self.group}"
        form = self.x16_form
        kind = "h" if form & X16_SCALE16 else "k" if form & X16_SUB8 else ""
        return f"{'iq4' if self.x16_bits == LUT4 else f'q{self.x16_bits}'}{kind}/{self.group}"

    def x16(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The interleaved copy ``int8_kernels.c`` multiplies (codes, scale, minimum), made on first use; None
        when the rows are not a multiple of 16."""
        if self.out_features % 16:
            return None
        packed = self.__dict__.get("_x16")
        if packed is None:
            self.__dict__["_x16_bits"] = self.x16_bits
            packed = self.__dict__["_x16"] = pack_x16(self, lasting=not hugepages.temporary())
        return packed

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in] @ W.T`` in fp32 (``x`` fp32, contiguous)."""
        rows = x.shape[0]
        if rows >= PREFILL_ROWS and _BULK.get():
            return self._tiled(x)
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        self.product_into(rows, x.data_ptr(), y.data_ptr())
        return y

    def product_into(self, rows: int, x_ptr: int, y_ptr: int) -> None:
        """The kernel call on raw pointers (``x`` [rows, in], ``y`` [rows, out], fp32, contiguous); the constant
        arguments are bound once, since a decoding step makes a few hundred of these calls."""
        int8 = int8_activations()
        bound = self.__dict__.get("_bound")
        if bound is None or bound[0] != int8:
            lib, packed = native(), self.x16() if int8 else None
            shape = (self.out_features, self.in_features)
            if packed is not None:  # int8 activations: (bits, T, N, K, G, x, codes, scale, min, bias, y)
                fn, head = lib.selfspec_linear_x16, (self.x16_form,)
                shape, weights = (*shape, self.group), (*map(_ptr, packed), None)
            else:
                fn, head = (lib.selfspec_linear_q4 if self.fmt == "q4" else lib.selfspec_linear_q8), ()
                shape = shape if self.fmt == "q4" else (*shape, self.group)
                weights = (self.codes.data_ptr(), self.scale.data_ptr(), _ptr(self.minv))
            bound = self.__dict__["_bound"] = (int8, fn, head, shape, weights)
        _, fn, head, shape, weights = bound
        if fn(*head, rows, *shape, x_ptr, *weights, y_ptr) and head:
            raise MemoryError("no memory to quantise the activations of a product")

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        dtype = prefill_dtype()
        kernel = prefill_kernel() if dtype == torch.float32 else "tiles"
        if kernel == "rows":
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            self.product_into(x.shape[0], x.data_ptr(), y.data_ptr())
            return y
        if kernel == "gemm":
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            bits = 4 if self.fmt == "q4" else 8
            status = native().selfspec_prompt_gemm(bits, x.shape[0], self.out_features, self.in_features, self.group,
                                                   x.data_ptr(), self.codes.data_ptr(), self.scale.data_ptr(),
                                                   _ptr(self.minv), None, y.data_ptr())  # fmt: skip
            if status != 0:
                raise MemoryError("no memory for the prompt kernel's weight panels")
            return y
        if kernel == "split" and self.out_features % 32 == 0:
            return self._split_product(x)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        step = max(64, TILE_ELEMENTS // self.in_features)
        xs = x.to(dtype)
        for n0 in range(0, self.out_features, step):
            idx = torch.arange(n0, min(n0 + step, self.out_features))
            tile = self.rows(idx).to(dtype)
            if dtype == torch.float32:
                torch.mm(xs, tile.T, out=y[:, n0 : n0 + len(idx)])
            else:
                y[:, n0 : n0 + len(idx)] = torch.mm(xs, tile.T)
        return y

    def _split_product(self, x: torch.Tensor) -> torch.Tensor:
        """The prompt's product at fp32 accuracy from bf16 dot products of exact pieces (``prefill_gemm.c``)."""
        lib, rows = native(), x.shape[0]
        pieces = torch.empty(rows, 3 * self.in_features, dtype=torch.int16)
        sums = None if self.minv is None else torch.empty(rows, self.in_features // self.group)
        lib.selfspec_prefill_split(rows, self.in_features, self.group, x.data_ptr(), pieces.data_ptr(), _ptr(sums))
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = lib.selfspec_prefill_gemm(rows, self.out_features, self.in_features, self.group, self.fmt == "q4",
                                           pieces.data_ptr(), _ptr(sums), self.codes.data_ptr(),
                                           self.scale.data_ptr(), _ptr(self.minv), y.data_ptr())  # fmt: skip
        if status != 0:
            raise MemoryError("no memory for the prefill kernel's weight blocks")
        return y

    def row_slices(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The row form's (codes, scale, minimum) of the rows ``idx`` (int64, in range), read from the interleaved
        copy where the row form was released (a tied embedding table: token lookups, the draft vocabulary)."""
        if not self._released:
            return self._codes[idx], self._scale[idx], None if self._minv is None else self._minv[idx]
        codes, scale, minv = self.__dict__["_x16"]
        groups, n = self.in_features // self.group, idx.numpy()
        j = 4 if self.fmt == "q4" else self.group // 4
        block, r = n // 16, n % 16
        if self.x16_bits in COMPACT_BYTES:
            raw = _compact_rows(codes.numpy(), self.x16_bits, groups, block, r, minv is not None).reshape(len(n), -1)
        else:
            raw = codes.numpy().reshape(self.out_features // 16, groups, j, 16, 4)[block, :, :, r, :]
            raw = raw.reshape(len(n), -1)
            if self.fmt == "q8":
                raw = (raw ^ np.uint8(0x80)).view(np.int8)
        pick = lambda t: torch.from_numpy(_x16_table_rows(t, groups, self.group, self.in_features,  # noqa: E731
                                                          block, r))
        if minv is None and self.fmt == "q4":  # symmetric: -8 d
            return torch.from_numpy(raw), pick(scale), pick(scale) * np.float32(-8)
        return torch.from_numpy(raw), pick(scale), None if minv is None else pick(minv)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The rows ``idx`` of W, decoded to fp32 ``[len(idx), in]``."""
        idx = idx.reshape(-1).to(torch.int64).contiguous()
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.out_features):
            raise IndexError(f"row index out of range for a weight of {self.out_features} rows")
        out = torch.empty(len(idx), self.in_features, dtype=torch.float32)
        lib = native()
        if self._released and self.x16_bits in (4, 5, 6, 8):  # nibble, byte, compact codes: decoded in place
            codes, scale, minv = self.__dict__["_x16"]
            sk = 2 if scale.dtype == torch.uint8 else 1 if scale.dtype == torch.float16 else 0
            if lib.selfspec_rows_x16(len(idx), idx.data_ptr(), self.in_features, self.group, self.x16_bits, sk,
                                     codes.data_ptr(), scale.data_ptr(), _ptr(minv), out.data_ptr()) == 0:
                return out  # (-1: no scratch memory; -2: a form the native code leaves to the gathered rows below)
        if self._released:  # decode the gathered rows as rows 0..R-1 of their own table
            codes, scale, minv = self.row_slices(idx)
            idx = torch.arange(len(idx))
        else:
            codes, scale, minv = self._codes, self._scale, self._minv
        if self.fmt == "q4":
            lib.selfspec_rows_q4(len(idx), idx.data_ptr(), self.in_features, codes.data_ptr(), scale.data_ptr(),
                                 _ptr(minv), out.data_ptr())  # fmt: skip
        else:
            lib.selfspec_rows_q8(len(idx), idx.data_ptr(), self.in_features, self.group, codes.data_ptr(),
                                 scale.data_ptr(), _ptr(minv), out.data_ptr())  # fmt: skip
        return out

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def permute_rows(self, perm: np.ndarray) -> QuantWeight:
        """The same weight with its output rows reordered (``new[i] = old[perm[i]]``)."""
        p = torch.from_numpy(np.ascontiguousarray(perm, dtype=np.int64))
        w = QuantWeight(self.fmt, self.out_features, self.in_features, self.group, self.codes[p].contiguous(),
                        self.scale[p].contiguous(), None if self.minv is None else self.minv[p].contiguous(),
                        self.source, self.symmetric)  # fmt: skip
        sub = self.__dict__.get("_sub")
        if sub is not None:
            w.__dict__["_sub"] = tuple(None if a is None else np.ascontiguousarray(a[perm]) for a in sub)
        return w


def pack_x16(w: QuantWeight, lasting: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``w`` interleaved 16 output rows at a time for ``int8_kernels.c`` (layout in that file's header): codes
    ``uint8 [out/16, groups, group/4, 16, 4]`` (q4: the form's own bytes reordered; q8: code + 128), scale and
    minimum ``fp32 [out/16, groups, 16]`` (q8: minimum - 128 * scale; None for a q8 weight without minima,
    whose -128 * scale the kernel computes).  ``lasting``: the copy a model keeps (its tables on 2 MB pages where
    the system gives them, :mod:`selfspec.core.hugepages`), not a temporary piece of one."""
    n, k, g = w.out_features, w.in_features, w.group
    place = hugepages.lasting if lasting else np.ascontiguousarray
    groups = k // g
    j = 4 if w.fmt == "q4" else g // 4
    bits = w.x16_bits
    raw = w.codes.numpy().view(np.uint8).reshape(n // 16, 16, groups, j, 4)
    compact = bits in COMPACT_BYTES
    codes = (hugepages.empty if lasting else np.empty)(
        (n // 16, groups, COMPACT_BYTES[bits]) if compact else (n // 16, groups, j, 16, 4), np.uint8)
    # a few MB of rows at a time: the copy of a 150k-row head (130 MB) never holds a whole temporary beside it
    step = max(1, (4 << 20) // max(1, 16 * groups * j * 4))
    try:
        lib = None if compact else native()
    except NativeUnavailable:
        lib = None
    for b in range(0, n // 16, step):
        if compact:
            codes[b : b + step] = _compact_blocks(raw[b : b + step].view(np.int8), bits, w.minv is not None)
            continue
        block = raw[b : b + step]
        if lib is not None:  # a row's 4 bytes of a word move together, in one native pass
            src, dst = np.ascontiguousarray(block), codes[b : b + step]
            lib.selfspec_x16_interleave(len(src), groups * j, src.ctypes.data, dst.ctypes.data,
                                        0 if w.fmt == "q4" else 0x80808080)  # fmt: skip
            continue
        codes[b : b + step] = (block if w.fmt == "q4" else block ^ np.uint8(0x80)).transpose(0, 2, 3, 1, 4)
    scale = w.scale.numpy().reshape(n // 16, 16, groups)
    sym = w.minv is None or (w.fmt == "q4" and w.symmetric)  # symmetric: the kernel computes -2^(bits-1) * scale
    minv = None if sym else w.minv.numpy().reshape(n // 16, 16, groups)
    if minv is not None and bits == 8:
        minv = minv - np.float32(128) * scale
    sub = w.__dict__.get("_sub")
    if sub is not None and _sub_scale_form(w, bits):
        return torch.from_numpy(codes.reshape(-1)), _sub_table(sub[0], sub[1], g, place), (
            None if sym else _sub_table(sub[2], sub[3], g, place))  # fmt: skip
    tables = [t for t in (scale, minv) if t is not None]
    dtype = np.float16 if _half_scales(w, bits, sym) and all(_halves_exact(t) for t in tables) else np.float32
    scale_out, minv_out = (None if t is None else torch.from_numpy(place(t.transpose(0, 2, 1).astype(dtype, order="C")))
                           for t in (scale, minv))  # fmt: skip
    return torch.from_numpy(codes.reshape(-1)), scale_out, minv_out


def _half_scales(w: QuantWeight, bits: int, sym: bool) -> bool:
    """Whether the interleaved copy of ``w`` may keep its scales as halves: a type that stores them so (or a 4-bit
    draft copy, whose scales are rounded to halves), in a form the kernels take them for."""
    kind = w.source in HALF_SCALE_TYPES or (w.fmt == "q4" and w.symmetric and w.source.endswith("->q4"))
    return kind and bits in (4, 5, 8, LUT4) and (sym or bits != 8)


def _sub_scale_form(w: QuantWeight, bits: int) -> bool:
    """Whether the interleaved copy of ``w`` may hold its scales as sub-scales (X16_SUB8): a K-quant (or IQ4_XS)
    whose copy's codes take their own width (not the byte form), rows of whole 256-weight blocks."""
    return _SUB_SCALES and w.source in SUB_SCALE_TYPES and bits in (2, 3, 4, 5, 6, LUT4) and w.in_features % 256 == 0


def _sub_table(small: np.ndarray, halves: np.ndarray, group: int, place=np.ascontiguousarray) -> torch.Tensor:
    """A K-quant's scales (or minima) as the kernels' sub-scale table, ``uint8 [out/16, groups * 16 + K/256 * 32]``:
    per block of 16 rows the signed bytes ``[groups][16]``, then the halves ``[K/256][16]`` (int8_kernels.c)."""
    n, groups = small.shape
    per = small.reshape(n // 16, 16, groups).transpose(0, 2, 1).reshape(n // 16, -1).view(np.uint8)
    wide = halves.reshape(n // 16, 16, -1).transpose(0, 2, 1).astype(np.float16).reshape(n // 16, -1).view(np.uint8)
    return torch.from_numpy(place(np.concatenate([per, wide], axis=1)))


def _x16_table(t: torch.Tensor, groups: int, group: int, in_features: int) -> np.ndarray:
    """An interleaved copy's table of scales or minima (fp32, halves or sub-scales) as fp32 ``[out/16, groups,
    16]``, exactly (a sub-scale's byte times its half is exact in fp32)."""
    a = t.numpy()
    if a.dtype != np.uint8:
        return a.astype(np.float32)
    blocks = a.shape[0]
    small = a[:, : groups * 16].view(np.int8).reshape(blocks, groups, 16).astype(np.float32)
    halves = a[:, groups * 16 :].copy().view(np.float16).reshape(blocks, in_features // 256, 16).astype(np.float32)
    return small * np.repeat(halves, 256 // group, axis=1)


def _x16_table_rows(t: torch.Tensor, groups: int, group: int, in_features: int, block: np.ndarray,
                    r: np.ndarray) -> np.ndarray:  # fmt: skip
    """The rows (block ``block``, row ``r`` within it) of an interleaved copy's table as fp32 ``[rows, groups]``
    (what :func:`_x16_table` holds for them, without decoding whole blocks)."""
    a = t.numpy()
    if a.dtype != np.uint8:
        return a[block, :, r].astype(np.float32)
    at = np.arange(groups) * 16
    small = a.view(np.int8)[block[:, None], at[None, :] + r[:, None]].astype(np.float32)
    super_of = groups * 16 + np.arange(groups) * group // 256 * 32  # each group's half: its 256 weights', row r
    lo = a[block[:, None], super_of[None, :] + 2 * r[:, None]].astype(np.uint16)
    hi = a[block[:, None], super_of[None, :] + 2 * r[:, None] + 1].astype(np.uint16)
    return small * (lo | hi << 8).view(np.float16).astype(np.float32)


def _halves_exact(t: np.ndarray) -> bool:
    """Whether every value of ``t`` (fp32) is an IEEE half exactly."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(t.astype(np.float16).astype(np.float32), t))


def _compact_blocks(code: np.ndarray, bits: int, minima: bool) -> np.ndarray:
    """Row-form codes (int8 ``[blocks, 16, groups, G]``) of a type of ``COMPACT_TYPES`` -> the compact copy's bytes
    ``[blocks, groups, COMPACT_BYTES[bits]]`` (int8_kernels.c's header): the low nibbles as q4 bytes, then (5 and 6
    bits) the high bits; LUT4: IQ4's indices of the levels as nibbles; 2 and 3 bits: :func:`_low_bit_blocks`."""
    shape = (code.shape[0], 16, code.shape[2], -1)
    if bits == LUT4:
        u = _IQ4_INDEX[code.astype(np.int16).reshape(shape) + 128]
        out_of_range = u.min(initial=0) < 0 or u.max(initial=0) >= 1 << CODE_BITS[bits]
    else:  # offset in bytes, wrapping: a code below its range lands at 128 or more, one above it at 2^bits or more,
        u = code.view(np.uint8).reshape(shape) + np.uint8(0 if minima else 1 << (bits - 1))  # so one max checks both
        out_of_range = u.max(initial=0) >= 1 << bits
    if out_of_range:
        raise SelfspecError(f"codes out of the range of their type's {bits}-bit form")
    u = u.astype(np.uint8, copy=False)
    if bits in (2, 3):
        return _low_bit_blocks(u, bits)
    half = u.shape[-1] // 2  # G 32: k and k + 16 share a byte; G 16: k and k + 8
    nib = (u[..., :half] & 15) | ((u[..., half:] & 15) << 4)  # [b, 16, groups, half]: byte 4j + i
    nib = nib.reshape(*nib.shape[:3], half // 4, 4).transpose(0, 2, 3, 1, 4)  # [b, groups, j, 16, 4]
    if bits == LUT4:  # nibbles alone
        return nib.reshape(*nib.shape[:2], -1)
    per = bits - 4  # high bits per code
    high = (u >> 4).reshape(*u.shape[:3], -1, 4)  # [b, 16, groups, word j, i]
    hb = high[:, :, :, 0].copy()  # word j's codes' high bits at bits per * j ([b, 16, groups, 4]); the ORs one
    for j in range(1, high.shape[3]):  # word at a time: np.bitwise_or.reduce along the axis took 1 s of a 6 s load
        hb |= high[:, :, :, j] << np.uint8(per * j)
    hb = hb.transpose(0, 2, 1, 3)  # [b, groups, 16, 4]
    return np.concatenate([nib.reshape(*nib.shape[:2], -1), hb.reshape(*hb.shape[:2], -1)], axis=2)


def _low_bit_blocks(u: np.ndarray, bits: int) -> np.ndarray:
    """2- or 3-bit codes ``u`` (uint8 ``[b, 16, groups, 16]``, already offset) -> their groups' bytes ``[b, groups,
    64 | 96]``: byte 4r + i holds the low two bits of code 4j + i in bits 2j, 2j + 1; for 3 bits 32 bytes more,
    byte 4 (r mod 8) + i holding bit 2 of code 4j + i of row r in bit j + 4 (r div 8) (int8_kernels.c's header)."""
    w = u.reshape(*u.shape[:3], 4, 4)  # [b, r, groups, j, i]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
    low = np.bitwise_or.reduce((w & 3) << shifts, axis=3).transpose(0, 2, 1, 3)  # [b, groups, r, i]
    low = low.reshape(*low.shape[:2], 64)
    if bits == 2:
        return low
    third = ((w >> 2) & 1).transpose(0, 2, 1, 3, 4)  # [b, groups, r, j, i]
    at = (np.arange(4, dtype=np.uint8)[:, None] + 4 * (np.arange(16, dtype=np.uint8) // 8)[None, :])  # [j, r]
    bit = third << at.T.reshape(1, 1, 16, 4, 1)  # bit j + 4 (r div 8)
    high = np.bitwise_or.reduce(bit, axis=3)  # [b, groups, r, i]
    high = high[:, :, :8] | high[:, :, 8:]  # rows r and r + 8 share a byte
    return np.concatenate([low, high.reshape(*high.shape[:2], 32)], axis=2)


def _compact_rows(packed: np.ndarray, bits: int, groups: int, block: np.ndarray, r: np.ndarray,
                  minima: bool) -> np.ndarray:  # fmt: skip
    """Rows (block ``block``, row ``r`` within it) of a compact copy (flat bytes) decoded to row-form int8 codes
    ``[rows, groups, G]`` (the inverse of :func:`_compact_blocks`)."""
    size = COMPACT_BYTES[bits]
    g = packed.reshape(-1, groups, size)
    if bits in (2, 3):
        low = g[:, :, :64].reshape(g.shape[0], groups, 16, 4)[block, :, r, :]  # [rows, groups, i]
        u = (low[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3  # [.., j, i]
        if bits == 3:
            high = g[:, :, 64:].reshape(g.shape[0], groups, 8, 4)[block, :, r % 8, :]  # [rows, groups, i]
            at = (np.arange(4, dtype=np.uint8)[None, :] + (4 * (r // 8)).astype(np.uint8)[:, None])  # [rows, j]
            u = u | (((high[:, :, None, :] >> at[:, None, :, None]) & 1) << 2)
        u = u.reshape(len(block), groups, 16)
        return (u.astype(np.int16) - (0 if minima else 4)).astype(np.int8)
    nib_bytes = size if bits in CODE_BITS else size - 64
    nib = g[:, :, :nib_bytes].reshape(g.shape[0], groups, nib_bytes // 64, 16, 4)[block, :, :, r, :]
    nib = nib.reshape(len(block), groups, -1)  # byte 4j + i
    u = np.concatenate([nib & 15, nib >> 4], axis=2)  # code k = 4j + i at k
    if bits == LUT4:
        return IQ4_LEVELS[u]
    hb = g[:, :, nib_bytes:].reshape(g.shape[0], groups, 16, 4)[block, :, r, :]  # [rows, groups, 4]
    per, words = bits - 4, u.shape[2] // 4
    shifts = (per * np.arange(words, dtype=np.uint8)).reshape(1, 1, -1, 1)
    high = (hb[:, :, None, :] >> shifts) & ((1 << per) - 1)  # [rows, groups, word j, i]
    u = u | (high.reshape(len(block), groups, -1) << 4)
    return (u.astype(np.int16) - (0 if minima else 1 << (bits - 1))).astype(np.int8)


# -- GGUF blocks -> repacked forms ----------------------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 ``[..., 32]`` per group -> 16 bytes per group, byte j = q[j] | q[j + 16] << 4."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes (low nibbles then high nibbles), the Q4_0/Q5_0 element order."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (little-endian u32, bit j for element j) -> 32 bits ([n, 32] uint8; byte j // 8's bit j % 8)."""
    return np.unpackbits(np.ascontiguousarray(qh).reshape(-1, 4), axis=-1, bitorder="little")


def k_sub_scales(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """A K-quant's scales as they are stored, per 256-weight block: (signed bytes [blocks, groups], half [blocks],
    and for the types with minima the minima's bytes and their half negated), with scale = half * byte and minimum
    = negated half * byte exactly as :func:`_repack` computes them; None for other types."""
    if kind in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        d, dmin = blocks[:, :2].copy().view(np.float16), blocks[:, 2:4].copy().view(np.float16)
        return sc.astype(np.int8).reshape(len(blocks), 8), d.reshape(-1), m.astype(np.int8).reshape(len(blocks), 8), \
            -dmin.reshape(-1)  # fmt: skip
    if kind == "Q6_K":
        sc, d = blocks[:, 192:208].copy().view(np.int8), blocks[:, 208:210].copy().view(np.float16).reshape(-1)
        return sc, d, None, None
    if kind == "Q3_K":  # sixteen 6-bit scales, low nibbles in bytes 96-103, high pairs in 104-107, minus 32
        nb, raw = len(blocks), blocks[:, 96:108]
        low = (raw[:, :8].reshape(nb, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(nb, 16) & 15
        high = (raw[:, 8:].reshape(nb, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(nb, 16)
        sc = ((low | ((high & 3) << 4)).astype(np.int16) - 32).astype(np.int8)
        return sc, blocks[:, 108:110].copy().view(np.float16).reshape(-1), None, None
    if kind == "Q2_K":  # a byte per 16 weights: the scale's 4 bits low, the minimum's high; then d and dmin
        sc, m = (blocks[:, :16] & 15).astype(np.int8), (blocks[:, :16] >> 4).astype(np.int8)
        d, dmin = blocks[:, 80:82].copy().view(np.float16), blocks[:, 82:84].copy().view(np.float16)
        return sc, d.reshape(-1), m, -dmin.reshape(-1)
    if kind == "IQ4_XS":  # eight 6-bit scales: the high two bits of each in a little-endian u16, the low nibbles
        nb = len(blocks)  # in 4 bytes, minus 32
        high = (blocks[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [nb, 8]
        low = (blocks[:, 4:8].reshape(nb, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(nb, 8)
        sc = (((low & 15) | (high.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8)
        return sc, blocks[:, :2].copy().view(np.float16).reshape(-1), None, None
    return None


def _sub_products(sub: tuple) -> tuple[np.ndarray, np.ndarray | None]:
    """The fp32 scales and minima (None without) of :func:`k_sub_scales`' stored form: half * byte, negated half *
    byte, exactly (at most 11 + 8 significant bits)."""
    sc, d, m, neg_dmin = sub
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    return scale, None if m is None else neg_dmin.astype(np.float32)[:, None] * m.astype(np.float32)


def _per_row(sub: tuple[np.ndarray | None, ...] | None, rows: int) -> tuple[np.ndarray | None, ...] | None:
    """:func:`k_sub_scales` of ``rows`` whole rows of blocks, per row: ([rows, groups], [rows, K/256], ...); None
    without sub-scales (another type, or SUB_SCALES_ENV off)."""
    return None if sub is None or not _SUB_SCALES else tuple(None if a is None else a.reshape(rows, -1) for a in sub)


def _repack(kind: str, blocks: np.ndarray) -> tuple[str, int, np.ndarray, np.ndarray, np.ndarray | None, tuple | None]:
    """(fmt, group, codes [blocks, ...], scale [blocks, groups], min [blocks, groups] or None, the K-quants'
    stored scales (:func:`k_sub_scales`) or None) for one type."""
    sub = k_sub_scales(kind, blocks)
    return (*_repack_rows(kind, blocks, sub), sub)


def _repack_rows(kind: str, blocks: np.ndarray,
                 sub: tuple | None) -> tuple[str, int, np.ndarray, np.ndarray, np.ndarray | None]:  # fmt: skip
    """:func:`_repack` but the K-quants' stored scales (``sub``: those, from which their row form's are made)."""
    nb = blocks.shape[0]
    if kind == "Q8_0":
        d = _f16(blocks[:, :2])
        return "q8", 32, blocks[:, 2:].view(np.int8), d, None
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(blocks[:, :2])
        if kind == "Q4_0":
            return "q4", 32, blocks[:, 2:], d, -8.0 * d
        return "q4", 32, blocks[:, 4:], d, _f16(blocks[:, 2:4])
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(blocks[:, :2])
        off = 2 if kind == "Q5_0" else 4
        q = _low_high(blocks[:, off + 4 :]) | (_high_bits(blocks[:, off : off + 4]) << 4)
        if kind == "Q5_0":
            return "q8", 32, (q.astype(np.int16) - 16).astype(np.int8), d, None
        return "q8", 32, q.astype(np.int8), d, _f16(blocks[:, 2:4])
    if kind in ("Q4_K", "Q5_K"):
        scale, minv = _sub_products(sub)
        qs = blocks[:, -128:].reshape(nb, 4, 1, 32)
        q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(nb, 8, 32)
        if kind == "Q4_K":
            return "q4", 32, _pack_nibbles(q).reshape(nb, 128), scale, minv
        qh = blocks[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)
        return "q8", 32, q.astype(np.int8).reshape(nb, 256), scale, minv
    if kind == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        lo = ((ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(
            nb, 2, 4, 32
        )
        hi = ((qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
        q = (lo | (hi << 4)).astype(np.int16) - 32
        return "q8", 16, q.astype(np.int8).reshape(nb, 256), _sub_products(sub)[0], None
    if kind in ("Q2_K", "Q3_K"):
        return _repack_low_k(kind, blocks, sub)
    if kind in ("IQ4_NL", "IQ4_XS"):
        return _repack_iq4(kind, blocks, sub)
    if kind in GRID_TYPES:
        return _repack_grid(kind, blocks)
    raise KeyError(kind)


# IQ4_NL / IQ4_XS: each 4-bit index picks one of these 16 non-uniform levels (llama.cpp's table), times a scale
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
# IQ4's level -> its index (the row form holds the levels, LUT4's copy the indices); -1 where no level
_IQ4_INDEX = np.full(256, -1, dtype=np.int16)
_IQ4_INDEX[IQ4_LEVELS.astype(np.int16) + 128] = np.arange(16)


def _repack_iq4(kind: str, blocks: np.ndarray, sub: tuple | None) -> tuple[str, int, np.ndarray, np.ndarray, None]:
    """IQ4_NL (32 weights a block: d as a half, 16 bytes of indices, low nibbles first) and IQ4_XS (256 weights:
    d, the high two bits of eight 6-bit scales as a little-endian u16, their low nibbles in 4 bytes, then 8 x 16
    bytes of indices) as byte codes (the levels themselves) in groups of 32: weight = d * level (IQ4_NL),
    d * (s - 32) * level (IQ4_XS; ``sub``: :func:`k_sub_scales`), the same values.  The interleaved copy keeps the
    indices (LUT4: 4.5 / 4.3 bits a weight, as the file)."""
    nb = blocks.shape[0]
    if kind == "IQ4_NL":
        return "q8", 32, IQ4_LEVELS[_low_high(blocks[:, 2:18])], _f16(blocks[:, :2]), None
    idx = _low_high(blocks[:, 8:].reshape(nb, 8, 16)).reshape(nb, 256)
    return "q8", 32, IQ4_LEVELS[idx], _sub_products(sub)[0], None


def _two_bit_fields(qs: np.ndarray) -> np.ndarray:
    """The 2-bit fields of a Q2_K / Q3_K block's 64 code bytes as 256 codes in element order: each half of the
    block (128 weights) reads its 32 bytes four times, at bit 0, 2, 4 and 6, for 32 weights each."""
    nb = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(nb, 2, 1, 32) >> shifts) & 3).reshape(nb, 256)


def _repack_low_k(kind: str, blocks: np.ndarray, sub: tuple | None) -> tuple[str, int, np.ndarray, np.ndarray,
                                                                          np.ndarray | None]:  # fmt: skip
    """Q2_K and Q3_K (256 weights a block, a scale per 16) as codes in groups of 16 with the same values.  Q2_K:
    weight = d * (s & 15) * q - dmin * (s >> 4), q in 0..3 (bytes 0-15 the 4-bit scale and minimum of each 16,
    16-79 the codes, then d and dmin as halves).  Q3_K: weight = d * (s - 32) * q, q in -4..3 (bytes 0-31 the
    codes' third bits, clear where 4 is subtracted; 32-95 their low two bits; 96-107 the 6-bit scales s,
    :func:`k_sub_scales`; then d).  The row form holds a byte per code; the interleaved copies 3 and 2 bits, with
    the sub-scales (and Q2_K's minima) as stored: 3.6 (Q3_K) and 3.1 (Q2_K) bits a weight where the file holds
    3.4 and 2.6."""
    nb = blocks.shape[0]
    scale, minv = _sub_products(sub)
    if kind == "Q2_K":
        return "q8", 16, _two_bit_fields(blocks[:, 16:80]).astype(np.int8), scale, minv
    third = ((blocks[:, :32].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(nb, 256)
    q = _two_bit_fields(blocks[:, 32:96]).astype(np.int16) - 4 * (1 - third.astype(np.int16))
    return "q8", 16, q.astype(np.int8), scale, None


# IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: each weight is d * s * (a grid value times a sign), s a small multiplier
# stored per group of 32 (IQ2_XS, IQ2_S: 16) weights, the grid's values small integers (IQ2: 8, 25, 43; IQ3: up to
# 62); type -> that group.  Held exactly as byte codes (grid value times sign) with fp32 scales d * s.
GRID_TYPES = {"IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 32, "IQ3_S": 32}


def _grid_multipliers(kind: str, blocks: np.ndarray) -> np.ndarray:
    """s of each group of a grid type's 256-weight blocks (the scale over d: fp32 ``[blocks, groups]``, exact), read
    from the fields as llama.cpp lays them out (after d: the codes, then the type's signs and scale bits)."""
    nb = len(blocks)
    if kind in ("IQ2_XXS", "IQ3_XXS"):  # a u32 per 32 weights whose top 4 bits are the scale
        words = blocks[:, 2:].copy().view(np.uint32).reshape(nb, -1)
        top = words[:, 1::2] if kind == "IQ2_XXS" else words[:, -8:]  # IQ2_XXS: pairs (grid, signs + scale)
        return (np.float32(0.5) + (top >> 28).astype(np.float32)) * np.float32(0.25 if kind == "IQ2_XXS" else 0.5)
    tail = 4 if kind == "IQ3_S" else 8  # the scales' nibbles end the block: one per 32 (IQ3_S) or 16 weights
    nibbles = (blocks[:, -tail:].reshape(nb, tail, 1) >> np.array([0, 4], dtype=np.uint8)).reshape(nb, 2 * tail) & 15
    if kind == "IQ3_S":
        return (1 + 2 * nibbles).astype(np.float32)
    return (np.float32(0.5) + nibbles.astype(np.float32)) * np.float32(0.25)


def _repack_grid(kind: str, blocks: np.ndarray) -> tuple[str, int, np.ndarray, np.ndarray, None]:
    """A grid type's blocks as byte codes and fp32 scales per group (``GRID_TYPES``), exactly: the codes are gguf's
    own decoding of the blocks with d = 1, divided by each group's multiplier s (both small integers times
    powers of two: every product and quotient exact in fp32), the scales d * s."""
    import gguf

    nb, group = len(blocks), GRID_TYPES[kind]
    unit = blocks.copy()
    unit[:, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1
    s = _grid_multipliers(kind, blocks)
    values = gguf.dequantize(unit, gguf.GGMLQuantizationType[kind]).reshape(nb, -1, group)
    codes = values / s[:, :, None]
    if not np.array_equal(codes, np.round(codes)) or np.abs(codes).max(initial=0) > 127:
        raise SelfspecError(f"{kind} blocks whose values are not small integers times their scales")
    return "q8", group, codes.astype(np.int8).reshape(nb, -1), _f16(blocks[:, :2]) * s, None


REPACKED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS",
                  *GRID_TYPES)  # fmt: skip


CHUNK_BYTES = 8 << 20  # raw GGUF bytes repacked at a time (keeps the load's transient memory small) ...
CHUNK_WEIGHTS = 1 << 21  # ... and weights: a repack's temporaries take a few bytes a weight (8 MB of Q2_K: 25M)


def repackable(kind: str, in_features: int) -> bool:
    """Whether a GGUF tensor of type ``kind`` with rows of ``in_features`` weights has a repack here."""
    return kind in REPACKED_TYPES and in_features % 32 == 0


def from_gguf(kind: str, data, out_features: int, in_features: int, *, packed: bool = False) -> QuantWeight | None:
    """The repack of a GGUF tensor of type ``kind``, or None when ``kind`` has no repack (the caller dequantises
    it).  ``data``: the raw blocks as an array ``[out, row bytes]``, or ``(file, offset)`` to read them from
    an open file a few megabytes at a time.  With ``packed``, where :meth:`QuantWeight.release_rows` could drop
    the row form, the weight is made as its interleaved copy alone, a few megabytes of rows at a time: an LM
    head multiplied with int8 activations, whose row form and copy would otherwise both be held for a moment
    (Qwen2.5 0.5B: 153 MB each)."""
    if not repackable(kind, in_features):
        return None
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    row_bytes = in_features // block * size
    read = _chunk_reader(data, row_bytes, out_features)
    n = out_features
    codes = scale = minv = None
    fmt = ""
    group = 0
    step = max(1, min(CHUNK_BYTES // row_bytes, CHUNK_WEIGHTS // in_features))
    if packed and n % 16 == 0:
        qw = _packed_from_gguf(kind, lambda r0, rows: read(r0, rows).reshape(-1, size), n, in_features,
                               max(16, step // 16 * 16))  # fmt: skip
        if qw is not None:
            return qw
    subs = []
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        fmt, group, c, sc, mn, sub = _repack(kind, read(r0, rows).reshape(-1, size))
        subs.append(_per_row(sub, rows))
        if codes is None:  # the outputs, allocated once
            codes = np.empty((n, c.size // rows), dtype=c.dtype)
            scale = np.empty((n, sc.size // rows), dtype=np.float32)
            minv = None if mn is None else np.empty((n, mn.size // rows), dtype=np.float32)
        codes[r0 : r0 + rows] = c.reshape(rows, -1)
        scale[r0 : r0 + rows] = sc.reshape(rows, -1)
        if minv is not None:
            minv[r0 : r0 + rows] = mn.reshape(rows, -1)
    qw = QuantWeight(fmt, out_features, in_features, group, torch.from_numpy(codes), torch.from_numpy(scale),
                     None if minv is None else torch.from_numpy(minv), kind)  # fmt: skip
    if subs[0] is not None:  # a K-quant's stored scales, for its interleaved copy (pack_x16)
        qw.__dict__["_sub"] = tuple(None if a[0] is None else np.concatenate(a) for a in zip(*subs, strict=True))
    return qw


NATIVE_REPACK_ENV = "SELFSPEC_NATIVE_REPACK"  # 0: every copy made by the numpy repack, not gguf_repack.c (A/B)
_NATIVE_REPACK = os.environ.get(NATIVE_REPACK_ENV, "1").strip() != "0"
# the types gguf_repack.c packs: (fmt, group, form bits, codes' bytes per group of 16 rows, minima stored)
NATIVE_REPACKS = {"Q4_K": ("q4", 32, 4, 256, True), "Q5_K": ("q8", 32, 5, 320, True), "Q6_K": ("q8", 16, 6, 192, False),
                  "Q8_0": ("q8", 32, 8, 512, False), "Q5_0": ("q8", 32, 5, 320, False)}  # fmt: skip
HALF_SCALED = ("Q8_0", "Q5_0")  # (their copies' scales: the file's halves; the K-quants': sub-scale tables)


def _native_repack(kind: str, k: int):
    """The C function that packs ``kind``'s blocks with rows of ``k`` weights into the interleaved copy as
    :func:`pack_x16` would (gguf_repack.c), or None: another type, a K-quant with the sub-scale or compact forms
    off or rows not of whole 256-weight blocks, no native library."""
    if not _NATIVE_REPACK or kind not in NATIVE_REPACKS or k % 32:
        return None
    fmt, group, bits, _, minima = NATIVE_REPACKS[kind]
    if x16_bits(fmt, kind, group, minima) != bits:  # (5- and 6-bit codes: their compact form, unless turned off)
        return None
    if kind not in HALF_SCALED and not (_SUB_SCALES and k % 256 == 0):
        return None
    try:
        lib = native()
    except NativeUnavailable:
        return None
    return getattr(lib, f"selfspec_repack_{kind.lower().replace('_', '')}")


def _packed_natively(kind: str, repack, read, n: int, k: int, step: int) -> QuantWeight | None:
    """:func:`_packed_from_gguf` by gguf_repack.c: the file's blocks straight into the copy, ``step`` rows at a
    time, with the GIL released (the loader's threads run at once); None where a half scale is NaN (the numpy
    pack then keeps fp32 scales: that path makes the weight)."""
    fmt, group, bits, group_bytes, minima = NATIVE_REPACKS[kind]
    per_block = k // group * group_bytes  # codes' bytes per block of 16 rows
    halves = kind in HALF_SCALED  # a half per group and row; the K-quants' sub-scale tables: a byte, then their halves
    table = k // group * 32 if halves else k // group * 16 + k // 256 * 32
    codes = hugepages.empty(n // 16 * per_block, np.uint8)
    scale = hugepages.empty((n // 16, table), np.uint8)
    minv = hugepages.empty((n // 16, table), np.uint8) if minima else None
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        raw = np.ascontiguousarray(read(r0, rows))
        b = r0 // 16
        out = (codes[b * per_block :].ctypes.data, scale[b:].ctypes.data)
        if minv is not None:
            repack(rows // 16, k, raw.ctypes.data, *out, minv[b:].ctypes.data)
        elif repack(rows // 16, k, raw.ctypes.data, *out):
            return None
    scale_t = torch.from_numpy(scale.view(np.float16).reshape(n // 16, k // group, 16) if halves else scale)
    packed = (torch.from_numpy(codes), scale_t, None if minv is None else torch.from_numpy(minv))
    return QuantWeight.from_x16(fmt, n, k, group, packed, kind, bits)


def _packed_from_gguf(kind: str, read, n: int, k: int, step: int) -> QuantWeight | None:
    """The weight made as its interleaved copy alone, ``step`` rows (a multiple of 16) at a time: each block of 16
    rows packs on its own, so the pieces are the whole weight's copy; None for a q8 form with minima (its copy
    does not hold it exactly).  Q4_K, Q5_K, Q6_K, Q5_0 and Q8_0 in C where it builds (:func:`_native_repack`), the
    same bytes."""
    repack = _native_repack(kind, k)
    if repack is not None:
        qw = _packed_natively(kind, repack, read, n, k, step)
        if qw is not None:
            return qw
    whole: list[torch.Tensor | None] = []
    fmt, group = "", 0
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        fmt, group, c, sc, mn, sub = _repack(kind, read(r0, rows))
        bits = x16_bits(fmt, kind, group, mn is not None)
        if bits == 8 and mn is not None:
            return None
        c, sc, mn = (None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))
                     for a in (c, sc, mn))  # fmt: skip
        piece = QuantWeight(fmt, rows, k, group, c, sc, mn, kind)
        piece.__dict__["_sub"] = _per_row(sub, rows)
        part = pack_x16(piece)
        if whole and part[1].dtype != whole[1].dtype:  # one piece's scales not all halves: pack it whole instead
            return None
        per = [None if p is None else p.numel() // (rows // 16) for p in part]  # elements per block of 16 rows
        if not whole:  # the outputs, allocated once (on 2 MB pages where the system gives them)
            whole = [None if p is None else torch.from_numpy(hugepages.empty(m * (n // 16), p.numpy().dtype))
                     for p, m in zip(part, per, strict=True)]  # fmt: skip
        for out, p, m in zip(whole, part, per, strict=True):
            if out is not None:  # numpy's copy: torch's would run an OpenMP team of a loader's thread
                out.numpy()[r0 // 16 * m : (r0 + rows) // 16 * m] = p.numpy().reshape(-1)
    codes, scale, minv = whole
    blocks = (n // 16, k // group, 16) if scale.dtype != torch.uint8 else (n // 16, -1)  # (sub-scales: flat)
    return QuantWeight.from_x16(fmt, n, k, group, (codes, scale.reshape(blocks), None if minv is None else
                                                   minv.reshape(blocks)), kind, bits)  # fmt: skip


class MappedTable:
    """A GGUF tensor left in its file: its raw blocks ``uint8 [out, row bytes]`` (a read-only memory map of the
    file), rows decoded on demand by repacking just those rows' blocks and decoding them with the kernels of
    :meth:`QuantWeight.rows`, so each row is bit for bit the row of the whole tensor's repack.  For an untied
    token embedding: a step looks up one row, so the table costs only the file pages touched (reclaimable page
    cache, not anonymous memory), where its repack (Qwen2.5 0.5B: 153 MB) would be held whole.  It offers the
    attributes of a :class:`QuantWeight` that code reading an embedding's ``qweight`` uses; :meth:`repacked`
    makes the whole repack for whatever needs the table at once."""

    def __init__(self, kind: str, blocks: np.ndarray, out_features: int, in_features: int,
                 perm: np.ndarray | None = None) -> None:  # fmt: skip
        if not repackable(kind, in_features):
            raise SelfspecError(f"no repack for a {kind} tensor with rows of {in_features} weights")
        if blocks.shape[0] != out_features:
            raise SelfspecError(f"a table of {out_features} rows given {blocks.shape[0]} rows of blocks")
        self.source, self.out_features, self.in_features = kind, out_features, in_features
        self._blocks = blocks
        self._perm = None if perm is None else np.ascontiguousarray(perm, dtype=np.int64)  # row i is blocks[perm[i]]
        probe = from_gguf(kind, np.asarray(blocks[:1]), 1, in_features)
        assert probe is not None
        self.fmt, self.group, self.symmetric, self.has_minima = probe.fmt, probe.group, False, probe.has_minima
        self.step_bytes = probe.step_bytes * out_features  # what a product would read of the repack (none is made)

    nbytes = 0  # bytes held in memory: the blocks stay in the file
    rows_released = False

    @property
    def file_bytes(self) -> int:
        return int(self._blocks.nbytes)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The rows ``idx`` decoded to fp32 ``[len(idx), in]`` (the repack of only those rows' blocks)."""
        idx = idx.reshape(-1).to(torch.int64)
        if len(idx) == 0:
            return torch.empty(0, self.in_features, dtype=torch.float32)
        if int(idx.min()) < 0 or int(idx.max()) >= self.out_features:
            raise IndexError(f"row index out of range for a weight of {self.out_features} rows")
        picked = idx.numpy() if self._perm is None else self._perm[idx.numpy()]
        part = from_gguf(self.source, self._blocks[picked], len(picked), self.in_features)  # a copy of R rows
        assert part is not None
        return part.rows(torch.arange(len(picked)))

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def repacked(self) -> QuantWeight:
        """The whole tensor as a :class:`QuantWeight` in memory (what the loader makes of a tied table)."""
        qw = from_gguf(self.source, self._blocks, self.out_features, self.in_features)
        assert qw is not None
        return qw if self._perm is None else qw.permute_rows(self._perm)


def _chunk_reader(data, row_bytes: int, rows: int):
    """``read(first_row, count)`` -> raw bytes of those rows, from an array or an open file."""
    if isinstance(data, tuple):
        f, offset = data

        def read_file(r0: int, count: int) -> np.ndarray:
            f.seek(offset + r0 * row_bytes)
            buf = np.empty(count * row_bytes, dtype=np.uint8)
            if f.readinto(memoryview(buf)) != buf.size:
                raise SelfspecError(f"GGUF file {getattr(f, 'name', '')} is truncated")
            return buf

        return read_file
    array = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if array.size != rows * row_bytes:
        raise SelfspecError(f"tensor of {array.size} bytes does not hold {rows} rows of {row_bytes} bytes")
    return lambda r0, count: array[r0 * row_bytes : (r0 + count) * row_bytes]


def quantize_weight(weight: torch.Tensor, bits: int, *, symmetric: bool = False) -> QuantWeight:
    """Weight-only quantisation of an fp32 matrix, groups of 32: ``bits=8`` symmetric (as Q8_0), ``bits=4``
    with a minimum (as Q4_1), or with ``symmetric`` as Q4_0 (scale d = the group's value of largest magnitude
    / -8, codes round(w / d) + 8 in 0..15, minimum -8 d: a fifth less to read, a little coarser)."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % 32:
        raise SelfspecError(f"--quantize needs rows of a multiple of 32 weights, not {k}")
    g = w.reshape(n, k // 32, 32)
    if bits == 8:
        scale = g.abs().amax(-1) / 127
        q = torch.round(g / torch.where(scale == 0, 1, scale).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantWeight("q8", n, k, 32, q.reshape(n, k).contiguous(), scale.contiguous(), None, "int8")
    if bits == 4 and symmetric:
        big = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d = (big / -8).to(torch.float16).to(torch.float32)  # a half: the interleaved copy keeps 2 bytes a scale
        q = torch.round(g / torch.where(d == 0, 1, d).unsqueeze(-1) + 8).clamp(0, 15)
        codes = _pack_nibbles(q.to(torch.uint8).numpy())
        return QuantWeight("q4", n, k, 32, torch.from_numpy(codes.reshape(n, k // 2)), d.contiguous(),
                           (d * -8).contiguous(), "int4", symmetric=True)  # fmt: skip
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
        q = torch.round((g - lo.unsqueeze(-1)) / torch.where(scale == 0, 1, scale).unsqueeze(-1)).clamp(0, 15)
        codes = _pack_nibbles(q.to(torch.uint8).numpy())
        return QuantWeight("q4", n, k, 32, torch.from_numpy(codes.reshape(n, k // 2)), scale.contiguous(),
                           lo.contiguous(), "int4")  # fmt: skip
    raise SelfspecError(f"quantisation to {bits} bits is not supported (8 or 4)")


# The draft precision "q4" (drafters/layerskip.py): draft passes of the fused stack read a 4-bit copy of the layers'
# 8-bit stored weights (Q5_0, Q5_K, Q6_K, Q8_0 take a byte per code here).  torch has no dtype for it; its 4-bit
# integer dtype names it where a draft precision is a torch dtype (core/kernels.py's context variable).
LOW_BIT_DRAFT = torch.quint4x2


def low_bit_copy(w: QuantWeight) -> QuantWeight:
    """``w`` requantised to symmetric ``q4`` (4-bit codes and a scale per 32 weights, as Q4_0) for low-bit drafts,
    in the spirit of QSpec / ML-SpecQD: the model's own weights at fewer bits, no training; a ``q4`` weight is
    returned as it is (nothing to save).  Made from the decoded weight a few MB of rows at a time."""
    if w.fmt == "q4":
        return w
    step = max(16, (4 << 20) // (4 * w.in_features)) // 16 * 16
    parts = [_symmetric_q4(w.rows(torch.arange(r, min(r + step, w.out_features))))
             for r in range(0, w.out_features, step)]  # fmt: skip
    return QuantWeight("q4", w.out_features, w.in_features, 32, torch.cat([p.codes for p in parts]),
                       torch.cat([p.scale for p in parts]), torch.cat([p.minv for p in parts]),
                       f"{w.source}->q4", symmetric=True)  # fmt: skip


def _symmetric_q4(rows: torch.Tensor) -> QuantWeight:
    """``quantize_weight(rows, 4, symmetric=True)``, its two passes over the weights in the native library
    (quant_kernels.c: the same numbers, a tenth of the time); torch's where the library is not built."""
    n, k = rows.shape
    try:
        lib = native()
    except NativeUnavailable:
        return quantize_weight(rows, 4, symmetric=True)
    rows = rows.to(torch.float32).contiguous()
    big = torch.empty(n, k // 32)
    lib.selfspec_low_bit_big(n, k, rows.data_ptr(), big.data_ptr())
    d = (big / -8).to(torch.float16).to(torch.float32)  # a half: the interleaved copy keeps 2 bytes a scale
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    lib.selfspec_low_bit_codes(n, k, rows.data_ptr(), d.data_ptr(), codes.data_ptr())
    return QuantWeight("q4", n, k, 32, codes, d, d * -8, "int4", symmetric=True)


# -- modules ---------------------------------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantised.  Draft passes compute with it as it is (there is no
    cheaper copy to switch to), adding S3D's draft-only low-rank updates where they are on; under autograd
    the weight is decoded for ``F.linear`` so gradients reach the input (S3D's training)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, self.qweight.dequantize().to(x.dtype), self.bias)
        if (self.bias is None and x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] == self.in_features
                and x.numel() < PREFILL_ROWS * self.in_features and kernels.active_draft_adapters() is None):
            # the decoding step's common case, with as little Python as possible around the kernel
            y = x.new_empty(*x.shape[:-1], self.out_features)
            self.qweight.product_into(x.numel() // self.in_features, x.data_ptr(), y.data_ptr())
            return y
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
        y = self.qweight.matmul(x2)
        if self.bias is not None:
            y += self.bias
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        adapters = kernels.active_draft_adapters()
        if adapters is not None and self in adapters:
            a, b, scale = adapters[self]
            y = y + scale * F.linear(F.linear(x.to(a.dtype), a), b).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in_features={w.in_features}, out_features={w.out_features}, {w.source} as {w.fmt}/{w.group}"


EMBEDDING_CACHE_BYTES = 4 << 20  # decoded embedding rows kept per table (least recently used out first)
CACHED_LOOKUP_IDS = 8  # lookups of up to this many ids go through those rows; longer ones (prompts) decode at once


class QuantEmbedding(nn.Module):
    """Token embeddings looked up row by row from a quantised table, times ``scale`` where the model's
    embedding scales (Gemma's sqrt(hidden)).  The table is a :class:`QuantWeight` (a tied LM head's, or a repack
    of its own) or a :class:`MappedTable` (an untied GGUF table left in its file)."""

    def __init__(self, weight: QuantWeight | MappedTable, scale: float | None = None,
                 padding_idx: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.scale = scale
        self.padding_idx = padding_idx
        # decoded rows of recent tokens (a decoding step looks up 1-8 ids; text repeats its tokens): decoding one
        # row of a tied table's interleaved copy costs ~35 us inside a lookup (selfspec_rows_x16), one of a table left
        # in its file ~0.1 ms; a hit ~10 us
        self._recent: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._recent_max = max(16, EMBEDDING_CACHE_BYTES // (4 * self.embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if 0 < input_ids.numel() <= CACHED_LOOKUP_IDS and input_ids.device.type == "cpu":
            out = torch.stack([self._row(i) for i in input_ids.reshape(-1).tolist()])  # a new tensor: callers own it
        else:
            out = self.qweight.rows(input_ids)
            if input_ids.device.type == "cpu":
                self._remember(input_ids.reshape(-1).tolist(), out)
        out = out.reshape(*input_ids.shape, self.embedding_dim)
        return out if self.scale is None else out * self.scale

    def _remember(self, ids: list[int], rows: torch.Tensor) -> None:
        """Keep the decoded rows of a long lookup's ids (a prompt's) among the recent rows: an answer repeats
        many of its prompt's tokens (about a third of a Spec-Bench answer's lookups), and each would otherwise
        decode its row again (~35 us from a tied table's interleaved copy, 0.1-0.2 ms from a table left in its file).
        The last ``_recent_max`` distinct ids, each row a copy of its own (the caller owns ``rows``)."""
        last = {tok: i for i, tok in enumerate(ids)}  # each id's last position, in order of first appearance
        order = sorted(last, key=last.__getitem__)[-self._recent_max :]
        for tok in order:
            if tok in self._recent:
                self._recent.move_to_end(tok)
            else:
                self._recent[tok] = rows[last[tok]].clone()
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    def _row(self, token: int) -> torch.Tensor:
        """Row ``token`` decoded (bit for bit :meth:`QuantWeight.rows`'), from the recent rows where it is there."""
        row = self._recent.get(token)
        if row is None:
            row = self.qweight.rows(torch.tensor([token]))[0]
            self._recent[token] = row
            if len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(token)
        return row

    def extra_repr(self) -> str:
        w = self.qweight
        where = ", in the file" if isinstance(w, MappedTable) else ""
        return f"{w.out_features}, {w.in_features}, {w.source} as {w.fmt}/{w.group}{where}, scale={self.scale}"


def quantize_linears(model: nn.Module, bits: int) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (rows a multiple of 32 weights) by a :class:`QuantLinear`
    holding its weight quantised to ``bits``; returns how many.  ``model`` is changed in place: only for
    models the package loaded itself."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m.in_features % 32 == 0]
    for name, m in targets:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                QuantLinear(quantize_weight(m.weight, bits), m.bias))  # fmt: skip
    return len(targets)


def quant_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]


def quantized_bytes(module: nn.Module, *, read: bool = False) -> int:
    """Bytes of the distinct quantised weights under ``module`` (a tied table counted once): held in memory
    (interleaved copies for int8 products included; none for a table left in its file), or with ``read``, what
    a decoding pass reads: every product's weight, not an embedding table of its own (a step looks up one row)."""
    seen: dict[int, int] = {}
    for m in quant_modules(module):
        if read and isinstance(m, QuantEmbedding):
            continue
        seen[id(m.qweight)] = m.qweight.step_bytes if read else m.qweight.nbytes
    return sum(seen.values())


# -- the report ------------------------------------------------------------------------------------------------------


def measure_products(module: nn.Module, rows=(1, 4, 16), reps: int = 20) -> list[dict]:
    """ms and GB/s of the quantised products of ``module``, one weight per distinct (type, form, shape), with how
    many layers share it: the table ``selfspec kernels`` prints for a quantised model."""
    import time

    seen: dict[tuple, dict] = {}
    for m in quant_modules(module):
        if not isinstance(m, QuantLinear):
            continue
        w = m.qweight
        key = (w.source, w.fmt, w.group, w.out_features, w.in_features)
        if key in seen:
            seen[key]["count"] += 1 if seen[key]["id"] != id(w) else 0
            continue
        entry = seen[key] = {"type": w.source, "form": w.form_label, "shape": [w.out_features, w.in_features],
                             "count": 1, "mb": w.step_bytes / 1e6, "ms": {}, "gbs": {}, "id": id(w)}  # fmt: skip
        for t in rows:
            x = torch.randn(t, w.in_features)
            w.matmul(x)
            t0 = time.perf_counter()
            for _ in range(reps):
                w.matmul(x)
            ms = 1000 * (time.perf_counter() - t0) / reps
            entry["ms"][t] = ms
            entry["gbs"][t] = w.step_bytes / ms / 1e6
    for entry in seen.values():
        del entry["id"]
    return list(seen.values())


def format_products(table: list[dict], bandwidth_gbs: float | None = None) -> str:
    rows = sorted({t for e in table for t in e["ms"]})
    head = "quantised products: ms per product of T rows (GB/s of quantised weight read)"
    if bandwidth_gbs:
        head += f"; memory read bandwidth {bandwidth_gbs:.1f} GB/s"
    columns = "".join(f"{'T=' + str(t):>16}" for t in rows)
    lines = [head, f"  {'type':<6} {'form':<6} {'shape':>13} {'x':>3} {'MB':>6}{columns}"]
    for e in table:
        shape = "x".join(str(d) for d in e["shape"])
        cells = "".join(f"{e['ms'][t]:8.3f} ({e['gbs'][t]:4.0f})" for t in rows)
        lines.append(f"  {e['type']:<6} {e['form']:<6} {shape:>13} {e['count']:>3} {e['mb']:6.1f}{cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(build(verbose=True))
