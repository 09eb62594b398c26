"""A Hugging Face model built from a GGUF file with its weights kept quantised.

The second place (with :mod:`selfspec.arch.adapters`) that knows HF internals: it
uses transformers' own GGUF knowledge (the GGUF -> HF tensor-name map and the
per-architecture tensor processors, e.g. Llama's reverse permutation of the query and
key rows, Gemma's norm offset) but never dequantises a tensor it can keep:

* the model skeleton is made on the ``meta`` device (no fp32 weights ever exist);
* each quantised linear weight becomes a :class:`~selfspec.core.quant.QuantLinear`
  (row permutations applied to the quantised rows, found by running the processor on
  row numbers), the token embedding a :class:`~selfspec.core.quant.QuantEmbedding`, and a
  tied LM head shares the embedding's quantised table;
* an untied embedding table (the file has an output tensor of its own) stays in the file as a
  :class:`~selfspec.core.quant.MappedTable` (a read-only memory map whose rows are decoded as they are
  looked up): a step reads one row, so it costs only the pages touched, not a repack held whole;
* an LM head, under int8 activations, is made as its interleaved copy alone (the form the engine keeps
  of it; a tied table's lookups decode their rows from it), so its row form and that copy are never held
  together;
* norms, biases and tensors of types without a repack are dequantised (the latter with a
  warning naming the type);
* tensors are read one at a time from the file (no mapping of the whole file stays
  resident), so peak memory stays near the repacked size.

Config and tokenizer are parsed from the GGUF metadata once (transformers takes 5-20 s
for a 262k-token vocabulary) and cached as a small HF directory without weights.
"""

from __future__ import annotations

import contextlib
import struct
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.heap import HeapTrimmer
from ..core.quant import (
    MappedTable,
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    from_gguf,
    int8_activations,
    prefill_kernel,
    repackable,
)
from ..errors import SelfspecError, UnsupportedModelError
from ..io import atomic_dir
from . import tokenizers
from .adapters import SUPPORTED_MODEL_TYPES


def gguf_metadata(path: Path, meta_dir: Path) -> Path:
    """A folder with the config and tokenizer of the GGUF file ``path`` (made once under ``meta_dir``)."""
    if (meta_dir / "config.json").is_file():
        return meta_dir
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, RuntimeError, IndexError, TypeError, struct.error) as exc:
        raise SelfspecError(f"could not read GGUF file {path}: {str(exc).splitlines()[0][:300]}") from None
    return atomic_dir(meta_dir, lambda tmp: (config.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # the values rope scaling keys take


_LENGTH = struct.Struct("<Q")  # a string's length before its bytes


class _HeaderWalker:
    """Reads a GGUF header from a buffer, front to back: numbers, strings, and values skipped by their type."""

    def __init__(self, buf, bad) -> None:
        self.buf, self.pos, self.bad = buf, 0, bad

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise self.bad("a string runs past the end")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        """Past ``count`` strings by their lengths alone, their texts not decoded (a vocabulary's 150-260k:
        Qwen2.5's header 0.29 -> 0.12 s)."""
        pos, length = self.pos, _LENGTH.unpack_from
        for _ in range(count):
            pos += 8 + length(self.buf, pos)[0]
        if pos > len(self.buf):
            raise self.bad("a string runs past the end")
        self.pos = pos

    def skip(self, kind: int) -> None:
        if kind in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[kind]
        elif kind == _STRING:
            self.skip_strings(1)
        elif kind == _ARRAY:
            inner, count = self.unpack("IQ")
            if inner in _SCALAR_SIZES:
                self.pos += count * _SCALAR_SIZES[inner]
            elif inner == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.skip(inner)
        else:
            raise self.bad(f"unknown value type {kind}")


def _walk_header(buf, path: Path, bad) -> tuple[str, list[tuple[str, int, tuple[int, ...], int]], int, dict]:
    """(architecture, [(name, type number, shape, offset in the data)], where the data starts, the rotary
    scaling keys: ``{suffix after "rope.scaling.": value}``)."""
    h = _HeaderWalker(buf, bad)
    if bytes(buf[:4]) != b"GGUF":
        raise SelfspecError(f"{path} is not a GGUF file (bad magic)")
    h.pos = 4
    version, n_tensors, n_kv = h.unpack("IQQ")
    if version < 2:
        raise SelfspecError(f"{path}: GGUF version {version} is not supported (2 or newer)")
    arch, alignment, rope = "", 32, {}
    for _ in range(n_kv):
        key = h.string()
        (kind,) = h.unpack("I")
        if key == "general.architecture" and kind == _STRING:
            arch = h.string()
        elif key == "general.alignment" and kind == 4:
            (alignment,) = h.unpack("I")
        elif ".rope.scaling." in key and kind == _STRING:
            rope[key.split(".rope.scaling.", 1)[1]] = h.string()
        elif ".rope.scaling." in key and kind in _SCALAR_FORMATS:
            rope[key.split(".rope.scaling.", 1)[1]] = h.unpack(_SCALAR_FORMATS[kind])[0]
        else:
            h.skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = h.string()
        (n_dims,) = h.unpack("I")
        shape = h.unpack(f"{n_dims}Q")
        qtype, offset = h.unpack("IQ")
        infos.append((name, qtype, tuple(int(d) for d in shape), offset))
    return arch, infos, (h.pos + alignment - 1) // alignment * alignment, rope


def _read_header(path: Path) -> tuple[str, list[tuple[str, str, tuple[int, ...], int, int]], dict]:
    """The GGUF architecture name, (name, type name, shape as stored [in, out], file offset, bytes) of every
    tensor, and the rotary scaling keys (``{"type": "linear", "factor": 8.0}``; empty where none).  A small
    header walk of our own: ``gguf.GGUFReader`` parses every metadata array into numpy objects (13 s for a
    262k-token vocabulary), where we need a few values and the tensor table."""
    import mmap

    import gguf

    def bad(why: str) -> SelfspecError:
        return SelfspecError(f"GGUF file {path} is corrupt or truncated ({why})")

    with path.open("rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise bad("empty file") from None
    try:
        arch, infos, start, rope = _walk_header(buf, path, bad)
        size = len(buf)
    except struct.error:
        raise bad("the header ends early") from None
    finally:
        buf.close()
    tensors = []
    for name, qtype, shape, offset in infos:
        try:
            kind = gguf.GGMLQuantizationType(qtype)
        except ValueError:
            raise SelfspecError(f"GGUF file {path}: tensor {name} has unknown type number {qtype}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = (int(np.prod(shape)) if shape else 1) // block * type_size
        if start + offset + nbytes > size:
            raise SelfspecError(f"GGUF file {path} is truncated: tensor {name} ends past the end of the file")
        tensors.append((name, kind.name, shape, start + offset, nbytes))
    return arch, tensors, rope


def _raw(f, offset: int, nbytes: int) -> np.ndarray:
    f.seek(offset)
    buf = np.empty(nbytes, dtype=np.uint8)
    if f.readinto(memoryview(buf)) != nbytes:
        raise SelfspecError(f"GGUF file {f.name} is truncated")
    return buf


def _dequantized(kind: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 values of a tensor, in HF's order of dimensions (reverse of the stored shape)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        values = raw.view(np.float32)
    elif kind == "F16":
        values = raw.view(np.float16).astype(np.float32)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        values = gguf.dequantize(raw.reshape(-1, size), qtype).astype(np.float32, copy=False)
    return values.reshape(tuple(reversed(shape)))


def load_quantized(path: Path, meta_dir: Path) -> tuple[Any, Any, dict]:
    """(HF model with quantised weights, tokenizer, summary) for the GGUF file ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    gguf_arch, tensors, rope = _read_header(path)  # first: a damaged file gets our message, not transformers'
    where = gguf_metadata(path, meta_dir)
    config = AutoConfig.from_pretrained(where)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"GGUF file {path.name} holds architecture '{config.model_type}'; supported: "
                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")  # fmt: skip
    scale_rope(config, rope_scaling(rope, path))
    tokenizer = tokenizers.slim(AutoTokenizer.from_pretrained(where))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=config.to_dict())
    name_map = _name_map(hf, gguf_arch, path)
    head_path = _path_of(hf, hf.get_output_embeddings())
    untied = any(name_map.get(t[0]) == f"{head_path}.weight" for t in tensors)  # an output tensor of its own
    pack_head = untied and int8_activations()  # the engine would pack the head and drop its row form: do it now
    # ... and the decoder layers' products, whose row forms the fused stack drops where the prompt takes the int8
    # kernels too (made as their interleaved copies alone, the load never holds both forms of every layer)
    pack_layers = int8_activations() and prefill_kernel() == "rows"
    summary: dict[str, Any] = {"kept": {}, "dequantized": {}}
    quantised: dict[str, QuantWeight | MappedTable] = {}
    trim = HeapTrimmer(64 << 20)  # the repacks' freed temporaries given back as the load goes (else 30-60 MB)
    pending: list[tuple[str, Future, np.ndarray | None]] = []  # repacks under way, in the file's order
    pool = ThreadPoolExecutor(loader_threads(), thread_name_prefix="selfspec-load")
    with path.open("rb") as f, _shut_down_on_exit(pool):
        freq_factors = _rope_freqs(f, tensors)
        for name, kind, shape, offset, nbytes in tensors:
            hf_name = name_map.get(name)
            if hf_name is None:
                continue
            module_path, attr = hf_name.rsplit(".", 1)
            module = hf.get_submodule(module_path)
            if attr == "weight" and len(shape) == 2 and _quantisable(module) and repackable(kind, shape[0]):
                perm = _row_permutation(processor, name, shape[1], name_map)
                mapped = untied and isinstance(module, nn.Embedding)  # looked up a row at a time, never multiplied
                if module_path == head_path:
                    packed = pack_head and getattr(module, "bias", None) is None
                elif isinstance(module, nn.Embedding):  # a tied table is the LM head too: its copy serves lookups
                    packed = not untied and int8_activations()
                else:
                    packed = pack_layers and type(module) is nn.Linear
                if perm is not None:
                    identity = np.array_equal(perm, np.arange(shape[1]))
                    if mapped:
                        quantised[module_path] = _mapped(f, kind, shape, offset, nbytes, None if identity else perm)
                    else:
                        pending.append((module_path, pool.submit(_repacked, path, kind, shape, offset, nbytes, trim,
                                                                 packed=packed and identity),
                                        None if identity else perm))  # fmt: skip
                    summary["kept"][kind] = summary["kept"].get(kind, 0) + 1
                    continue
            if len(shape) == 2 and kind not in ("F32", "F16", "BF16"):
                summary["dequantized"][kind] = summary["dequantized"].get(kind, 0) + 1
            raw = _raw(f, offset, nbytes)
            values = processor.process(weights=_dequantized(kind, raw, shape), name=name, tensor_key_mapping=name_map,
                                       parsed_parameters={"tensors": {}}).weights  # fmt: skip
            module._parameters[attr] = nn.Parameter(torch.from_numpy(np.array(values, dtype=np.float32)),
                                                    requires_grad=False)  # fmt: skip
            trim(nbytes)
        for module_path, repack, perm in pending:  # (a failed repack raises its error here)
            qw = repack.result()
            quantised[module_path] = qw if perm is None else qw.permute_rows(perm)
    if summary["dequantized"]:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in summary["dequantized"].items())
        warnings.warn(f"{path.name}: no quantised kernel for {kinds}; those tensors are dequantised to fp32",
                      stacklevel=2)  # fmt: skip
    _install(hf, quantised)
    _materialise_buffers(hf)
    if freq_factors is not None:
        divide_frequencies(hf, freq_factors, f"GGUF file {path.name}")
    missing = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.device.type == "meta"]
    if missing:
        raise SelfspecError(f"GGUF file {path} has no tensor for {', '.join(missing[:5])}")
    hf.eval()
    return hf, tokenizer, summary


# -- rotary scaling: what llama.cpp reads from the file and transformers' GGUF config leaves out ---------------------

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's divisor per rotary frequency: how Llama 3.1-3.3 files carry "llama3"
_YARN_KEYS = {"type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow", "finetuned"}


def rope_scaling(rope: dict, path: Path) -> dict | None:
    """HF rotary parameters for a file's ``rope.scaling`` keys (:func:`_read_header`): None where it scales
    nothing; linear and YaRN as transformers computes them (the formulas llama.cpp uses); any other kind refused,
    since the model would run with wrong rotary angles (transformers' GGUF config drops these keys)."""
    kind = str(rope.get("type", "none")).lower()
    factor = float(rope.get("factor") or 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    unknown = sorted(set(rope) - _YARN_KEYS)
    if kind == "yarn" and not unknown:
        params: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        if "original_context_length" in rope:
            params["original_max_position_embeddings"] = int(rope["original_context_length"])
        for ours, theirs in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if ours in rope:
                params[theirs] = float(rope[ours])
        return params
    what = f"{kind!r} with keys {', '.join(unknown)}" if kind == "yarn" else repr(kind)
    raise UnsupportedModelError(f"GGUF file {path.name} scales its rotary embedding by {what}; supported: linear, "
                                f"yarn (factor, original context, beta) and llama.cpp's {ROPE_FREQS} factors")


def scale_rope(config, params: dict | None) -> None:
    """Put :func:`rope_scaling`'s parameters in ``config`` before the model is made.  Per-layer-type rotary tables
    (Gemma 3): the global layers' only; llama.cpp keeps the sliding-window layers' unscaled, as transformers does."""
    if params is None:
        return
    if params["rope_type"] == "yarn" and "original_max_position_embeddings" not in params:
        params = {**params, "original_max_position_embeddings": config.max_position_embeddings}  # llama.cpp's default
    rp = config.rope_parameters
    per_type = all(isinstance(v, dict) for v in rp.values())
    for table in [v for k, v in rp.items() if k != "sliding_attention"] if per_type else [rp]:
        table.update(params)


def rope_for_conversion(path: Path) -> tuple[dict | None, np.ndarray | None]:
    """The rotary scaling of GGUF file ``path`` for its fp32 conversion (``--quantize none``): the parameters its
    config takes (:func:`scale_rope`), and its ``rope_freqs`` divisors or None (no transformers config holds
    them: the conversion keeps them in a file of their own, :data:`ROPE_FREQS_FILE`)."""
    _, tensors, rope = _read_header(path)
    with path.open("rb") as f:
        return rope_scaling(rope, path), _rope_freqs(f, tensors)


def _rope_freqs(f, tensors) -> np.ndarray | None:
    """The file's :data:`ROPE_FREQS` divisors (``f`` open on it, ``tensors`` its table), or None."""
    for name, kind, shape, offset, nbytes in tensors:
        if name == ROPE_FREQS:
            return _dequantized(kind, _raw(f, offset, nbytes), shape)
    return None


ROPE_FREQS_FILE = "rope_freqs.npy"  # beside a converted checkpoint's config: the GGUF's rope_freqs divisors


def divide_frequencies(hf: nn.Module, factors: np.ndarray, what: str) -> None:
    """llama.cpp's ``rope_freqs``: each rotary frequency divided by its factor, in every layer (the angle of
    frequency i at position p is p * inv_freq[i] / factors[i]); ``what`` names the model in errors."""
    f = torch.from_numpy(np.array(factors, dtype=np.float32).reshape(-1))
    tables = [m for m in hf.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    for m in tables:
        inv = m._buffers.get("inv_freq")
        if inv is None or inv.shape != f.shape:
            raise UnsupportedModelError(f"{what}: its {ROPE_FREQS} ({f.numel()} factors) does not fit this "
                                        f"architecture's rotary tables")  # fmt: skip
        m._buffers["inv_freq"] = inv / f.to(inv.device)
        if m._buffers.get("original_inv_freq") is not None:
            m._buffers["original_inv_freq"] = m._buffers["original_inv_freq"] / f.to(inv.device)
    if not tables:
        raise UnsupportedModelError(f"{what} has {ROPE_FREQS} but the model has no rotary table")


def _name_map(hf: nn.Module, gguf_arch: str, path: Path) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from gguf-py's table of names (transformers' own helper builds the
    same map by walking every submodule, 2-5 s; once is enough)."""
    import gguf

    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch), None)
    if arch is None:
        raise SelfspecError(f"GGUF file {path}: architecture '{gguf_arch}' is unknown to the gguf package")
    table = gguf.get_tensor_name_map(arch, hf.config.num_hidden_layers)
    out: dict[str, str] = {}
    for hf_name in hf.state_dict(keep_vars=True):
        base, _, suffix = hf_name.rpartition(".")
        parts = base.split(".")
        for i in range(len(parts)):  # "model.layers.0.mlp.up_proj", then "layers.0.mlp.up_proj", ...
            gguf_name = table.get_name(".".join(parts[i:]))
            if gguf_name is not None:
                out.setdefault(f"{gguf_name}.{suffix}", hf_name)
                break
    return out


LOADER_THREADS = 4  # at most: a repack is bound by memory beyond a few threads


def loader_threads() -> int:
    """Threads that repack a file's tensors at once: torch's thread count (the cores it was given), at most
    :data:`LOADER_THREADS`."""
    return max(1, min(LOADER_THREADS, torch.get_num_threads()))


def _mapped(f, kind: str, shape: tuple[int, ...], offset: int, nbytes: int,
            perm: np.ndarray | None) -> MappedTable:  # fmt: skip
    """A weight left in the open file ``f`` as a :class:`MappedTable` (its rows reordered by ``perm``)."""
    blocks = np.memmap(f, dtype=np.uint8, mode="r", offset=offset, shape=(shape[1], nbytes // shape[1]))
    return MappedTable(kind, blocks, shape[1], shape[0], perm)


@contextlib.contextmanager
def _shut_down_on_exit(pool: ThreadPoolExecutor):
    """``pool`` shut down when the block ends; where it ends by an error, the repacks not started are dropped."""
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _repacked(path: Path, kind: str, shape: tuple[int, ...], offset: int, nbytes: int, trim: HeapTrimmer, *,
              packed: bool) -> QuantWeight:  # fmt: skip
    """A weight kept quantised, repacked into memory from the file ``path`` (with ``packed``, as its interleaved
    copy for int8 products alone where it can be), then the heap trimmed after every so many bytes of them.  Runs
    on a loader thread, beside others: its own handle of the file (no other thread moves its position), numpy's
    work and C calls only (a torch operator there would start an OpenMP team of that thread's, see
    :mod:`selfspec.core.native_thread`)."""
    with path.open("rb") as f:
        qw = from_gguf(kind, (f, offset), shape[1], shape[0], packed=packed)
    assert qw is not None
    trim(nbytes)
    return qw


def _quantisable(module: nn.Module) -> bool:
    return type(module) is nn.Linear or isinstance(module, nn.Embedding)


def _row_permutation(processor, name: str, rows: int, name_map: dict) -> np.ndarray | None:
    """How the architecture's processor reorders the rows of tensor ``name`` (None: it does more than reorder
    rows, so the tensor must be dequantised)."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    result = processor.process(weights=probe, name=name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}})
    out = np.asarray(result.weights)
    if result.name != name or out.shape != probe.shape:
        return None
    perm = out.reshape(-1)
    if not np.array_equal(np.sort(perm), probe.reshape(-1)):
        return None
    return perm.astype(np.int64)


def _install(hf: nn.Module, quantised: dict[str, QuantWeight | MappedTable]) -> None:
    """Put the quantised modules in place; a tied LM head shares the embedding's table."""
    embed_path = _path_of(hf, hf.get_input_embeddings())
    head_path = _path_of(hf, hf.get_output_embeddings())
    for module_path, qw in quantised.items():
        old = hf.get_submodule(module_path)
        if isinstance(old, nn.Embedding):
            scale = getattr(old, "scalar_embed_scale", None)
            new: nn.Module = QuantEmbedding(qw, None if scale is None else float(scale), old.padding_idx)
        else:
            new = QuantLinear(qw, None if old.bias is None or old.bias.device.type == "meta" else old.bias)
        _set_submodule(hf, module_path, new)
    if head_path not in quantised and embed_path in quantised:
        head = hf.get_submodule(head_path)
        table = quantised[embed_path]
        if head.weight.device.type == "meta":  # tied: no separate output tensor in the file
            _set_submodule(hf, head_path, QuantLinear(table if isinstance(table, QuantWeight) else table.repacked()))


def _materialise_buffers(hf: nn.Module) -> None:
    """Buffers computed at construction (rotary frequencies, embedding scales) made again on the CPU."""
    for name, module in list(hf.named_modules()):
        if not any(b.device.type == "meta" for b in module._buffers.values() if b is not None):
            continue
        if type(module).__name__.endswith("RotaryEmbedding"):
            _set_submodule(hf, name, type(module)(config=getattr(module, "config", hf.config)))
        elif hasattr(module, "scalar_embed_scale"):
            module._buffers["embed_scale"] = torch.tensor(float(module.scalar_embed_scale))


def _path_of(root: nn.Module, target: nn.Module | None) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    return ""


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)
