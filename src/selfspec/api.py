"""The Python API: ``generate``, ``stream`` and ``Session``.

    import selfspec
    model = selfspec.load("smollm2-135m")
    result = selfspec.generate(model, [{"role": "user", "content": "Hi!"}], max_new_tokens=64)  # method "auto"
    print(result.text, result.stats.mean_generated_length)

A :class:`Session` keeps what a method learns between prompts (for instance
Draft & Verify's confidence threshold, SWIFT's skip set); the module-level
functions start a fresh one per call.  A Session also keeps the keys and values of its recent sequences
(:class:`~selfspec.core.prefix_store.PrefixStore`, ``prefix_cache`` MB, default 256): a next turn that extends
an earlier prompt and answer prefills only its new tokens, with the same output as a whole prefill.

Decoding is greedy unless ``temperature`` > 0; then ``top_k``, ``top_p``,
``min_p``, the penalties (``repetition_penalty``; OpenAI's ``presence_penalty``, ``frequency_penalty``, which
apply to greedy decoding too) and ``seed`` apply, and every method samples
exactly from the model's (warped) distribution: by default with coupled
(Gumbel-max) sampling, where a seed fixes the very tokens whatever the method
(see :mod:`selfspec.core.sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .core.prefix_store import DEFAULT_MB, PrefixStore
from .core.sampling import SamplingParams
from .cost.costs import prepare_costs
from .decoding.batch import StepBatcher
from .decoding.limits import check_token_ids, is_token_ids
from .decoding.logprobs import TokenLogprob
from .decoding.loop import Decoder, GenerationStats
from .methods import build_policies
from .model.models import Model, load

Prompt = str | Sequence[dict] | Sequence[int]  # raw text, chat messages, or token ids

# Streaming decodes the whole text after each round (exact: a tokenizer may join or respell tokens across any
# boundary), which grows with the text: 0.2 ms at 1k tokens, 0.9 ms at 4k, against a 3 ms round of SmolLM2.  Past
# STREAM_WHOLE_TOKENS tokens a text is decoded again only once this share of the time since its last decoding
# has gone to it (pieces then hold several rounds' tokens: at 4k tokens about one piece per 45 ms)
STREAM_WHOLE_TOKENS = 256
STREAM_DECODE_SHARE = 0.02


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] | None = None  # per new token, when asked for (decoding/logprobs.py)


class Session:
    """One method on one model, with its state carried across prompts.

    Not thread-safe: the policies and the drafter's economy change during a generation.  Use one session per
    thread; sessions of one model may generate at the same time (the engine runs one pass at a time), and
    with one shared ``batcher`` their verification passes run together.

    ``prefix_cache``: the bound in MB of the session's own prefix store (default 256; 0: none), or a
    :class:`~selfspec.core.prefix_store.PrefixStore` to share (a server's sessions share one).
    ``batcher``: a :class:`~selfspec.decoding.batch.StepBatcher` shared by sessions generating at the same
    time, one per thread, on one model: their verification passes then run together (a server's slots).
    """

    def __init__(self, model: Model | str, method: str = "auto", *, prefix_cache: float | PrefixStore | None = None,
                 batcher: StepBatcher | None = None, **options: Any) -> None:  # fmt: skip
        self.model = load(model) if isinstance(model, str) else model
        self.batcher = batcher
        self.method = method
        self.options = options
        if isinstance(prefix_cache, PrefixStore):
            self.prefix_store = prefix_cache
        else:
            self.prefix_store = PrefixStore.of_mb(DEFAULT_MB if prefix_cache is None else float(prefix_cache))
        self.skip_policy, self.draft_policy = build_policies(method, options, self.model)
        prepare_costs(self.model, self.skip_policy, self.draft_policy)  # measured now, never inside a timed run
        self.last_result: GenerationResult | None = None

    @property
    def last_stats(self) -> GenerationStats | None:
        return self.last_result.stats if self.last_result else None

    def _decoder(self, prompt: Prompt, max_new_tokens: int, sampling: SamplingParams,
                 logprobs: int | None = None) -> Decoder:  # fmt: skip
        if is_token_ids(prompt):
            ids = list(prompt)
            check_token_ids(self.model, ids)
        else:
            ids = self.model.encode(prompt)
        return Decoder(
            self.model,
            ids,
            max_new_tokens=max_new_tokens,
            method=self.method,
            skip_policy=self.skip_policy,
            draft_policy=self.draft_policy,
            sampling=sampling,
            prefix_store=self.prefix_store if self.prefix_store.enabled else None,
            batcher=self.batcher,
            logprobs=logprobs,
        )

    def generate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        sampling_scheme: str = "coupled",
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
        grammar: str | None = None,
    ) -> GenerationResult:
        """Greedy with ``temperature`` 0 (default); else sampled.  With the default ``sampling_scheme``
        ("coupled") a ``seed`` gives exactly the tokens vanilla sampling gives with that seed, for every
        method; "rejection" is classic speculative sampling (exact in distribution; a seed reproduces a run
        only where draft lengths do not follow measured times).  ``logprobs`` (0-20): the result also holds
        each new token's log-probability under the model and that many most likely alternatives.  ``grammar``:
        structured output, the text held to a JSON schema, a regular expression or a Lark grammar
        (``selfspec.grammar.json_schema(schema)``, ``.regex(pattern)``, ``.lark(text)``, ``.choice(options)``)."""
        params = SamplingParams(temperature, top_k, top_p, seed, min_p, repetition_penalty, sampling_scheme,
                                presence_penalty, frequency_penalty, dict(logit_bias or {}), grammar)  # fmt: skip
        decoder = self._decoder(prompt, max_new_tokens, params, logprobs)
        ids = [t for new in decoder for t in new]
        self.last_result = GenerationResult(self.model.decode(ids), tuple(ids), decoder.stats,
                                            _tuple(decoder.logprobs))  # fmt: skip
        return self.last_result

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        sampling_scheme: str = "coupled",
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
        grammar: str | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; ``last_result`` is set at the end (with ``logprobs``, the
        tokens' log-probabilities)."""
        params = SamplingParams(temperature, top_k, top_p, seed, min_p, repetition_penalty, sampling_scheme,
                                presence_penalty, frequency_penalty, dict(logit_bias or {}), grammar)  # fmt: skip
        for piece in self.pieces(prompt, max_new_tokens=max_new_tokens, sampling=params, logprobs=logprobs):
            yield piece.text

    def pieces(self, prompt: Prompt, *, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               logprobs: int | None = None) -> Iterator[Piece]:  # fmt: skip
        """Per round of decoding (past ``STREAM_WHOLE_TOKENS`` tokens, per few rounds: ``STREAM_DECODE_SHARE``),
        the new text with how many tokens it holds and how many of those came from
        the draft (a server marks them), and with ``logprobs`` those tokens' log-probabilities; ``last_result``
        is set at the end.  Closing the iterator stops the generation after the current round (``last_result``
        is then None)."""
        decoder = self._decoder(prompt, max_new_tokens, sampling or SamplingParams(), logprobs)
        told = 0  # tokens whose log-probabilities went out with a piece
        self.last_result = None  # set only when the generation runs to its end
        ids: list[int] = []
        shown, tokens, drafted, first = "", 0, 0, True
        decode_at = 0.0  # a long text is decoded again from this time on (see STREAM_DECODE_SHARE)
        rounds = iter(decoder)
        try:
            for new in rounds:
                ids.extend(new)
                tokens += len(new)
                drafted += 0 if first else len(new) - 1  # a round: accepted drafts, then the full model's token
                first = False
                now = time.perf_counter()
                if len(ids) > STREAM_WHOLE_TOKENS and now < decode_at:
                    continue  # the next piece holds these tokens too
                text = self.model.decode(ids)
                decode_at = now + (time.perf_counter() - now) / STREAM_DECODE_SHARE
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
                    continue
                if len(text) > len(shown) and text.startswith(shown):
                    yield Piece(text[len(shown) :], tokens, drafted, _since(decoder.logprobs, told))
                    tokens = drafted = 0
                    told = len(ids)
                shown = text
        finally:  # a consumer that stops early closes the decoder now, so the method saves its state
            rounds.close()
        final = self.model.decode(ids)
        self.last_result = GenerationResult(final, tuple(ids), decoder.stats, _tuple(decoder.logprobs))
        # the last tokens even where they add no text (an end-of-sequence token): the pieces' counts sum to the
        # generation's tokens whatever rounds they came in (a server's usage is the same for every method)
        tail = final[len(shown) :] if final.startswith(shown) else ""
        if tail or tokens:
            yield Piece(tail, tokens, drafted, _since(decoder.logprobs, told))


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: int  # new tokens behind this text
    drafted: int  # of which accepted from the draft
    logprobs: tuple[TokenLogprob, ...] = ()  # of those tokens, when asked for


def _tuple(logprobs: list[TokenLogprob] | None) -> tuple[TokenLogprob, ...] | None:
    return None if logprobs is None else tuple(logprobs)


def _since(logprobs: list[TokenLogprob] | None, start: int) -> tuple[TokenLogprob, ...]:
    return () if logprobs is None else tuple(logprobs[start:])


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "sampling_scheme",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "grammar")  # fmt: skip


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    sampling = {k: options.pop(k) for k in SAMPLING_KEYS if k in options}
    return options, sampling


def generate(
    model: Model | str, prompt: Prompt, method: str = "auto", *, max_new_tokens: int = 128, **options: Any
) -> GenerationResult:
    """Generate with ``method`` (see ``selfspec.METHODS``); the keywords of :meth:`Session.generate`
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias``, ``seed``, ``sampling_scheme``) choose sampling (default greedy),
    ``logprobs`` asks for the tokens' log-probabilities, ``grammar`` holds the text to a structure
    (:mod:`selfspec.grammar`); every other keyword is an option of the method."""
    method_options, sampling = _split(dict(options))
    session = Session(model, method, prefix_cache=0, **method_options)  # one call: nothing to reuse later
    return session.generate(prompt, max_new_tokens=max_new_tokens, **sampling)


def stream(
    model: Model | str, prompt: Prompt, method: str = "auto", *, max_new_tokens: int = 128, **options: Any
) -> Iterator[str]:
    """Like :func:`generate`, yielding text pieces as soon as they are accepted."""
    method_options, sampling = _split(dict(options))
    session = Session(model, method, prefix_cache=0, **method_options)
    yield from session.stream(prompt, max_new_tokens=max_new_tokens, **sampling)
