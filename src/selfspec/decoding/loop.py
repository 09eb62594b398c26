"""The decode loop: vanilla and self-speculative (chains and token trees; greedy or sampled).

One round, as in gpt-fast's speculative step and the papers' algorithms
(:meth:`Decoder.__iter__` reads as these numbered stages):

0. adapt   -- a refining skip policy may change its skip set first (SWIFT's
              optimisation step; a no-op for static sets, ASD and S3D);
1. draft   -- the drafter proposes candidates after the token history: a chain,
              or a tree with the draft's next-best tokens as extra leaves;
              non-finite draft logits give a round without a draft;
2. verify  -- one full-model forward over the linearised tree (a chain is the
              common case) with a tree attention mask;
3. accept  -- the longest drafted path the full model agrees with (greedy and
              coupled sampling: its own choice, by exact match) or keeps
              (rejection sampling), plus its next token (the bonus);
4. commit  -- move the accepted path's cache entries into place and commit them
              (rollback = length update); stop at EOS or the length limit;
5. observe -- tell the drafter and the skip policy how the round went.

Vanilla decoding is the same loop with no drafter: every round is one
full-model forward producing one token.  A drafter needs no skip policy
(an n-gram drafter skips no layers).  Not for concurrent use: a decoder, its
drafter and its policies hold per-generation state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch

from ..core import clock
from ..core.cache import KVCache
from ..core.prefix_store import CosineMark, PrefixStore
from ..core.sampling import GREEDY, Sampler, SamplingParams, rows_maxima_finite
from ..core.skipset import SkipSet
from ..errors import SelfspecError
from ..model.engine import BatchItem, SublayerCosine
from ..model.models import Model
from .acceptance import accept_greedy, accept_sampling
from .batch import StepBatcher
from .grammar import Constraint
from .limits import check_lengths
from .logprobs import TokenLogprob, check_top, token_logprobs
from .protocols import Drafter, DraftOutcome, RoundContext, SkipPolicy
from .stats import GenerationStats
from .trees import DraftTree, point_masses

__all__ = ["Decoder", "GenerationStats", "Prefill", "RoundContext", "check_lengths", "prefill", "prefill_cosine"]


def check_finite(logits: torch.Tensor, what: str) -> None:
    """The full model's logits must be usable: a NaN there is a broken model or input, not a bad draft.

    Checked on each row's maximum, which a NaN anywhere in the row propagates to, as does +inf; a row of
    -inf only has -inf as its maximum (a single -inf logit is a token with probability 0, not an error).
    ``isfinite`` over all logits cost 2 ms for 8 rows of Gemma 3's 262k vocabulary, 11% of the verification
    (the maxima: :func:`~selfspec.core.sampling.rows_maxima_finite`)."""
    if not rows_maxima_finite(logits):
        raise SelfspecError(
            f"the full model produced NaN or infinite logits during {what}; the model's weights or dtype are "
            "broken for this input (try dtype='float32')"
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
    reused: int = 0  # prompt tokens whose keys and values came from a prefix store
    marks: dict[int, CosineMark] = field(default_factory=dict)  # measured cosines by length (core/prefix_store.py)


def prefill(
    model: Model, prompt_ids: list[int], *, max_new_tokens: int = 1, max_nodes: int = 1, cosine: bool = False,
    store: PrefixStore | None = None, batcher: StepBatcher | None = None,
) -> Prefill:
    """Run the full model over ``prompt_ids`` once, with room for decodings up to ``max_new_tokens``.

    ``max_nodes``: the most tokens one verification pass of the decodings will hold.  ``store``: the longest
    prefix of the prompt cached there is copied in and only the rest runs (at least the last token), giving
    the bits a whole prefill gives (:mod:`selfspec.core.prefix_store`).  ``batcher`` (a decoding of a server
    with several slots): where prompt rows are computed as one-token rows (``Engine.prompt_rows_exact``), the
    prompt runs in chunks inside the batch's passes, beside the other requests' rounds, which then go on
    while it prefills (same bits as a whole prefill; ASD's statistic as the chunks' means combined, equal to a
    whole prefill's to float32 rounding).
    """
    check_lengths(model, len(prompt_ids), max_new_tokens)
    engine = model.engine
    cache = engine.new_cache(len(prompt_ids) + max_new_tokens + max_nodes)
    with _away(batcher if store is not None else None):  # copying, no pass: the batch goes on without us
        hit = store.lookup(engine, prompt_ids, cosine=cosine) if store is not None else None
        start = store.restore(hit, cache) if hit is not None else 0
    measure = cosine and (hit is None or hit.mark_at < len(prompt_ids))  # a mark at the whole prompt: known
    out: list[SublayerCosine] = []
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=engine.device)
    if start and engine.draft_vocab is not None:
        engine.draft_vocab.add(ids[:start])  # the prompt tokens a whole prefill would have shown it
    if batcher is not None and engine.prompt_rows_exact:
        logits = _prefill_in_batches(batcher, cache, ids, start, out if measure else None)
    else:
        logits = engine.forward(cache, ids[start:], start, last_only=True, cosine_out=out if measure else None,
                                prefill=True)  # fmt: skip
    check_finite(logits[-1], "prefill")
    cache.commit(len(prompt_ids))
    pf = Prefill(tuple(prompt_ids), cache, int(logits[-1].argmax()), None, logits[-1], start,
                 hit.marks() if hit is not None else {})  # fmt: skip
    if not cosine:
        return pf
    n, measured = len(prompt_ids), out[0] if out else None
    if hit is None:  # measured over the whole prompt: as without a store
        return replace(pf, cosine=measured, marks={**pf.marks, n: CosineMark(_sums(measured, n), n)})
    mark = hit.mark if hit.mark is not None else CosineMark(np.zeros(2 * engine.num_layers), 0)
    if measured is not None:  # positions [start, n)
        mark = mark.plus(_sums(measured, n - start), n - start)
    # the mean over the measured positions: a reused earlier answer (never prefilled) is left out, not re-read
    return replace(pf, cosine=_mean(mark.sums, mark.count), marks={**pf.marks, n: mark})


def _away(batcher: StepBatcher | None):
    """Around a batch member's work that runs no pass (copying a prefix): the batch goes on without it."""
    return batcher.away() if batcher is not None else nullcontext()


def _prefill_in_batches(batcher: StepBatcher, cache: KVCache, ids: torch.Tensor, start: int,
                        cosine_out: list | None) -> torch.Tensor:  # fmt: skip
    """Prompt positions ``[start, len(ids))`` in chunks of the batcher's ``prompt_chunk`` rows, each chunk in
    one of the batch's passes (the rest in one pass while no other request decodes); the last row's logits.
    With ``cosine_out``, the chunks' mean cosines combined into their mean over ``[start, len(ids))``."""
    step, n, a, logits = max(1, batcher.prompt_chunk), ids.shape[0], start, None
    sums = np.zeros(2 * batcher.engine.num_layers)
    while a < n:
        b = n if batcher.members <= 1 else min(n, a + step)
        chunk: list[SublayerCosine] | None = [] if cosine_out is not None else None
        logits = batcher.forward(BatchItem(cache, ids[a:b], a, last_only=True, cosine_out=chunk))
        if chunk:
            sums += _sums(chunk[0], b - a)
        a = b
    if cosine_out is not None:
        cosine_out.append(_mean(sums, n - start))
    assert logits is not None
    return logits


def _sums(cos: SublayerCosine, count: int) -> np.ndarray:
    """A prefill's mean cosines as sums over its ``count`` positions (float64: the combination stays exact to
    float32 rounding), attention sublayers first."""
    return np.asarray(cos.attention + cos.mlp, dtype=np.float64) * count


def _mean(sums: np.ndarray, n: int) -> SublayerCosine:
    mean = (sums / n).astype(np.float32).tolist()
    half = len(mean) // 2
    return SublayerCosine(tuple(mean[:half]), tuple(mean[half:]))


def prefill_cosine(model: Model, prompt_ids: list[int]) -> SublayerCosine:
    """Per-sublayer cosine similarity of one full-model prefill over ``prompt_ids`` (no decoding)."""
    cos = prefill(model, prompt_ids, cosine=True).cosine
    assert cos is not None
    return cos


@dataclass
class _Tally:
    """Counters of one generation (the statistics' raw material)."""

    forwards: int = 1  # the prefill
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    verified: int = 0
    draft_time: float = 0.0
    draft_pass_time: float = 0.0  # draft_time of the rounds with draft passes (a hybrid's n-gram rounds have none)
    verify_time: float = 0.0
    optimise_time: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    grammar_drafted: int = 0
    grammar_accepted: int = 0


class Decoder:
    """Iterate to get the new tokens of each round; ``stats`` once exhausted.  Not thread-safe."""

    def __init__(
        self,
        model: Model,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        method: str = "vanilla",
        skip_policy: SkipPolicy | None = None,
        draft_policy: Drafter | None = None,
        prefill: Prefill | None = None,
        sampling: SamplingParams = GREEDY,
        prefix_store: PrefixStore | None = None,
        batcher: StepBatcher | None = None,
        logprobs: int | None = None,
    ) -> None:
        check_lengths(model, len(prompt_ids), max_new_tokens)
        # ``logprobs``: record each new token's log-probability and that many alternatives (decoding/logprobs.py)
        self._top = check_top(logprobs)
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        if skip_policy is not None and draft_policy is None:
            raise ValueError("a skip policy needs a drafter")
        self.model, self.prompt_ids, self.max_new_tokens = model, prompt_ids, max_new_tokens
        self.method, self.sampling, self.prefill = method, sampling, prefill
        self.skip_policy, self.drafter = skip_policy, draft_policy
        self.prefix_store = prefix_store if prefill is None else None  # a given prefill is its caller's
        self._reused = 0
        # the verification pass: on its own, or in a batch with concurrent decodings (decoding/batch.py)
        self._forward = partial(engine_pass, model.engine) if batcher is None else batcher.forward
        self._batcher = batcher
        if prefill is not None:
            if prefill.prompt_ids != tuple(prompt_ids):
                raise ValueError("the prefill is of another prompt")
            need = len(prompt_ids) + max_new_tokens + self._max_nodes
            if prefill.cache.capacity < need:
                raise ValueError(
                    f"the prefill's cache holds {prefill.cache.capacity} slots; this decoding needs {need}"
                )
            if self._wants_cosine and prefill.cosine is None:
                raise ValueError("this skip policy needs the prefill's cosine statistics: prefill(..., cosine=True)")
        # structured output: the grammar's matcher follows this generation's rows (decoding/grammar.py); made now,
        # so that a grammar that does not compile is refused before any work
        self._constraint = None if sampling.grammar is None else Constraint(model, sampling.grammar,
                                                                            prompt_len=len(prompt_ids))  # fmt: skip
        self._round_yield = [0, 0.0, 0.0, 0]  # the method's rounds: tokens, seconds, verification seconds, count
        self.stats: GenerationStats | None = None

    @property
    def _max_nodes(self) -> int:
        return self.drafter.max_nodes if self.drafter is not None else 1

    @property
    def _wants_cosine(self) -> bool:
        return self.skip_policy is not None and getattr(self.skip_policy, "needs_cosine", False)

    def __iter__(self) -> Iterator[list[int]]:
        if self._batcher is None:
            yield from self._rounds()
            return
        with self._batcher.member():  # left when the decoding ends or its consumer closes it
            yield from self._rounds()

    def _rounds(self) -> Iterator[list[int]]:
        t_start = clock.now()
        pf, token = self._prefill()
        cache, N, eos = pf.cache, self.max_new_tokens, self.model.eos_token_ids
        prefill_time = clock.now() - t_start
        out, tally = [token], _Tally()
        self._record(pf.last_logits[None], [token])
        skip = self._bind(pf.cosine)
        try:
            yield [token]
            while len(out) < N and token not in eos:
                c = cache.length  # `token` (the last bonus) sits at slot c, not yet in the cache
                t0 = clock.now()
                # 0. adapt: a refining skip policy may change the skip set (SWIFT)
                skip = self._adapt(cache, out, skip, tally)
                t1 = clock.now()
                # 1. draft candidates after the history (None: a round of plain decoding)
                history = [*self.prompt_ids, *out]  # prompt and new tokens; the last is not in the cache yet
                outcome = self._draft(history, cache, skip, budget=N - len(out) - 1)
                t2 = clock.now()
                # 2. verify every candidate in one full-model forward
                tree = outcome.tree if outcome is not None else None
                if outcome is not None and outcome.logits is not None and self._batcher is None:
                    logits = outcome.logits  # the draft was the full model's own steps: its head verified them
                    check_finite(logits, "verification")
                    t2 -= outcome.verify_s  # ... in the draft's time: that part is the round's verification
                else:
                    logits = self._verify(cache, c, token, tree)  # [T, V]
                # 3. accept the longest path the full model agrees with (or keeps), plus its next token
                path, bonus, choices = self._accept(tree, logits, history)
                if choices is not None and self._verified is not None and not outcome.grammar:  # lookahead's Jacobi
                    self._verified(outcome, choices, path)
                t3 = clock.now()
                # 4. commit the accepted path's cache entries; stop at EOS or at the length limit
                cache.move([c + n for n in path], c)
                cache.commit(c + len(path))
                accepted = [tree.tokens[n] for n in path[1:]] if tree is not None else []
                new = _until_stop(accepted + [bonus], eos, room=N - len(out))
                out.extend(new)
                self._record(logits, new, path[: len(new)])  # row n: the full model after node n of the path
                token = new[-1]
                self._sampler.forget_before(len(out))
                # 5. observe: the drafter and the skip policy learn from the round
                self._observe(outcome, path, len(new), tally, times=(t0, t1, t2, t3))
                tally.verified += len(tree) if tree is not None else 1
                yield new
        finally:  # also when the consumer abandons the stream: SWIFT saves what it learned
            finish = getattr(self.skip_policy, "finish", None)
            if finish is not None:
                finish()
            if self.prefix_store is not None:  # the prompt and what was committed after it, for the next request
                tokens = [*self.prompt_ids, *out][: cache.length]
                with _away(self._batcher):
                    # a prefill of its own is this decoding's alone, its cache no longer needed: the store may keep it
                    self.prefix_store.save(self.model.engine, tokens, cache, pf.marks, take=self.prefill is None)
        self.stats = self._stats(out, tally, skip, pf.cosine if self._wants_cosine else None,
                                 prefill_time, clock.now() - t_start)  # fmt: skip

    # -- the stages ----------------------------------------------------------------------------
    def _prefill(self) -> tuple[Prefill, int]:
        """The prompt's full-model prefill (unless given) and the first new token."""
        N, S = self.max_new_tokens, len(self.prompt_ids)
        pf = self.prefill or prefill(self.model, self.prompt_ids, max_new_tokens=N, max_nodes=self._max_nodes,
                                     cosine=self._wants_cosine, store=self.prefix_store,
                                     batcher=self._batcher)  # fmt: skip
        self._reused = pf.reused
        self._sampler = Sampler(self.sampling, pf.last_logits.shape[-1], prompt_len=S, device=self.model.engine.device,
                                constraint=self._constraint)  # fmt: skip
        plain = self.sampling.greedy and not self.sampling.adjusted  # the prefill's argmax is the first token
        token = pf.first_token if plain else self._sampler.next_token(pf.last_logits, pf.prompt_ids)
        pf.cache.commit(S)  # with a reused prefill: rewind to the prompt, what an earlier decoding wrote is scratch
        return pf, token

    def _record(self, logits: torch.Tensor, tokens: list[int], rows: list[int] | None = None) -> None:
        """The log-probabilities of ``tokens`` from ``logits`` (its ``rows``, where given), where they are asked for;
        the rows are taken only then (a torch copy, 7.6% of a SmolLM2 round when it was made every round)."""
        if self.logprobs is not None:
            self.logprobs.extend(token_logprobs(logits if rows is None else logits[rows], tokens, self._top))

    def _bind(self, cosine: SublayerCosine | None) -> SkipSet | None:
        """Before the first round: the skip policy's first set, and the drafter bound to it."""
        self._verified = getattr(self.drafter, "verified", None)  # wants the full model's token after each node
        if self.drafter is None:
            return None
        begin = getattr(self.drafter, "begin", None)  # a drafter with per-generation statistics (hybrid)
        if begin is not None:
            begin()
        skip = None
        if self.skip_policy is not None:
            bind = getattr(self.skip_policy, "bind", None)
            if bind is not None:
                bind(self.model, self.drafter)
            skip = self.skip_policy.propose(cosine if self._wants_cosine else None, self.model.engine.num_layers)
        self.drafter.bind(self.model, skip)
        return skip

    def _adapt(self, cache: KVCache, out: list[int], skip: SkipSet | None, tally: _Tally) -> SkipSet | None:
        refine = getattr(self.skip_policy, "before_round", None)
        if refine is None:
            return skip
        t0 = clock.now()
        new_skip = refine(RoundContext(self.model, cache, len(self.prompt_ids), out, skip))
        if new_skip != skip:
            skip = new_skip
            self.drafter.bind(self.model, skip)
        tally.optimise_time += clock.now() - t0
        return skip

    def _draft(self, history: list[int], cache: KVCache, skip: SkipSet | None, budget: int) -> DraftOutcome | None:
        if self.drafter is None:
            return None
        if self._constraint is not None:  # what the grammar forces is drafted for free (no method's round)
            forced = self._constraint.forced(history, min(budget, self._max_nodes - 1))
            if forced and self._forced_pays(len(forced)):
                q = point_masses(forced, self.model) if self._sampler.records_q else None
                return DraftOutcome(DraftTree.chain(history[-1], forced, q), [1.0] * len(forced), {}, len(forced),
                                    passes=0, grammar=True)  # fmt: skip
        return self.drafter.propose(history, model=self.model, cache=cache, skip=skip, budget=budget,
                                    sampler=self._sampler)  # fmt: skip

    def _forced_pays(self, n: int) -> bool:
        """Whether a round of ``n`` forced tokens (a verification pass, no draft) is expected to yield more tokens
        a second than the method's own rounds have so far (which may draft the forced tokens and more)."""
        tokens, seconds, verify_s, rounds = self._round_yield
        if not rounds or not seconds:
            return True
        return (n + 1) / max(verify_s / rounds, 1e-9) >= tokens / seconds

    def _verify(self, cache: KVCache, c: int, token: int, tree: DraftTree | None) -> torch.Tensor:
        engine = self.model.engine
        if tree is None or len(tree) == 1:
            ids = torch.tensor([token], dtype=torch.long, device=engine.device)
            item = BatchItem(cache, ids, c, last_only=True)  # logits [1, V]
        else:
            ids = torch.tensor(tree.tokens, dtype=torch.long, device=engine.device)
            mask = tree.attention_mask(engine.device)
            positions = tree.positions(c, engine.device) if mask is not None else None
            item = BatchItem(cache, ids, c, positions=positions, tree_mask=mask)  # [T, V]
        logits = self._forward(item)
        check_finite(logits, "verification")
        return logits

    def _accept(self, tree: DraftTree | None, logits: torch.Tensor,
                history: list[int]) -> tuple[list[int], int, list[int] | None]:  # fmt: skip
        """(accepted path, bonus, the full model's token after each node where acceptance is by exact match);
        ``history``: prompt and new tokens so far, the tree's root last."""
        sampler = self._sampler
        if tree is None or len(tree) == 1:
            return [0], sampler.next_token(logits[-1], history), None
        if sampler.params.reads_history:  # each node's history runs through its own path
            histories = [[*history, *(tree.tokens[n] for n in tree.path_to(node)[1:])] for node in range(len(tree))]
        else:
            histories = [history] * len(tree)
        if sampler.records_q:
            return (*accept_sampling(tree, sampler.probs(logits, histories), sampler.generator), None)
        first = sampler.position(len(history))  # output position of the token after the root
        choices = sampler.choose(logits, [first + d for d in tree.depths], histories)
        return (*accept_greedy(tree, choices), choices)

    def _observe(self, outcome: DraftOutcome | None, path: list[int], tokens: int, tally: _Tally,
                 times: tuple[float, float, float, float]) -> None:  # fmt: skip
        t0, t1, t2, t3 = times
        tally.forwards += 1
        tally.draft_time += t2 - t1
        tally.verify_time += t3 - t2
        if self.drafter is None:
            return
        if outcome is not None and outcome.steps:
            tally.drafted += outcome.steps
            passes = outcome.passes if outcome.passes is not None else outcome.steps
            tally.draft_forwards += passes
            if passes:
                tally.draft_pass_time += t2 - t1
            tally.accepted += len(path) - 1
            tally.accept_lengths.append(len(path) - 1)
            if self.skip_policy is not None and passes:  # a layer-skip draft (not a hybrid's n-gram round)
                self.skip_policy.observe(outcome.steps, len(path) - 1)
        y = self._round_yield
        if outcome is None or not outcome.grammar:  # the method's round: what it yields, for forced drafts
            y[0], y[1], y[2], y[3] = y[0] + tokens, y[1] + (t3 - t0), y[2] + (t3 - t2), y[3] + 1
        if outcome is not None and outcome.grammar:  # the drafter did not draft this round: nothing to learn
            tally.grammar_drafted += outcome.steps
            tally.grammar_accepted += len(path) - 1
            return
        self.drafter.observe(outcome, path, tokens=tokens, round_ms=1000 * (clock.now() - t1),
                             draft_ms=1000 * (t2 - t1), verify_ms=1000 * (t3 - t2))  # fmt: skip

    def _stats(self, out: list[int], tally: _Tally, skip: SkipSet | None, cosine: SublayerCosine | None,
               prefill_time: float, total_time: float) -> GenerationStats:  # fmt: skip
        eos = self.model.eos_token_ids
        return GenerationStats(
            method=self.method,
            prompt_tokens=len(self.prompt_ids),
            new_tokens=len(out),
            forwards=tally.forwards,
            draft_forwards=tally.draft_forwards,
            drafted=tally.drafted,
            accepted=tally.accepted,
            prefill_time=prefill_time,
            draft_time=tally.draft_time,
            draft_pass_time=tally.draft_pass_time,
            verify_time=tally.verify_time,
            total_time=total_time,
            stop_reason="eos" if out[-1] in eos else "length",
            optimise_time=tally.optimise_time,
            skip_set=skip.to_dict() if skip is not None else None,
            cosine={"attention": list(cosine.attention), "mlp": list(cosine.mlp)} if cosine else None,
            accept_lengths=tuple(tally.accept_lengths),
            verified_tokens=tally.verified,
            draft_precision=self.drafter.precision(self.model) if self.drafter is not None else None,
            sources=self.drafter.source_stats() if hasattr(self.drafter, "source_stats") else None,
            reused_tokens=self._reused,
            grammar_drafted=tally.grammar_drafted,
            grammar_accepted=tally.grammar_accepted,
        )


def engine_pass(engine, item: BatchItem) -> torch.Tensor:
    """One sequence's verification pass on its own."""
    return engine.forward(item.cache, item.input_ids, item.start, positions=item.positions,
                          tree_mask=item.tree_mask, last_only=item.last_only)  # fmt: skip


def _until_stop(new: list[int], eos: frozenset[int], room: int) -> list[int]:
    """The accepted tokens up to and including the first EOS, and at most ``room`` of them."""
    for i, t in enumerate(new):
        if t in eos:
            new = new[: i + 1]
            break
    return new[:room]
