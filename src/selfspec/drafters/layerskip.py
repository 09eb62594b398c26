"""Drafting: how many tokens to draft, which alternatives to add, and the draft loop itself.

Draft-length policies decide after each drafted token whether to go on:

* :class:`AdaptiveDraftExit` -- Draft & Verify's adaptive draft exiting
  (Zhang et al. 2024, section 3.4): stop when the draft's top-1 probability
  falls below a threshold gamma that is itself tuned after every verification
  towards a target acceptance rate.  State carries over between prompts.
* :class:`ConfidenceExit` -- SWIFT's early-stop drafting: stop when the top-1
  probability falls below a fixed epsilon (0.8), or at ``max_draft`` (25).
* :class:`FixedDraftLength` -- always draft k tokens.
* :class:`CostAwareExit` -- ours: go on while the next token is expected to
  pay for its draft step and its extra verification cost (see
  :mod:`selfspec.cost.economy`); may also decide that a round is better spent
  without drafting at all.

Tree policies decide which of the draft's next-best tokens join the drafted
chain as extra leaves (SWIFT's dynamic verification):

* :class:`PaperTreeWidths` -- SWIFT's schedule: k = 10, 5, 3, 1 candidates at
  a depth whose top-1 probability lies in (0, .5], (.5, .8], (.8, .95], (.95, 1];
* :class:`CostAwareTreeWidths` -- ours: add leaves by expected gain while each
  pays for the extra verification cost measured on this machine.

:func:`draft_round` runs the draft model once per token along the chain and
returns the :class:`~selfspec.decoding.trees.DraftTree` to verify.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from ..core import clock
from ..core.sampling import GREEDY_SAMPLER, Sampler, rows_maxima_finite
from ..core.skipset import SkipSet
from ..cost.economy import Economy, verifies_by_head
from ..decoding.protocols import DraftOutcome
from ..decoding.trees import DraftTree
from ..errors import InvalidInputError

# -- draft-length policies ---------------------------------------------------------------------


class LengthPolicy:
    """Base: ``begin_round`` before drafting (False: skip drafting this round), ``should_stop`` after each token."""

    max_draft: int = 12
    economy: Economy | None = None

    def begin_round(self) -> bool:
        return True

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        raise NotImplementedError

    def room(self, drafted: int) -> int:
        """At most how many more tokens this round's chain may draft after ``drafted``."""
        return self.max_draft - drafted

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class AdaptiveDraftExit(LengthPolicy):
    """D&V's rule with its published values (DESIGN.md section 3)."""

    gamma: float = 0.6  # confidence threshold; a token below it is kept, then drafting stops
    target_acceptance: float = 0.9  # AR*
    epsilon: float = 0.01
    beta1: float = 0.5  # smoothing of the acceptance rate
    beta2: float = 0.9  # smoothing of gamma
    max_draft: int = 12
    acceptance: float | None = None  # smoothed AR; None until the first verification

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise InvalidInputError(f"gamma must be in [0, 1], got {self.gamma}")
        _check_max_draft(self.max_draft)

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        return drafted >= self.max_draft or top1_prob < self.gamma

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        rate = accepted / drafted
        self.acceptance = rate if self.acceptance is None else self.beta1 * self.acceptance + (1 - self.beta1) * rate
        if drafted >= self.max_draft:  # the confidence rule did not stop this draft: nothing to learn
            return
        target = self.gamma + self.epsilon if self.acceptance < self.target_acceptance else self.gamma - self.epsilon
        self.gamma = self.beta2 * self.gamma + (1 - self.beta2) * target


@dataclass
class ConfidenceExit(LengthPolicy):
    """SWIFT's early-stop drafting (epsilon 0.8 and 25 steps in the authors' code)."""

    epsilon: float = 0.8
    max_draft: int = 25

    def __post_init__(self) -> None:
        if not 0.0 <= self.epsilon <= 1.0:
            raise InvalidInputError(f"epsilon must be in [0, 1], got {self.epsilon}")
        _check_max_draft(self.max_draft)

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        return drafted >= self.max_draft or top1_prob < self.epsilon


@dataclass
class FixedDraftLength(LengthPolicy):
    k: int = 4

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InvalidInputError(f"draft_length must be >= 1, got {self.k}")

    @property
    def max_draft(self) -> int:  # type: ignore[override]
        return self.k

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        return drafted >= self.k


@dataclass
class CostAwareExit(LengthPolicy):
    """Draft while the next token is worth its cost; skip drafting in rounds where even one is not, or
    where drafting rounds have been measured to lose time against plain ones (:meth:`Economy.drafting_loses`).

    After a round without drafting, every ``explore_every``-th round drafts
    anyway, so that a draft model that got better (SWIFT found a better skip
    set, the text became easier) is noticed.
    """

    max_draft: int = 16
    explore_every: int = 8
    _path_prob: float = field(default=1.0, repr=False)
    _idle_rounds: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        _check_max_draft(self.max_draft)

    def begin_round(self) -> bool:
        self._path_prob = 1.0
        econ = self.economy
        if econ is None or (econ.worth_drafting() and not econ.drafting_loses()):
            self._idle_rounds = 0
            return True
        self._idle_rounds += 1
        if self._idle_rounds >= self.explore_every:
            self._idle_rounds = 0
            return True
        return False

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        if drafted >= self.max_draft:
            return True
        econ = self.economy
        if econ is None:
            return top1_prob < 0.5
        kept = econ.chain.prob(top1_prob)
        self._path_prob *= kept
        # the next token's acceptance is unknown until drafted; this one's is the best guess
        horizon = self.max_draft - drafted
        return not econ.worth_another_draft(self._path_prob, kept, tree_size=drafted + 1, horizon=horizon)


def _check_max_draft(n: int) -> None:
    if n < 1:
        raise InvalidInputError(f"max_draft must be >= 1, got {n}")


# -- tree policies -----------------------------------------------------------------------------

MAX_WIDTH = 10  # most candidates per depth (top-1 included), as in SWIFT


class TreePolicy:
    """How many alternatives join the drafted chain at each depth, as extra leaves (SWIFT's dynamic verification).

    Decided at each depth from the draft distribution there (its largest
    probabilities, ``top``) and from what lies above it (``path_prob``: the
    chance that the chain up to this depth is kept; ``size``: tokens already in
    the tree), never from the tokens drawn at or below the depth: under
    sampling, a width that depended on the draws would bias the output.
    """

    economy: Economy | None = None
    max_leaves = 0

    def leaves(self, top: list[float], path_prob: float, size: int, budget: int) -> int:
        raise NotImplementedError


@dataclass
class PaperTreeWidths(TreePolicy):
    """SWIFT's confidence bands: k candidates (top-1 included) by the depth's top-1 probability."""

    bands: tuple[tuple[float, int], ...] = ((0.5, 10), (0.8, 5), (0.95, 3), (1.0, 1))
    max_leaves: int = 25 * (MAX_WIDTH - 1)

    def leaves(self, top, path_prob, size, budget):
        k = next((k for upper, k in self.bands if top[0] <= upper), 1)
        return min(k - 1, budget)


@dataclass
class CostAwareTreeWidths(TreePolicy):
    """Leaves while each one's expected gain, P(path kept) * P(leaf kept), pays for its verification cost."""

    max_leaves: int = 16

    def leaves(self, top, path_prob, size, budget):
        econ = self.economy
        if econ is None:
            return 0
        n = 0
        for q in top[1:budget + 1]:  # the i-th draw tends to be the i-th most likely token
            if not econ.worth_leaf(path_prob * econ.leaves.prob(q), size + n):
                break
            n += 1
        return n


# -- the draft loop ----------------------------------------------------------------------------


def broken_draft(logits: torch.Tensor) -> bool:
    """Whether a draft pass's logits are unusable: a NaN or +inf anywhere, or a row without a finite value.
    (-inf is a legitimate logit: tokens outside the draft's vocabulary, core/draft_vocab.py.)  One reduction:
    a row's maximum is NaN if any of it is, +inf if any is, -inf if none is finite (three passes over Gemma 3's
    262k logits took 0.4 ms a draft step)."""
    return not rows_maxima_finite(logits)


def _draft_distribution(engine, logits: torch.Tensor, vocab: torch.Tensor | None, sampler: Sampler,
                        history: Sequence[int], drafted: list[int]):  # fmt: skip
    """(q, its columns' token ids or None, q over the whole vocabulary or None) of one draft step.

    Greedy and coupled drafts keep the draft vocabulary's logits alone (``vocab``: their ids; a scatter,
    warp and top-k over Gemma 3's 262k-token vocabulary cost ~1-2 ms a step), coupled ones only the tokens
    within reach of the best (:meth:`Sampler.coupled_draft_distribution`): their tokens are verified by exact
    match, so q only has to rank candidates.  The rejection scheme weighs each draft by q over the whole
    vocabulary (zero outside the draft vocabulary), which it keeps for acceptance."""
    if sampler.greedy:  # (with a repetition penalty, the draft ranks its tokens as the model's choice will)
        columns = None if vocab is None else engine.draft_vocab.columns
        x = sampler.greedy_draft_logits(logits[-1], sampler.extend(history, drafted), columns)
        return x.softmax(-1), vocab, None
    if sampler.coupled:
        columns = None if vocab is None else engine.draft_vocab.columns
        q, cols = sampler.coupled_draft_distribution(logits[-1], sampler.extend(history, drafted), columns)
        return q, (cols if vocab is None else vocab[cols]), None
    full = logits if vocab is None else engine.draft_vocab.scatter(logits)
    q = sampler.draft_distribution(full[-1], sampler.extend(history, drafted))  # [V]
    return q, None, q


def _leaf_count(q: torch.Tensor, tree: TreePolicy | None, path_prob: float, size: int, n_leaves: int) -> int:
    """How many alternatives join the chain at this depth (the tree policy reads q's largest probabilities)."""
    if tree is None or n_leaves >= tree.max_leaves:
        return 0
    room = min(MAX_WIDTH - 1, tree.max_leaves - n_leaves)
    return tree.leaves(q.topk(min(MAX_WIDTH, q.shape[-1])).values.tolist(), path_prob, size, room)


def _draws(q: torch.Tensor, vocab: torch.Tensor | None, sampler: Sampler, k: int, t: int):
    """Up to ``k`` candidates, best first, as token ids, and their draft probabilities (see
    :meth:`Sampler.draft_tokens`; greedy: q's top k)."""
    cols = sampler.draft_tokens(q, k, t=t, vocab=vocab)
    probs = q[cols].tolist()
    return (cols if vocab is None else vocab[cols].tolist()), probs


# Long (~70 lines): the draft loop, its guessed rows and stop rules share per-depth state (q, draws, path
# probability); kept in one function so that the sampling-correctness argument can be read in one place.
@torch.inference_mode()
def draft_round(
    engine,
    cache,
    start: int,
    root: int,
    *,
    skip: SkipSet,
    budget: int,
    length: LengthPolicy,
    tree: TreePolicy | None = None,
    precision: torch.dtype | None = None,
    sampler: Sampler = GREEDY_SAMPLER,
    history: Sequence[int] = (),
    stop: Collection[int] = (),
    until: Callable[[list[int]], bool] | None = None,
    ride: Callable[[list[int]], list[int]] | None = None,
) -> DraftOutcome | None:
    """Draft up to ``budget`` tokens after ``root`` (which sits at cache slot ``start``; ``history``: the
    tokens up to and including it, for the sampler).  The chain ends at a drafted token of ``stop`` (the
    model's end-of-sequence tokens): were it kept, the answer would end there, so tokens drafted after it
    could never be used (short answers drafted a full round past their end).  ``until`` (the chain's tokens
    so far -> bool) may end it sooner: ``auto`` ends a layer-skip chain where a prompt-lookup draft would now
    earn more (a summary's text that turns to copying again).  ``ride`` (the chain's tokens so far -> guesses
    of the tokens after them, e.g. an n-gram continuation; ``auto`` gives its lookup source's) lets guessed
    tokens ride along as extra rows of a chain's draft pass (greedy and coupled chains only): a pass of a few
    rows costs little more than one where a step reads the weights, and each guess the draft then drafts
    itself gives the next draft token from the same pass (Ouroboros' phrases, from the text instead of a
    smaller model).  The draft is the same chain with or without them; only its passes are fewer.

    Greedy: the chain follows the draft's argmax and the leaves are its next
    best tokens.  Coupled sampling: the same on the draft's log-weights plus
    each position's noise.  Rejection sampling: at each depth the chain token
    and the leaves are successive draws without replacement from the warped
    draft distribution q, which the tree keeps for the acceptance test.  The draft passes write
    their keys and values beyond the committed length; verification overwrites
    them.  Non-finite draft logits (a skip set or a low precision that broke
    the draft model) end the draft: None when nothing was drafted yet, so that
    the round falls back to plain decoding.
    """
    device = engine.device
    hidden = _head_only_states(engine, skip, precision, root)
    if hidden is not None:
        tree = None  # a chain: each node's full logits come from its own draft pass
    first_t = sampler.position(len(history))  # output position of the first drafted token
    d = _Draft(root)
    passes, done = 0, False
    while len(d.chain_probs) < budget and not done:
        room = min(budget - len(d.chain_probs), length.room(len(d.chain_probs))) - 1  # after the pass's first
        guesses = _guesses(ride, d.tokens, tree, sampler, room)
        ids = torch.tensor([d.tokens[-1], *guesses], dtype=torch.long, device=device)
        logits, vocab = engine.forward(cache, ids, start + len(d.tokens) - 1, skip=skip, last_only=not guesses,
                                       precision=precision, subset=True, draft=True, hidden_out=hidden)  # fmt: skip
        passes += 1
        states = hidden.pop() if hidden is not None and guesses else None  # [1, rows, H]: kept row by row
        for row in range(len(ids)):  # row r's input: the chain's last token (r = 0), else the guess r - 1
            if states is not None:
                hidden.append(states[:, row : row + 1])
            if broken_draft(logits[row]):
                if not d.chain_probs:
                    return None
                done = True  # keep the chain drafted so far
                break
            q, ids_q, q_full = _draft_distribution(engine, logits[row : row + 1], vocab, sampler, history,
                                                   d.tokens[1:])  # fmt: skip
            extra = _leaf_count(q, tree, d.path_prob, len(d.tokens) + d.n_leaves + 1, d.n_leaves)
            draws, probs = _draws(q, ids_q, sampler, 1 + extra, first_t + len(d.tokens) - 1)
            d.add(draws, probs, q_full, tree)
            if (length.should_stop(len(d.chain_probs), probs[0]) or draws[0] in stop
                    or (until and until(d.tokens[1:])) or len(d.chain_probs) >= budget):  # fmt: skip
                done = True
                break
            if row == len(guesses) or draws[0] != guesses[row]:
                break  # the next row (if any) read a token the draft did not choose: a new pass from here
    outcome = _with_leaves(d.tokens, d.parents, d.qs, d.chain_probs, d.leaf_nodes, sampler)
    outcome.ridden = len(d.chain_probs) - passes  # tokens guessed rows drafted (0 without: a pass per token)
    outcome.passes = passes if outcome.ridden else None
    if hidden is not None:
        _verify_by_head(engine, cache, start, outcome, hidden, passes)
    return outcome


@dataclass
class _Draft:
    """A round's draft as it grows: the chain (each token's parent the one before) and the leaves to add."""

    root: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)  # per node: the draft distribution its children were drawn from
    chain_probs: list[float] = field(default_factory=list)
    leaf_nodes: list[tuple[int, list[tuple[int, float]]]] = field(default_factory=list)  # (chain node, extras)
    n_leaves: int = 0
    path_prob: float = 1.0  # P(the chain so far is kept), by the economy's calibration (1 without one)

    def __post_init__(self) -> None:
        self.tokens, self.parents, self.qs = [self.root], [-1], [None]

    def add(self, draws: list[int], probs: list[float], q_full, tree: TreePolicy | None) -> None:
        """The chain's next token (``draws[0]``) and its alternatives as leaves, drawn after the last one."""
        parent = len(self.tokens) - 1
        self.qs[parent] = q_full
        if len(draws) > 1:
            self.leaf_nodes.append((parent, list(zip(draws[1:], probs[1:], strict=True))))
            self.n_leaves += len(draws) - 1
        self.tokens.append(draws[0])
        self.parents.append(parent)
        self.qs.append(None)
        self.chain_probs.append(probs[0])
        if tree is not None and tree.economy is not None:
            self.path_prob *= tree.economy.chain.prob(probs[0])


def _guesses(ride: Callable[[list[int]], list[int]] | None, tokens: list[int], tree: TreePolicy | None,
             sampler: Sampler, room: int) -> list[int]:  # fmt: skip
    """The tokens to ride along on the next draft pass (see :func:`draft_round`): none for token trees (a pass's
    rows are the chain's) or where acceptance weighs each draft by q (rejection sampling), at most ``room``."""
    if ride is None or tree is not None or sampler.records_q or room < 1:
        return []
    return [int(t) for t in ride(tokens[1:])[:room]]


def _with_leaves(tokens: list[int], parents: list[int], qs: list, chain_probs: list[float],
                 leaf_nodes: list[tuple[int, list[tuple[int, float]]]], sampler: Sampler) -> DraftOutcome:  # fmt: skip
    """The round's tree: the drafted chain, then each chain node's extra children (the leaves) after it."""
    leaf_probs: dict[int, float] = {}
    for chain_node, extras in leaf_nodes:
        for tok, prob in extras:
            leaf_probs[len(tokens)] = prob
            tokens.append(tok)
            parents.append(chain_node)
            qs.append(None)
    tree_q = tuple(qs) if sampler.records_q else ()
    return DraftOutcome(DraftTree(tuple(tokens), tuple(parents), tree_q), chain_probs, leaf_probs, len(chain_probs))


def _head_only_states(engine, skip: SkipSet, precision: torch.dtype | None, root: int) -> list | None:
    """A list for the draft passes' hidden states when the draft can be verified by the full head alone (None
    otherwise, :func:`~selfspec.cost.economy.verifies_by_head`, the test its pricing reads too): a draft that
    skips nothing in the model's own precision is the full model's one-token step with a smaller head (the
    draft vocabulary's), so its hidden states are a verification's."""
    if not verifies_by_head(engine, skip, precision):
        return None
    engine.draft_vocab.add(torch.tensor([root]))  # the verified token a verification pass would have added
    return []


def _verify_by_head(engine, cache, start: int, outcome: DraftOutcome, hidden: list, passes: int) -> None:
    """One more step over the last drafted token (for its hidden state: no head of its own), then the full head
    over every node's hidden state: the round's full logits, as a verification pass would give them
    (``outcome.logits``); the time this took is the round's verification (``outcome.verify_s``)."""
    t0 = clock.now()
    tokens = outcome.tree.tokens
    last = torch.tensor([tokens[-1]], dtype=torch.long, device=engine.device)
    engine.forward(cache, last, start + len(tokens) - 1, last_only=True, draft=True, hidden_out=hidden,
                   head=False)  # fmt: skip
    outcome.logits = engine.head_logits(hidden[: len(tokens)])
    outcome.passes = passes + 1
    outcome.verify_s = clock.now() - t0


# -- the drafter: policies, precision and economy of one method ----------------------------------

DRAFT_DTYPES = ("auto", "same", "float16", "bfloat16", "q4")


def _low_bit_precision(model) -> str:
    """What ``draft_dtype=q4`` means for ``model``: "q4" where the fused stack has 8-bit weights to requantise,
    "same" where its layer weights are all 4-bit already; an error where the model is not quantised."""
    engine = model.engine
    if not engine.fused:
        raise InvalidInputError("draft_dtype=q4 drafts with 4-bit copies of a quantised (GGUF) model's weights on "
                                "the native engine; this model runs on torch's kernels "
                                f"({engine.fused_reason or 'not quantised'}); use same, float16 or bfloat16")
    return "q4" if engine.low_bit_drafts else "same"


@dataclass
class Drafter:
    """What a method drafts with: length and tree policies, the draft precision, and the economy they share.

    ``dtype`` is the precision of the draft passes' linear layers: ``same``
    (the model's own, as in the papers), ``float16`` / ``bfloat16`` (a copy of
    the weights, see :mod:`selfspec.core.kernels`), ``q4`` (quantised models on
    the fused stack: 4-bit copies of the layers' 5-8-bit weights, see
    :func:`selfspec.core.quant.low_bit_copy`; where every layer weight is 4-bit
    already it is the model's own), or ``auto``: the cheapest one the model's
    cost profile shows to agree with the full model.  Output stays exactly the
    full model's whatever the choice; only speed changes.
    """

    length: LengthPolicy
    tree: TreePolicy | None = None
    dtype: str = "auto"
    economy: Economy | None = None
    priced: bool = False  # keep an economy (measured costs) even where no policy of its own reads it: auto's source
    _precision: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DRAFT_DTYPES:
            raise InvalidInputError(f"draft_dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.dtype!r}")

    @property
    def max_draft(self) -> int:
        return self.length.max_draft

    @property
    def max_nodes(self) -> int:
        """Most tokens one verification pass can hold: root, chain and leaves."""
        return 1 + self.max_draft + (self.tree.max_leaves if self.tree is not None else 0)

    @property
    def needs_profile(self) -> bool:
        cost_aware = isinstance(self.length, CostAwareExit) or isinstance(self.tree, CostAwareTreeWidths)
        return cost_aware or self.priced or self.dtype == "auto"

    def precision(self, model) -> str:
        """The draft precision name for ``model`` (``auto`` resolved once, from the cost profile)."""
        if self._precision is None:
            if self.dtype == "auto":
                from ..cost.economy import best_precision

                self._precision = best_precision(model)
            elif self.dtype == "q4":
                self._precision = _low_bit_precision(model)
            else:
                self._precision = self.dtype
        return self._precision

    def torch_dtype(self, model) -> torch.dtype | None:
        from ..cost.costs import PRECISIONS

        dtype = PRECISIONS[self.precision(model)]
        return None if dtype is None or dtype == model.adapter.dtype else dtype

    def bind(self, model, skip: SkipSet) -> None:
        """Before a prompt: set up the economy (cost-aware policies) for this draft model."""
        if not self.needs_profile:
            return
        from ..cost.costs import cost_profile

        profile = cost_profile(model)
        precision = self.precision(model)
        predicted = profile.draft_step(skip, precision if precision in profile.drafts else "same")
        head_only = verifies_by_head(model.engine, skip, self.torch_dtype(model))
        if self.economy is None or self.economy.profile is not profile:
            self.economy = Economy(profile, predicted, head_only=head_only)
        else:
            self.economy.rebind(predicted, head_only)
        self.length.economy = self.economy
        if self.tree is not None:
            self.tree.economy = self.economy

    def draft(
        self,
        model,
        cache,
        start: int,
        root: int,
        skip: SkipSet,
        budget: int,
        sampler: Sampler = GREEDY_SAMPLER,
        history: Sequence[int] = (),
        until: Callable[[list[int]], bool] | None = None,
        ride: Callable[[list[int]], list[int]] | None = None,
    ) -> DraftOutcome | None:
        """One round's draft, or None when the length policy says this round is better spent without one."""
        if budget < 1 or not self.length.begin_round():
            return None
        return draft_round(
            model.engine, cache, start, root, skip=skip, budget=budget, length=self.length, tree=self.tree,
            precision=self.torch_dtype(model), sampler=sampler, history=history, stop=model.eos_token_ids,
            until=until, ride=ride,
        )  # fmt: skip

    def propose(self, history, *, model, cache, skip: SkipSet | None, budget: int,
                sampler: Sampler = GREEDY_SAMPLER, until: Callable[[list[int]], bool] | None = None,
                ride: Callable[[list[int]], list[int]] | None = None) -> DraftOutcome | None:  # fmt: skip
        """The :class:`~selfspec.decoding.protocols.Drafter` entry: draft after ``history[-1]``, which sits at
        the cache's committed length.  (A layer-skip draft reads the history through the cache; ``until`` and
        ``ride``: see :func:`draft_round`.)"""
        return self.draft(model, cache, cache.length, history[-1], skip, budget, sampler, history, until, ride)

    def observe(self, outcome: DraftOutcome | None, path: list[int], *, tokens: int, round_ms: float,
                draft_ms: float, verify_ms: float) -> None:  # fmt: skip
        """Tell the policies and the economy how the round went (``path``: accepted nodes, root included)."""
        econ = self.economy
        if outcome is None:
            if econ is not None:
                econ.observe(tokens=tokens, round_ms=round_ms, draft_steps=0, draft_ms=0.0, verified=1,
                             verify_ms=verify_ms, first_kept=None)  # fmt: skip
            return
        tree = outcome.tree
        drafted, accepted = outcome.steps, len(path) - 1
        self.length.observe(drafted, accepted)
        if econ is None:
            return
        on_path = set(path)
        depths = tree.depths
        for node in range(1, len(tree)):
            if tree.parents[node] not in on_path:
                continue  # never reached: says nothing about this node
            kept = node in on_path
            if node in outcome.leaf_probs:
                econ.leaves.update(outcome.leaf_probs[node], kept)
            else:
                econ.chain.update(outcome.chain_probs[depths[node] - 1], kept)
        econ.observe(tokens=tokens, round_ms=round_ms, draft_steps=outcome.steps, draft_ms=draft_ms,
                     verified=len(tree), verify_ms=verify_ms, first_kept=accepted > 0)  # fmt: skip
