"""The decode loop: vanilla and self-speculative (greedy; chains and token trees).

One round of self-speculative decoding, as in gpt-fast's speculative step:

0. policy  -- the skip policy may refine its skip set first (SWIFT's
              optimisation step; a no-op for static sets and ASD);
1. draft   -- run the model with the skip set, one token at a time, until the
              draft-length policy says stop; a tree policy may add the
              draft's next-best tokens as extra leaves (SWIFT);
2. verify  -- one full-model forward over the linearised tree (a chain is the
              common case) with a tree attention mask;
3. accept  -- walk the tree along the full model's argmax: the longest drafted
              path it agrees with, plus the full model's next token (the bonus);
4. cache   -- move the accepted path's entries into place and commit them
              (rollback = length update);
5. observe -- tell the policies how the round went.

Vanilla decoding is the same loop with no drafter: every round is one
full-model forward producing one token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .acceptance import accept_greedy, accept_sampling
from ..core.cache import KVCache
from ..model.engine import SublayerCosine
from ..errors import InvalidInputError
from ..model.models import Model
from ..core.sampling import GREEDY, SamplingParams, sample, warp
from ..core.skipset import SkipSet


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
    optimise_time: float = 0.0  # SWIFT's skip-set optimisation steps
    skip_set: dict[str, Any] | None = None
    cosine: dict[str, list[float]] | None = None  # prefill's per-sublayer cosine, when measured
    accept_lengths: tuple[int, ...] = field(default=(), repr=False)  # accepted drafts per round
    verified_tokens: int = 0  # tokens through verification passes (tree nodes included)
    draft_precision: str | None = None

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
    first_token: int  # the greedy one
    cosine: SublayerCosine | None
    last_logits: torch.Tensor | None = None  # [V], for sampling the first token


def prefill(
    model: Model, prompt_ids: list[int], *, max_new_tokens: int = 1, max_nodes: int = 1, cosine: bool = False
) -> Prefill:
    """Run the full model over ``prompt_ids`` once, with room for decodings up to ``max_new_tokens``.

    ``max_nodes``: the most tokens one verification pass of the decodings will hold.
    """
    check_lengths(model, len(prompt_ids), max_new_tokens)
    engine = model.engine
    cache = engine.new_cache(len(prompt_ids) + max_new_tokens + max_nodes)
    out: list[SublayerCosine] = []
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=engine.device)
    logits = engine.forward(cache, ids, 0, last_only=True, cosine_out=out if cosine else None)
    cache.commit(len(prompt_ids))
    return Prefill(tuple(prompt_ids), cache, int(logits[-1].argmax()), out[0] if out else None, logits[-1])


def prefill_cosine(model: Model, prompt_ids: list[int]) -> SublayerCosine:
    """Per-sublayer cosine similarity of one full-model prefill over ``prompt_ids`` (no decoding)."""
    cos = prefill(model, prompt_ids, cosine=True).cosine
    assert cos is not None
    return cos


@dataclass(frozen=True)
class RoundContext:
    """What a skip policy sees before a round (SWIFT scores candidate skip sets on the generated text)."""

    model: Model
    cache: KVCache
    prompt_len: int
    generated: list[int]  # new tokens so far; the last one is pending (not in the cache yet)
    skip: SkipSet


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
        sampling: SamplingParams = GREEDY,
    ) -> None:
        check_lengths(model, len(prompt_ids), max_new_tokens)
        self.sampling = sampling
        if (skip_policy is None) != (draft_policy is None):
            raise ValueError("a speculative decoder needs both a skip policy and a drafter")
        self.model = model
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.method = method
        self.skip_policy = skip_policy
        self.drafter = draft_policy
        self.prefill = prefill
        if prefill is not None:
            if prefill.prompt_ids != tuple(prompt_ids):
                raise ValueError("the prefill is of another prompt")
            need = len(prompt_ids) + max_new_tokens + self._max_nodes
            if prefill.cache.capacity < need:
                raise ValueError(
                    f"the prefill's cache holds {prefill.cache.capacity} slots; this decoding needs {need}"
                )
            if skip_policy is not None and getattr(skip_policy, "needs_cosine", False) and prefill.cosine is None:
                raise ValueError("this skip policy needs the prefill's cosine statistics: prefill(..., cosine=True)")
        self.stats: GenerationStats | None = None

    @property
    def _max_nodes(self) -> int:
        return self.drafter.max_nodes if self.drafter is not None else 1

    def __iter__(self) -> Iterator[list[int]]:
        model, engine = self.model, self.model.engine
        device, eos = engine.device, model.eos_token_ids
        speculative = self.skip_policy is not None
        drafter = self.drafter
        S, N = len(self.prompt_ids), self.max_new_tokens
        t_start = time.perf_counter()

        # prefill with the full model (and the cosine statistics ASD needs), unless given
        want_cos = speculative and getattr(self.skip_policy, "needs_cosine", False)
        pf = self.prefill or prefill(model, self.prompt_ids, max_new_tokens=N, max_nodes=self._max_nodes,
                                     cosine=want_cos)  # fmt: skip
        cache = pf.cache
        sampling = self.sampling
        gen = None if sampling.greedy else sampling.generator(device)
        if gen is None:
            token = pf.first_token
        else:
            token = sample(warp(pf.last_logits, sampling), gen)
        cache.commit(S)  # with a reused prefill: rewind to the prompt, what an earlier decoding wrote is scratch
        cosine = pf.cosine if want_cos else None
        prefill_time = time.perf_counter() - t_start
        skip: SkipSet | None = None
        if speculative:
            bind = getattr(self.skip_policy, "bind", None)
            if bind is not None:
                bind(model, drafter)
            skip = self.skip_policy.propose(cosine, engine.num_layers)
            drafter.bind(model, skip)
        refine = getattr(self.skip_policy, "before_round", None)

        out = [token]
        forwards, draft_forwards, drafted_total, accepted_total, verified = 1, 0, 0, 0, 0
        draft_time = verify_time = optimise_time = 0.0
        accept_lengths: list[int] = []
        stop_reason = "eos" if token in eos else "length"
        yield [token]

        while len(out) < N and token not in eos:
            c = cache.length  # `token` (the last bonus) sits at slot c, not yet in the cache
            budget = N - len(out) - 1  # never draft past max_new_tokens

            # 0. the skip policy may refine its set before the round (SWIFT)
            t0 = time.perf_counter()
            if refine is not None:
                new_skip = refine(RoundContext(model, cache, S, out, skip))
                if new_skip != skip:
                    skip = new_skip
                    drafter.bind(model, skip)
            t1 = time.perf_counter()
            if refine is not None:
                optimise_time += t1 - t0

            # 1. draft (a chain, or a tree of candidates)
            outcome = drafter.draft(model, cache, c, token, skip, budget, sampling, gen) if speculative else None
            t2 = time.perf_counter()
            tree = outcome.tree if outcome is not None else None

            # 2. verify every candidate in one full-model forward
            if tree is None or len(tree) == 1:
                ids = torch.tensor([token], dtype=torch.long, device=device)
                logits = engine.forward(cache, ids, c, last_only=True)  # [1, V]
                path = [0]
                if gen is None:
                    bonus = int(logits[-1].argmax())
                else:
                    bonus = sample(warp(logits[-1], sampling), gen)
            else:
                ids = torch.tensor(tree.tokens, dtype=torch.long, device=device)
                mask = tree.attention_mask(device)
                positions = tree.positions(c, device) if mask is not None else None
                logits = engine.forward(cache, ids, c, positions=positions, tree_mask=mask)  # [T, V]
                # 3. accept: the longest path the full model agrees with (greedy) or keeps (speculative
                #    sampling), plus its next token
                if gen is None:
                    path, bonus = accept_greedy(tree, logits.argmax(-1).tolist())
                else:
                    path, bonus = accept_sampling(tree, warp(logits, sampling), gen)
            t3 = time.perf_counter()
            draft_time += t2 - t1
            verify_time += t3 - t2
            forwards += 1
            verified += len(tree) if tree is not None else 1

            # 4. keep exactly the accepted entries: move the path into place, commit
            cache.move([c + n for n in path], c)
            cache.commit(c + len(path))
            new = [tree.tokens[n] for n in path[1:]] + [bonus] if tree is not None else [bonus]

            # 5. stop at EOS or at the length limit
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    stop_reason = "eos"
                    break
            new = new[: N - len(out)]
            out.extend(new)
            token = new[-1]

            # 6. observe
            if speculative:
                if outcome is not None and outcome.steps:
                    drafted_total += outcome.steps
                    draft_forwards += outcome.passes if outcome.passes is not None else outcome.steps
                    accepted_total += len(path) - 1
                    accept_lengths.append(len(path) - 1)
                    self.skip_policy.observe(outcome.steps, len(path) - 1)
                drafter.observe(outcome, path, tokens=len(new), round_ms=1000 * (time.perf_counter() - t1),
                                draft_ms=1000 * (t2 - t1), verify_ms=1000 * (t3 - t2))  # fmt: skip
            yield new

        finish = getattr(self.skip_policy, "finish", None)
        if finish is not None:
            finish()
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
            optimise_time=optimise_time,
            skip_set=skip.to_dict() if skip is not None else None,
            cosine={"attention": list(cosine.attention), "mlp": list(cosine.mlp)} if cosine else None,
            accept_lengths=tuple(accept_lengths),
            verified_tokens=verified,
            draft_precision=drafter.precision(model) if speculative else None,
        )
