"""The decode loop: vanilla and self-speculative (greedy, chain drafts).

One round of self-speculative decoding, as in gpt-fast's speculative step:

1. draft   -- run the model with the policy's skip set, one token at a time,
              until the draft-length policy says stop;
2. verify  -- one full-model forward over [last token, draft...];
3. accept  -- the longest prefix of the draft that equals the full model's
              argmax, plus the full model's next token (the bonus);
4. cache   -- commit exactly the accepted entries (rollback = length update);
5. observe -- tell the policies how the round went.

Vanilla decoding is the same loop with no drafter: every round is one
full-model forward producing one token.  Run ``python -m selfspec.decoding``
for a smoke test on the default model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .cache import KVCache
from .engine import SublayerCosine
from .errors import InvalidInputError
from .models import Model
from .skipset import SkipSet


@dataclass(frozen=True)
class GenerationStats:
    method: str
    prompt_tokens: int
    new_tokens: int
    forwards: int  # full-model forwards, prefill included (vanilla: one per token)
    draft_forwards: int
    drafted: int
    accepted: int
    prefill_time: float
    draft_time: float
    verify_time: float
    total_time: float
    stop_reason: str  # "eos" | "length"
    skip_set: dict[str, Any] | None = None
    cosine: dict[str, list[float]] | None = None  # prefill's per-sublayer cosine, when measured
    accept_lengths: tuple[int, ...] = field(default=(), repr=False)  # accepted drafts per round

    @property
    def mean_generated_length(self) -> float:
        """M: new tokens per full-model forward (bonus token included)."""
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.total_time / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["accept_lengths"] = list(self.accept_lengths)
        d.update(
            M=self.mean_generated_length,
            acceptance_rate=self.acceptance_rate,
            tokens_per_second=self.tokens_per_second,
            ms_per_token=self.ms_per_token,
        )
        return d


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


@dataclass(frozen=True)
class Prefill:
    """A prompt's full-model prefill, reusable by several decodings of that prompt.

    Decoding writes only at cache slots beyond the prompt, so the prompt's keys
    and values stay valid; every decoder rewinds the cache to the prompt before
    it starts.  Decoders that reuse a prefill report ``prefill_time`` 0 and
    leave it out of ``total_time``.  Not for concurrent use.
    """

    prompt_ids: tuple[int, ...]
    cache: KVCache
    first_token: int
    cosine: SublayerCosine | None


def prefill(
    model: Model, prompt_ids: list[int], *, max_new_tokens: int = 1, max_draft: int = 0, cosine: bool = False
) -> Prefill:
    """Run the full model over ``prompt_ids`` once, with room for decodings up to ``max_new_tokens``."""
    check_lengths(model, len(prompt_ids), max_new_tokens)
    engine = model.engine
    cache = engine.new_cache(len(prompt_ids) + max_new_tokens + max_draft + 1)
    out: list[SublayerCosine] = []
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=engine.device)
    logits = engine.forward(cache, ids, 0, last_only=True, cosine_out=out if cosine else None)
    cache.commit(len(prompt_ids))
    return Prefill(tuple(prompt_ids), cache, int(logits[-1].argmax()), out[0] if out else None)


def prefill_cosine(model: Model, prompt_ids: list[int]) -> SublayerCosine:
    """Per-sublayer cosine similarity of one full-model prefill over ``prompt_ids`` (no decoding)."""
    cos = prefill(model, prompt_ids, cosine=True).cosine
    assert cos is not None
    return cos


class Decoder:
    """Iterate to get the new tokens of each round; ``stats`` once exhausted."""

    def __init__(
        self,
        model: Model,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        method: str = "vanilla",
        skip_policy=None,
        draft_policy=None,
        prefill: Prefill | None = None,
    ) -> None:
        check_lengths(model, len(prompt_ids), max_new_tokens)
        if (skip_policy is None) != (draft_policy is None):
            raise ValueError("a speculative decoder needs both a skip policy and a draft policy")
        self.model = model
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.method = method
        self.skip_policy = skip_policy
        self.draft_policy = draft_policy
        self.prefill = prefill
        if prefill is not None:
            if prefill.prompt_ids != tuple(prompt_ids):
                raise ValueError("the prefill is of another prompt")
            need = len(prompt_ids) + max_new_tokens + (draft_policy.max_draft if draft_policy else 0) + 1
            if prefill.cache.capacity < need:
                raise ValueError(
                    f"the prefill's cache holds {prefill.cache.capacity} slots; this decoding needs {need}"
                )
            if skip_policy is not None and getattr(skip_policy, "needs_cosine", False) and prefill.cosine is None:
                raise ValueError("this skip policy needs the prefill's cosine statistics: prefill(..., cosine=True)")
        self.stats: GenerationStats | None = None

    def __iter__(self) -> Iterator[list[int]]:
        model, engine = self.model, self.model.engine
        device, eos = engine.device, model.eos_token_ids
        speculative = self.skip_policy is not None
        max_draft = self.draft_policy.max_draft if speculative else 0
        S, N = len(self.prompt_ids), self.max_new_tokens
        t_start = time.perf_counter()

        # 1. prefill with the full model (and the cosine statistics ASD needs), unless given
        want_cos = speculative and getattr(self.skip_policy, "needs_cosine", False)
        pf = self.prefill or prefill(model, self.prompt_ids, max_new_tokens=N, max_draft=max_draft, cosine=want_cos)
        cache, token = pf.cache, pf.first_token
        cache.commit(S)  # with a reused prefill: rewind to the prompt, what an earlier decoding wrote is scratch
        cosine = pf.cosine if want_cos else None
        prefill_time = time.perf_counter() - t_start
        skip: SkipSet | None = None
        if speculative:
            skip = self.skip_policy.propose(cosine, engine.num_layers)

        out = [token]
        forwards, draft_forwards, drafted_total, accepted_total = 1, 0, 0, 0
        draft_time = verify_time = 0.0
        accept_lengths: list[int] = []
        stop_reason = "eos" if token in eos else "length"
        yield [token]

        while len(out) < N and token not in eos:
            c = cache.length  # `token` (the last bonus) sits at slot c, not yet in the cache
            budget = min(max_draft, N - len(out) - 1)  # never draft past max_new_tokens

            # 2. draft a chain with the skip set
            t0 = time.perf_counter()
            draft: list[int] = []
            last = token
            while len(draft) < budget:
                ids = torch.tensor([last], dtype=torch.long, device=device)
                probs = engine.forward(cache, ids, c + len(draft), skip=skip, last_only=True)[-1].softmax(-1)
                top1 = int(probs.argmax())
                draft.append(top1)
                last = top1
                if self.draft_policy.should_stop(len(draft), float(probs[top1])):
                    break
            t1 = time.perf_counter()

            # 3. verify every drafted token in one full-model forward
            ids = torch.tensor([token] + draft, dtype=torch.long, device=device)
            target = engine.forward(cache, ids, c).argmax(-1).tolist()  # [k+1] full model's greedy choices
            verify_time += time.perf_counter() - t1
            draft_time += t1 - t0
            forwards += 1
            draft_forwards += len(draft)

            # 4. accept the longest matching prefix plus the bonus token; keep their cache entries
            a = 0
            while a < len(draft) and draft[a] == target[a]:
                a += 1
            cache.commit(c + 1 + a)
            new = target[: a + 1]  # == draft[:a] + [bonus]
            if draft:
                drafted_total += len(draft)
                accepted_total += a
                accept_lengths.append(a)
                self.draft_policy.observe(len(draft), a)
                self.skip_policy.observe(len(draft), a)

            # 5. stop at EOS or at the length limit
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    stop_reason = "eos"
                    break
            new = new[: N - len(out)]
            out.extend(new)
            token = new[-1]
            yield new

        self.stats = GenerationStats(
            method=self.method,
            prompt_tokens=S,
            new_tokens=len(out),
            forwards=forwards,
            draft_forwards=draft_forwards,
            drafted=drafted_total,
            accepted=accepted_total,
            prefill_time=prefill_time,
            draft_time=draft_time,
            verify_time=verify_time,
            total_time=time.perf_counter() - t_start,
            stop_reason=stop_reason if out[-1] in eos else "length",
            skip_set=skip.to_dict() if skip is not None else None,
            cosine={"attention": list(cosine.attention), "mlp": list(cosine.mlp)} if cosine else None,
            accept_lengths=tuple(accept_lengths),
        )
