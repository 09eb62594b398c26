"""Structured output: the model's choices held to a JSON schema, a regular expression or a Lark grammar.

A grammar is given as a string in llguidance's format (``json_schema``, ``regex`` and ``lark`` below make one),
carried by :class:`~selfspec.core.sampling.SamplingParams` (``grammar``), and followed during a generation by a
:class:`Constraint`: llguidance's matcher (the Earley parser behind vLLM's, SGLang's and llama.cpp's guided
decoding; Rust, a few tens of microseconds a token) says after any output which tokens may come next.

It stays exact under speculation because the constraint is part of the model: wherever a token is chosen (a
verification row, vanilla's step, a draft's ranking), the logits of every token the grammar forbids after that
row's own output are set to -inf before the bias, the penalties, the temperature and the cuts.  Each row of a
verification pass is masked by the output its own path holds (the committed text, then the drafts before it), so
every method emits vanilla's tokens under greedy decoding and a seed, and samples the constrained distribution.
A drafted token the grammar forbids is never the model's choice: its chain ends there, as any wrong draft's does;
rows after it are never read (they get no mask).  The matcher follows the rows by rolling back to the longest
prefix it shares with the next row's output, so a round costs a mask per row (cached per output).

When the grammar is complete only the end-of-sequence tokens are allowed, so the generation stops there; a
generation cut by ``max_new_tokens`` may end inside the structure (as OpenAI's ``finish_reason: length``).
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidInputError

MASK_CACHE = 256  # masks kept per generation, by output (a round's rows, the draft's steps, the next round's root)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> (vocab size, llguidance's)


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # (a dependency of the package; a hand-made environment may lack it)
        raise InvalidInputError("structured output needs the llguidance package: pip install llguidance") from exc
    return llguidance


def json_schema(schema: dict | str | None = None) -> str:
    """A grammar for JSON text matching ``schema`` (a dict or its JSON text); None: any JSON object (OpenAI's
    ``response_format: {"type": "json_object"}``)."""
    if schema is None:
        schema = {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidInputError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
    return _llguidance().LLMatcher.grammar_from_json_schema(schema)


def regex(pattern: str) -> str:
    """A grammar for text matching the regular expression ``pattern`` (the whole output)."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidInputError("a regular expression must be a non-empty string")
    return _llguidance().LLMatcher.grammar_from_regex(pattern)


def lark(text: str) -> str:
    """A grammar in Lark's syntax (llguidance's dialect: ``start: ...`` rules, terminals as regular expressions)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("a Lark grammar must be a non-empty string")
    return _llguidance().LLMatcher.grammar_from_lark(text)


def choice(options: Sequence[str]) -> str:
    """A grammar for exactly one of ``options`` (vLLM's ``guided_choice``)."""
    options = list(options)
    if not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidInputError("choices must be a non-empty list of non-empty strings")
    return lark("start: " + " | ".join(json.dumps(o) for o in options))


_MAKERS = {"json_schema": json_schema, "regex": regex, "choice": choice, "lark": lark}
KINDS = tuple(_MAKERS)  # the ways to give a structure, by the argument each takes


def of(kind: str, value: Any) -> str:
    """The grammar of a structure given as ``kind`` (one of KINDS) and its value (a schema, a pattern, a list of
    texts, a Lark grammar)."""
    if kind not in _MAKERS:
        raise InvalidInputError(f"unknown kind of structure {kind!r}; one of {', '.join(KINDS)}")
    return _MAKERS[kind](value)


def _tokenizer(model: Any):
    """llguidance's view of the model's tokenizer (built once per tokenizer: about a second), with the logits'
    width as its vocabulary and the model's end-of-sequence tokens as its ends."""
    vocab_size = model.adapter.vocab_size
    held = _TOKENIZERS.get(model.tokenizer)
    if held is not None and held[0] == vocab_size:
        return held[1]
    from llguidance.hf import from_tokenizer

    eos = sorted(model.eos_token_ids)
    try:
        ll = from_tokenizer(model.tokenizer, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, TypeError):  # a slow tokenizer, or one whose decoder llguidance does not know
        ll = _llguidance().LLTokenizer(_TokenBytes(model, vocab_size, eos).wrapper, n_vocab=vocab_size, eos_token=eos)
    _TOKENIZERS[model.tokenizer] = (vocab_size, ll)
    return ll


class _TokenBytes:
    """A tokenizer as llguidance's generic wrapper reads one: each id's bytes (arch/tokenizers.token_bytes; special
    and unused ids marked with llguidance's 0xFF prefix, so no text matches them) and an encoder."""

    def __init__(self, model: Any, vocab_size: int, eos: list[int]) -> None:
        from ..arch.tokenizers import token_bytes

        tok = model.tokenizer
        special = set(getattr(tok, "all_special_ids", []) or []) | set(eos)
        size = len(tok) if hasattr(tok, "__len__") else vocab_size
        bytes_of = token_bytes(tok)
        self.tokens = [b"\xff[%d]" % i if i in special or i >= size else bytes_of(i) for i in range(vocab_size)]
        self.eos_token_id, self.bos_token_id = eos[0] if eos else 0, getattr(tok, "bos_token_id", None)
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self._tokenizer = tok
        self.wrapper = _llguidance().TokenizerWrapper(self)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def check(model: Any, grammar: str) -> None:
    """Refuse a grammar that llguidance cannot compile for this model, with its message."""
    Constraint(model, grammar, prompt_len=0)


class Constraint:
    """One generation's grammar: per row of logits, which tokens may follow that row's output."""

    def __init__(self, model: Any, grammar: str, *, prompt_len: int) -> None:
        llg = _llguidance()
        if not isinstance(grammar, str) or not grammar:
            raise InvalidInputError("a grammar must be a non-empty string (see selfspec.grammar)")
        self.matcher = llg.LLMatcher(_tokenizer(model), grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidInputError(f"the grammar does not compile: {self.matcher.get_error().strip()}")
        self.prompt_len = prompt_len
        self._consumed: list[int] = []  # the output the matcher has read
        self._masks: OrderedDict[tuple[int, ...], torch.Tensor | None] = OrderedDict()

    def allowed(self, history: Sequence[int]) -> torch.Tensor | None:
        """The tokens that may follow ``history`` (prompt, then output): a bool tensor ``[V]``; None where the
        output already holds a token the grammar forbids (a draft's: that row's choice is never read)."""
        out = tuple(history[self.prompt_len :])
        if out in self._masks:
            self._masks.move_to_end(out)
            return self._masks[out]
        mask = self._compute(out)
        self._masks[out] = mask
        if len(self._masks) > MASK_CACHE:
            self._masks.popitem(last=False)
        return mask

    def forced(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after ``history`` (a JSON schema's keys and punctuation, a
        choice's rest once it is told apart): a free draft, verified as any draft is (the model may still spell
        the forced text with other tokens)."""
        if limit <= 0 or not self._seek(tuple(history[self.prompt_len :])):
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def _seek(self, out: tuple[int, ...]) -> bool:
        """Bring the matcher to ``out`` (rolling back to the prefix it shares with what it has read); False if
        ``out`` holds a token the grammar forbids (the matcher then stands at the longest allowed prefix)."""
        done = self._consumed
        same = 0
        for a, b in zip(done, out, strict=False):
            if a != b:
                break
            same += 1
        if same < len(done):
            self.matcher.rollback(len(done) - same)
            del done[same:]
        rest = list(out[same:])
        if rest:
            n = self.matcher.try_consume_tokens(rest)
            done.extend(rest[:n])
            if n < len(rest):
                return False
        return True

    def _compute(self, out: tuple[int, ...]) -> torch.Tensor | None:
        if not self._seek(out):
            return None
        if self.matcher.is_error():  # (not reached by try_consume_tokens; a matcher in error allows nothing)
            raise RuntimeError(f"grammar matcher failed: {self.matcher.get_error()}")
        mask = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) != 0
        return mask if bool(mask.any()) else None

    def apply(self, x: torch.Tensor, histories: Sequence[Sequence[int]],
              columns: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """``x`` (logits ``[R, V]``, or ``[R, V']`` over a subset whose ids ``columns`` maps to its columns) with
        the tokens each row's grammar forbids at -inf (a new tensor)."""
        x = x.clone()
        rows = x.reshape(-1, x.shape[-1])
        if len(histories) != rows.shape[0]:
            raise ValueError(f"{len(histories)} histories for {rows.shape[0]} rows")
        for row, history in zip(rows, histories, strict=True):
            mask = self.allowed(history)
            if mask is None:
                continue
            if columns is not None:
                ids = mask.nonzero().squeeze(1)
                cols = columns(ids)
                keep = torch.zeros(row.shape[-1], dtype=torch.bool)
                keep[cols[cols >= 0]] = True
                if not bool(keep.any()):  # nothing allowed is in the draft's vocabulary: its guess is wrong anyway
                    continue
                mask = keep
            else:
                mask = mask[: row.shape[-1]]
            row.masked_fill_(~mask.to(row.device), float("-inf"))
        return x
