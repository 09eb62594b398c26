"""What selfspec keeps of a transformers tokenizer: the HF internals of tokenizers in one place.

transformers 5's fast tokenizers (``TokenizersBackend``: Qwen2, Llama, Gemma) keep the vocabulary and merge
list they built their Rust tokenizer from as Python objects (``_vocab``, ``_merges``), which nothing reads
after ``__init__``: 150-260k strings and tuples, 30-90 MB for a 152k-262k vocabulary.  :func:`slim` drops them.
:func:`token_bytes` gives a token's own bytes (a character split over tokens, byte by byte), read from the
tokenizer's vocabulary entries and its decoder's kind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..core.heap import return_free_heap

_BUILD_SOURCES = ("_vocab", "_merges")  # read by the tokenizer classes' __init__ only (transformers 5.x)


def slim(tokenizer: Any) -> Any:
    """``tokenizer`` without the Python copies of its vocabulary and merges (where it has its Rust tokenizer,
    which holds both), their memory returned; the same object, for chaining."""
    if getattr(tokenizer, "_tokenizer", None) is None:  # a slow (Python) tokenizer reads its own tables
        return tokenizer
    kept = [name for name in _BUILD_SOURCES if isinstance(getattr(tokenizer, name, None), (dict, list))]
    for name in kept:
        setattr(tokenizer, name, type(getattr(tokenizer, name))())  # empty, of the type the class expects
    if kept:
        return_free_heap()
    return tokenizer


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """A function giving one token's own bytes (what OpenAI's ``logprobs`` call ``bytes``): a byte-level BPE
    token (GPT-2, Llama 3, Qwen2, SmolLM2) maps each character back to its byte, a SentencePiece token (Gemma,
    Llama 2) its ``▁`` to a space and ``<0xNN>`` to that byte, so a character split over tokens is given byte
    by byte; any other tokenizer the token's own decoded text."""
    decoder = _decoder_types(tokenizer)
    if "ByteLevel" in decoder:
        table = {c: b for b, c in _bytes_to_unicode().items()}

        def byte_level(token_id: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return _decoded(tokenizer, token_id)  # an added token ("<|im_end|>"), kept as text

        return byte_level
    if "ByteFallback" in decoder or "Metaspace" in decoder:

        def sentencepiece(token_id: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if not isinstance(piece, str):
                return _decoded(tokenizer, token_id)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode()

        return sentencepiece
    return lambda token_id: _decoded(tokenizer, token_id)


def _decoded(tokenizer: Any, token_id: int) -> bytes:
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``type`` names in the Rust tokenizer's decoder (nested sequences included); empty without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    try:  # the decoder's own state (the whole tokenizer's JSON would spell out its vocabulary)
        spec = json.loads(backend.decoder.__getstate__()) if backend is not None else None
    except (AttributeError, TypeError, ValueError):
        return set()
    found: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.add(str(node.get("type")))
            stack.extend(node.get("decoders") or [])
    return found


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
