"""GGUF files of a real model's shape and quantisation mix with random weights: the engine's speed and memory at
sizes this machine has no file of (1-8B), with no download.

The codes are random and the scales small, so a synthetic model's text is noise: use it for timing (``selfspec
kernels --model FILE --compare-llama-cpp DIR``, which runs llama.cpp's ``llama-bench`` on the same file) and for
peak memory, never for acceptance or output quality. The tokenizer, chat template and every other metadata
entry are copied from a GGUF file of the same family (``--like``: a qwen2 file for the Qwen2.5 shapes, a llama
one such as the built-in SmolLM2's for the Llama shapes; the vocabulary is the donor's). Tensor types follow
llama.cpp's Q4_K_M recipe (Q6_K for the tied embedding / head and for ``attn_v`` and ``ffn_down`` of the first
and last eighth of the layers and every third in between, Q4_K elsewhere; where a row is not a multiple of 256
weights, as Gemma 3's hidden sizes, llama.cpp's fallbacks: Q5_0 for Q4_K, Q8_0 for Q6_K).  ``--mix q3_k``,
``q2_k`` and ``iq4_xs`` write files of the lower-bit types users run 7-8B models in: Q3_K (Q2_K, IQ4_XS) where the
Q4_K_M recipe has Q4_K, Q4_K (Q3_K, IQ4_XS) where it has Q6_K in the layers, the head in Q6_K (near llama.cpp's
Q3_K_M, Q2_K and IQ4_XS recipes, not their exact per-layer choices).

Run: ``python -m selfspec.bench.synthetic --shape qwen2.5-1.5b --out /tmp/qwen-1.5b.gguf`` (``--like`` defaults
to the built-in model of the family: ``selfspec models install qwen2.5-coder-0.5b`` for the Qwen2.5 shapes)

``--requantize FILE --type q8_0`` writes a real model's own weights in Q8_0 blocks instead (:func:`requantize`):
the type many small models are run in, where lower-bit copies (``lowbit``) save the most.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidInputError


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions (``arch`` qwen2: q/k/v biases; llama: none), tied embedding where ``tied``;
    ``vocab`` None: the donor file's."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    tied: bool
    llama3_rope: bool = False  # Llama 3.1-3.3: rotary base 500000 and llama.cpp's rope_freqs divisors
    head_dim: int | None = None  # None: hidden / heads (Gemma 3's is 256 whatever its width)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


LLAMA3_THETA = 500000.0
LLAMA3_ROPE = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context": 8192}


def llama3_rope_factors(theta: float, head_dim: int, factor: float = 32.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 8192) -> np.ndarray:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for a "llama3" rotary scaling: 1 for wavelengths
    under ``original_context / high_freq_factor``, ``factor`` above ``original_context / low_freq_factor``,
    interpolated (in 1/divisor) between."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original_context / high_freq_factor:
            out.append(1.0)
        elif wavelength > original_context / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, tied=True),
    "qwen2.5-3b": Shape("qwen2", layers=36, hidden=2048, ffn=11008, heads=16, kv_heads=2, tied=True),
    "qwen2.5-7b": Shape("qwen2", layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, tied=False),
    "llama-3.2-1b": Shape("llama", layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, tied=True,
                          llama3_rope=True),
    "llama-3.2-3b": Shape("llama", layers=28, hidden=3072, ffn=8192, heads=24, kv_heads=8, tied=True,
                          llama3_rope=True),
    "gemma-3-1b": Shape("gemma3", layers=26, hidden=1152, ffn=6912, heads=4, kv_heads=1, tied=True, head_dim=256),
}
DEFAULT_DONOR = {"qwen2": "qwen2.5-coder-0.5b", "llama": "smollm2-135m", "gemma3": "gemma3-270m"}  # built-ins

_BLOCKS = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q3_K": (256, 110),
           "Q2_K": (256, 84), "IQ4_XS": (256, 136), "IQ4_NL": (32, 18)}  # (weights, bytes) a block  # fmt: skip
_SCALE_AT = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,), "Q3_K": (108,), "Q2_K": (80, 82),
             "IQ4_XS": (0,), "IQ4_NL": (0,)}  # byte offsets of each block's fp16 scales  # fmt: skip
# llama.cpp's types for rows that are not a multiple of 256 weights
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0", "Q3_K": "IQ4_NL", "Q2_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}
# the layers' types of each mix: (where Q4_K_M has Q4_K, where it has Q6_K)
MIXES = {"q4_k_m": ("Q4_K", "Q6_K"), "q3_k": ("Q3_K", "Q4_K"), "q2_k": ("Q2_K", "Q3_K"),
         "iq4_xs": ("IQ4_XS", "IQ4_XS")}  # fmt: skip


def _kind(kind: str, cols: int) -> str:
    return _FALLBACK[kind] if cols % 256 else kind


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v / ffn_down: Q6_K in the first and last eighth and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int, scale: float) -> np.ndarray:
    """Random codes of ``rows`` x ``cols`` weights as ``kind`` blocks, every block scale a small positive half."""
    block, nbytes = _BLOCKS[kind]
    if cols % block:
        raise InvalidInputError(f"{kind} needs rows of a multiple of {block} weights, got {cols}")
    per_row = cols // block * nbytes
    data = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    halves = (scale * (0.5 + rng.random((data.shape[0], len(_SCALE_AT[kind]))))).astype(np.float16)
    for i, at in enumerate(_SCALE_AT[kind]):
        data[:, at : at + 2] = halves[:, i : i + 1].view(np.uint8)
    return data.reshape(rows, per_row)


def _tensors(shape: Shape, vocab: int, rng: np.random.Generator, mix: str = "q4_k_m"):
    """(name, array, raw ggml type name or None for f32) of every tensor, in llama.cpp's order."""
    h, q, kv = shape.hidden, shape.dim * shape.heads, shape.dim * shape.kv_heads
    base, more = MIXES[mix]
    embed = _kind("Q6_K" if shape.tied else base, h)
    if shape.llama3_rope:
        yield "rope_freqs.weight", llama3_rope_factors(LLAMA3_THETA, shape.dim, **LLAMA3_ROPE), None
    yield "token_embd.weight", _random_blocks(rng, embed, vocab, h, 2e-5), embed
    gemma = shape.arch == "gemma3"
    for i in range(shape.layers):
        big = more if _more_bits(i, shape.layers) else base
        yield f"blk.{i}.attn_norm.weight", np.ones(h, np.float32), None
        for name, rows, cols, kind in (("attn_q", q, h, base), ("attn_k", kv, h, base), ("attn_v", kv, h, big),
                                       ("attn_output", h, q, base), ("ffn_gate", shape.ffn, h, base),
                                       ("ffn_up", shape.ffn, h, base), ("ffn_down", h, shape.ffn, big)):  # fmt: skip
            kind = _kind(kind, cols)
            yield f"blk.{i}.{name}.weight", _random_blocks(rng, kind, rows, cols, 1e-4), kind
            if shape.arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                yield f"blk.{i}.{name}.bias", (0.01 * rng.standard_normal(rows)).astype(np.float32), None
        norms = ("ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm") if gemma else \
            ("ffn_norm",)  # fmt: skip
        for name in norms:
            yield f"blk.{i}.{name}.weight", np.ones(shape.dim if name in ("attn_q_norm", "attn_k_norm") else h,
                                                    np.float32), None  # fmt: skip
    yield "output_norm.weight", np.ones(h, np.float32), None
    if not shape.tied:
        yield "output.weight", _random_blocks(rng, _kind("Q6_K", h), vocab, h, 2e-5), _kind("Q6_K", h)


# general.file_type: llama.cpp's MOSTLY_Q4_K_M, _Q3_K_M, _Q2_K, _IQ4_XS
FILE_TYPES = {"q4_k_m": 15, "q3_k": 12, "q2_k": 10, "iq4_xs": 30}


def _copy_metadata(writer, reader, shape: Shape, name: str, mix: str = "q4_k_m") -> None:
    """Every key/value of the donor file (a ``GGUFReader``) but its dimensions (the tokenizer and chat template
    carry over)."""
    arch = shape.arch
    head_dim = shape.dim
    dims = {f"{arch}.block_count": shape.layers, f"{arch}.embedding_length": shape.hidden,
            f"{arch}.feed_forward_length": shape.ffn, f"{arch}.attention.head_count": shape.heads,
            f"{arch}.attention.head_count_kv": shape.kv_heads, f"{arch}.rope.dimension_count": head_dim,
            f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim}  # fmt: skip
    if shape.llama3_rope:
        dims[f"{arch}.rope.freq_base"] = LLAMA3_THETA
    _copy_fields(writer, reader, {**dims, "general.name": f"synthetic {name} (random weights)",
                                  "general.file_type": FILE_TYPES[mix]})  # fmt: skip


def _copy_fields(writer, reader, replaced: dict) -> None:
    """Every key/value of ``reader`` into ``writer``, those in ``replaced`` with its value (strings as strings,
    floats as float32, other numbers as uint32) and its keys that ``reader`` lacks added."""
    from gguf import GGUFValueType

    def put(key, value):
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        if key in replaced:
            put(key, replaced[key])
        elif kind == GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [str(bytes(field.parts[i]), "utf-8") if sub == GGUFValueType.STRING else field.parts[i][0].item()
                      for i in field.data]  # fmt: skip
            writer.add_array(key, values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, str(bytes(field.parts[field.data[0]]), "utf-8"))
        else:
            writer.add_key_value(key, field.parts[field.data[0]][0].item(), kind)
    for key in replaced.keys() - reader.fields.keys():
        put(key, replaced[key])


def rewrite_gguf(src: Path, out: Path, *, fields: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of GGUF file ``src`` at ``out`` with the key/values ``fields`` set (see :func:`_copy_fields`) and the
    float32 ``tensors`` (name -> array) added; every tensor of ``src`` kept as its bytes (tests and checks of
    what a file's metadata does, e.g. rotary scaling against llama.cpp)."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = GGUFWriter(str(out), arch)
    _copy_fields(writer, reader, fields or {})
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_synthetic(shape: str | Shape, out: Path, like: Path | None = None, seed: int = 0,
                    mix: str = "q4_k_m") -> Path:  # fmt: skip
    """Write the synthetic GGUF of ``shape`` (a key of :data:`SHAPES`, or a :class:`Shape`) to ``out``, its
    tokenizer from ``like`` (default: the built-in model of its family), its tensor types by ``mix`` (a key of
    :data:`MIXES`); returns ``out``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    if mix not in MIXES:
        raise InvalidInputError(f"unknown mix {mix!r}; known: {', '.join(MIXES)}")
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise InvalidInputError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        name, shape = shape, SHAPES[shape]
    else:
        name = f"{shape.arch}-{shape.layers}x{shape.hidden}"
    reader = GGUFReader(like if like is not None else _donor(shape.arch))
    donor_arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    if donor_arch != shape.arch:
        raise InvalidInputError(f"shape {name} needs a {shape.arch} GGUF file to copy the tokenizer from; "
                                f"{like} holds {donor_arch}")  # fmt: skip
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(out), shape.arch)
    _copy_metadata(writer, reader, shape, name, mix)
    rng = np.random.default_rng(seed)
    for name, array, kind in _tensors(shape, vocab, rng, mix):
        if kind is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return out


REQUANT_TYPES = {"q8_0": 7}  # type -> general.file_type (llama.cpp's MOSTLY_Q8_0)


def requantize(src: Path, out: Path, kind: str = "q8_0") -> Path:
    """A copy of GGUF file ``src`` at ``out`` with every quantised matrix requantised to ``kind`` (its values as
    ``src`` holds them, in ``kind``'s blocks; vectors and float tensors kept as they are): a real model's weights
    in the type many users download small models in (Q8_0), where only a lower-bit file is at hand.  The codes
    come from the lower-bit values, so the file measures speed, memory and how lower-bit copies agree with the
    model (``lowbit``), not Q8_0's own accuracy.  Returns ``out``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize

    if kind not in REQUANT_TYPES:
        raise InvalidInputError(f"unknown type {kind!r}; known: {', '.join(REQUANT_TYPES)}")
    target = GGMLQuantizationType[kind.upper()]
    reader = GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = GGUFWriter(str(out), arch)
    _copy_fields(writer, reader, {"general.file_type": REQUANT_TYPES[kind]})
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    for t in reader.tensors:
        if t.tensor_type in plain or len(t.shape) < 2 or t.tensor_type == target:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        codes = quantize(dequantize(t.data, t.tensor_type).astype(np.float32), target)
        writer.add_tensor(t.name, codes, raw_shape=codes.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return out


def _gguf_file(name_or_path: str) -> Path:
    """A GGUF file by its path, or a built-in model's by its name."""
    from ..model.models import BUILTINS

    if Path(name_or_path).is_file():
        return Path(name_or_path)
    if name_or_path not in BUILTINS:
        raise InvalidInputError(f"{name_or_path}: no such file, nor a built-in model ({', '.join(BUILTINS)})")
    return _builtin_file(name_or_path, f"{name_or_path} is not installed: run")


def _donor(arch: str) -> Path:
    """The built-in model's GGUF file of family ``arch`` (its tokenizer is copied)."""
    return _builtin_file(DEFAULT_DONOR[arch], f"no {arch} GGUF file to copy a tokenizer from: pass --like FILE or run")


def _builtin_file(name: str, not_installed: str) -> Path:
    """Built-in model ``name``'s GGUF file; where it is not installed, an error saying ``not_installed`` and the
    command that installs it."""
    from ..model.models import BUILTINS, _builtin_gguf

    builtin = BUILTINS[name]
    if not builtin.installed():
        raise InvalidInputError(f"{not_installed} `selfspec models install {builtin.name}`")
    return _builtin_gguf(builtin)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--like", type=Path, help="a GGUF file of the shape's family whose tokenizer is copied "
                        "(default: the built-in model of that family)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mix", default="q4_k_m", choices=list(MIXES),
                        help="tensor types: llama.cpp's Q4_K_M recipe (default), or Q3_K / Q2_K / IQ4_XS in its place")
    parser.add_argument("--requantize", metavar="FILE",
                        help="instead: the weights of FILE (or of a built-in model, by name) with every quantised "
                        "matrix in --type (see requantize)")
    parser.add_argument("--type", default="q8_0", choices=list(REQUANT_TYPES), help="--requantize's type")
    args = parser.parse_args(argv)
    try:
        if args.requantize is not None:
            print(requantize(_gguf_file(args.requantize), args.out, args.type))
        else:
            print(write_synthetic(args.shape, args.out, args.like, args.seed, args.mix))
    except InvalidInputError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
