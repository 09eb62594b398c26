"""OpenAI's ``logprobs`` objects for the tokens of a reply: the chat form (``content``: token, logprob, bytes,
top_logprobs) and the legacy completions form (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``).  A token's text is its own bytes (:func:`selfspec.arch.tokenizers.token_bytes`) read as UTF-8,
a byte that is part of a character split over tokens written as ``\\xNN``, as OpenAI writes it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from ..arch.tokenizers import token_bytes
from ..decoding.logprobs import TokenLogprob


class LogprobFormatter:
    """Formats one model's token log-probabilities; token texts are cached (a top-20 list names many).
    ``decode``: a token's text as the replies' text shows it; a token that shows none there (the end of
    sequence, other special tokens) has the empty text and no bytes."""

    def __init__(self, tokenizer: Any, decode: Callable[[int], str]) -> None:
        spell = token_bytes(tokenizer)
        self._bytes = lru_cache(maxsize=65536)(lambda token: spell(token) if decode(token) else b"")

    def text(self, token: int) -> str:
        return self._bytes(token).decode("utf-8", errors="backslashreplace")

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self._bytes(token))}

    def chat(self, items: Sequence[tuple[int, TokenLogprob]]) -> dict[str, Any]:
        """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
        return {"content": [{**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
                            for _, e in items]}  # fmt: skip

    def completion(self, items: Sequence[tuple[int, TokenLogprob]], top: int) -> dict[str, Any]:
        """``choices[i].logprobs`` of a text completion (or chunk); ``text_offset`` counts characters from the
        start of the completion's text."""
        return {
            "tokens": [self.text(e.token) for _, e in items],
            "token_logprobs": [e.logprob for _, e in items],
            "top_logprobs": [None if e.logprob is None else {self.text(t): lp for t, lp in e.top} for _, e in items]
            if top else None,  # (an echoed prompt's first token: nothing predicts it)
            "text_offset": [at for at, _ in items],
        }
