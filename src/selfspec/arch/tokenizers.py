"""What selfspec keeps of a transformers tokenizer: the HF internals of tokenizers in one place.

transformers 5's fast tokenizers (``TokenizersBackend``: Qwen2, Llama, Gemma) keep the vocabulary and merge
list they built their Rust tokenizer from as Python objects (``_vocab``, ``_merges``), which nothing reads
after ``__init__``: 150-260k strings and tuples, 30-90 MB for a 152k-262k vocabulary.  :func:`slim` drops them.
"""

from __future__ import annotations

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
