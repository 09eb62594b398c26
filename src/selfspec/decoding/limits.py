"""The lengths a generation may have: its prompt and new tokens within the model's context, checked before any
pass runs, with a message saying what to change."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidInputError
from ..model.models import Model


def check_lengths(model: Model, prompt_len: int, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ctx = model.max_context
    if prompt_len >= ctx:
        raise InvalidInputError(f"the prompt is {prompt_len} tokens, longer than the model's context of {ctx} tokens")
    if prompt_len + max_new_tokens > ctx:
        raise InvalidInputError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{ctx} tokens; lower max_new_tokens to at most {ctx - prompt_len}"
        )


def check_token_ids(model: Model, ids: list[int]) -> None:
    """A prompt given as token ids: non-empty, each an id of the model's vocabulary (an id beyond it would
    fail deep inside the embedding lookup)."""
    if not ids:
        raise InvalidInputError("the prompt is empty (no token ids)")
    size = model.adapter.vocab_size
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < size), None)
    if bad is not None:
        raise InvalidInputError(f"token id {bad!r} is not in the model's vocabulary (ids 0 to {size - 1})")


def is_token_ids(prompt: Any) -> bool:
    """Whether a prompt is given as token ids (a non-empty sequence of ints), not text or chat messages."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0 \
        and all(isinstance(t, int) for t in prompt)  # fmt: skip
