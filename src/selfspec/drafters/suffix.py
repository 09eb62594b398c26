"""Suffix drafting (method ``suffix``): token trees grown from every earlier occurrence of the text's last n
tokens, in the prompt, the output so far and the session's earlier outputs.

The idea of SuffixDecoding (Oliaro et al., 2024): a model's outputs repeat what it was shown and what it wrote
before (a summary quotes its document, a code edit its code, an assistant its own phrasing from earlier
requests), so the continuations of a matched context, counted over all its occurrences, make a cheap and often
accepted draft; where the occurrences disagree, the draft is a tree with a branch per continuation, weighted by
how often each followed.  Ours, on the same index as :mod:`.lookup` (an n-gram ladder, the longest match wins):

* every occurrence of the matched n-gram contributes its continuation (the latest ``MAX_OCCURRENCES`` of the
  current text and as many of the session's store); they are merged into a trie whose edges carry how often
  each token followed its parent;
* a node's chance of being accepted is the product, along its path, of ``a_n`` (the acceptance observed for
  n-gram matches of this size, as prompt lookup learns it) times the edge's share of its parent's count; the
  tree keeps the nodes, most likely first, that maximise expected tokens per unit of verification cost (the
  model's measured cost curve), or none where nothing pays;
* the session's earlier outputs (not their prompts) are kept in a store bounded by ``store_tokens`` (the
  oldest half is dropped when it fills), so memory stays bounded however long a session runs; a long
  repetitive text keeps the index small too (each n-gram keeps its latest positions only).

Greedy and coupled sampling verify the tree by exact match, so the output is exactly vanilla's.  Under the
rejection scheme (which needs each node's draft distribution) the draft is the tree's most frequent chain,
each token a point mass, as in prompt lookup.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
from collections.abc import Sequence

from ..core.sampling import Sampler
from ..decoding.protocols import DraftOutcome
from ..decoding.trees import DraftTree, point_masses
from ..errors import InvalidInputError
from .lookup import MIN_GAIN, OPTIMISM, ngram_sizes, smoothed_acceptance

MAX_OCCURRENCES = 16  # continuations gathered per source (current text, store) for one match: the latest ones
STORE_TOKENS = 16384  # default bound of the session's store of earlier outputs


class NgramIndex:
    """Token documents, and for every n-gram within one of them the positions where its continuation starts
    (the latest ``keep``, oldest first).  The last document may keep growing (:meth:`extend`)."""

    def __init__(self, sizes: Sequence[int], keep: int = MAX_OCCURRENCES) -> None:
        self.sizes, self.keep = tuple(sizes), keep
        self.tokens: list[int] = []
        self.starts: list[int] = []  # where each document starts in ``tokens``
        self.index: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add_document(self, doc: Sequence[int]) -> None:
        self.starts.append(len(self.tokens))
        self.extend(doc)

    def extend(self, more: Sequence[int]) -> None:
        """Append to the last document and index the n-grams that now have a continuation."""
        if not self.starts:
            self.starts.append(0)
        toks, begin = self.tokens, self.starts[-1]
        known = len(toks)
        toks.extend(more)
        for end in range(max(begin + 1, known), len(toks)):  # the continuation starts at `end`, which exists
            for n in self.sizes:
                if end - n < begin:
                    break
                where = self.index.setdefault(tuple(toks[end - n : end]), [])
                where.append(end)
                if len(where) > self.keep:
                    del where[0]

    def continuations(self, key: tuple[int, ...], length: int, most: int) -> list[list[int]]:
        """What followed the latest ``most`` occurrences of ``key``, up to ``length`` tokens each (within its
        document)."""
        out = []
        for pos in reversed(self.index.get(key, ())[-most:]):
            doc = bisect.bisect_right(self.starts, pos)  # index of the next document's start
            stop = self.starts[doc] if doc < len(self.starts) else len(self.tokens)
            out.append(self.tokens[pos : min(pos + length, stop)])
        return out


class SessionStore:
    """The session's earlier outputs, at most ``capacity`` tokens: the oldest half goes when it fills."""

    def __init__(self, sizes: Sequence[int], capacity: int) -> None:
        self.sizes, self.capacity = tuple(sizes), capacity
        self.docs: list[list[int]] = []
        self.index = NgramIndex(self.sizes)

    def add(self, doc: Sequence[int]) -> None:
        if self.capacity <= 0 or len(doc) < 2:
            return
        doc = list(doc[-self.capacity :])
        self.docs.append(doc)
        if len(self.index) + len(doc) <= self.capacity:
            self.index.add_document(doc)
            return
        kept, total = [], 0  # the newest documents up to half the capacity, then index them afresh
        for d in reversed(self.docs):
            if kept and total + len(d) > self.capacity // 2:
                break
            kept.append(d)
            total += len(d)
        self.docs = kept[::-1]
        self.index = NgramIndex(self.sizes)
        for d in self.docs:
            self.index.add_document(d)


class SuffixDrafter:
    """Frequency-weighted token trees from n-gram matches in the text and the session's outputs (see the
    module docstring)."""

    needs_profile = True

    def __init__(self, max_ngram: int = 16, min_ngram: int = 1, max_draft: int = 10, max_nodes: int = 16,
                 store_tokens: int = STORE_TOKENS) -> None:  # fmt: skip
        self.sizes = ngram_sizes(min_ngram, max_ngram, "suffix")
        if max_draft < 1 or max_nodes < 2:
            raise InvalidInputError("suffix: max_draft must be at least 1 and max_nodes at least 2")
        if store_tokens < 0:
            raise InvalidInputError(f"suffix: store_tokens must be >= 0, got {store_tokens}")
        self.max_draft, self.max_nodes = max_draft, max_nodes
        self.store = SessionStore(self.sizes, store_tokens)
        self._text = NgramIndex(self.sizes)
        self._prompt_len: int | None = None  # of the current generation, known at its first proposal
        self._costs = None  # the verification cost curve, corrected by the rounds' measured times
        self._drafted = {n: 0.0 for n in self.sizes}  # expected acceptances of the trials (the model's mass)
        self._accepted = {n: 0.0 for n in self.sizes}
        self._last: tuple[int, DraftTree, list[float]] | None = None  # (n, tree, each node's edge share)
        self.last_gain = 0.0  # expected tokens per vanilla step of the last proposal

    # -- the Drafter protocol -------------------------------------------------------------------
    def begin(self) -> None:
        """Before a generation: the previous one's output joins the session's store."""
        if self._prompt_len is not None:
            self.store.add(self._text.tokens[self._prompt_len :])
        self._text, self._prompt_len = NgramIndex(self.sizes), None

    def memory(self) -> tuple:
        """What the source holds of earlier generations (its store and the text in hand), to set back with
        :meth:`recall`: a benchmark that times one answer several times must not draft it from its own last run."""
        return copy.deepcopy((self.store, self._text, self._prompt_len))

    def recall(self, memory: tuple) -> None:
        self.store, self._text, self._prompt_len = copy.deepcopy(memory)

    def bind(self, model, skip) -> None:
        from ..cost.costs import cost_profile
        from ..cost.economy import VerifyCurve

        profile = cost_profile(model)
        if self._costs is None or self._costs.profile is not profile:
            self._costs = VerifyCurve(profile)

    def precision(self, model) -> str | None:
        return None

    def propose(self, history: Sequence[int], *, model, cache, skip, budget: int,
                sampler: Sampler) -> DraftOutcome | None:  # fmt: skip
        self._sync(history)
        depth = min(self.max_draft, budget)
        if depth < 1:
            return None
        match = self._match(history, depth)
        if match is None:
            return None
        n, conts = match
        tokens, parents, kids, share = _trie(conts)
        nodes, gain = self._select(n, kids, share, chain_only=sampler.records_q)
        if not nodes:
            return None
        self.last_gain = gain
        order = {old: new for new, old in enumerate([0, *nodes])}
        tree = DraftTree(
            (int(history[-1]), *(tokens[i] for i in nodes)),
            (-1, *(order[parents[i]] for i in nodes)),
            tuple(point_masses([tokens[i] for i in nodes], model)) if sampler.records_q else (),
        )
        self._last = (n, tree, [1.0, *(share[i] for i in nodes)])
        return DraftOutcome(tree, [1.0] * tree.depth, {}, tree.depth, passes=0)

    def observe(self, outcome: DraftOutcome | None, path: list[int], *, tokens: int, round_ms: float,
                draft_ms: float, verify_ms: float) -> None:  # fmt: skip
        if self._costs is not None:
            self._costs.observe(len(outcome.tree) if outcome is not None else 1, verify_ms)
        if outcome is None or self._last is None or self._last[1] is not outcome.tree:
            return
        n, tree, share = self._last
        kids = tree.children
        for i, node in enumerate(path):  # a trial at every node reached that has drafted children
            if not kids[node]:
                break
            self._drafted[n] += sum(share[c] for c in kids[node])
            if i + 1 == len(path):
                break  # the full model's token was none of them
            self._accepted[n] += 1.0

    def match_value(self, history: Sequence[int], extra: Sequence[int]) -> tuple[float, float]:
        """(gain as :attr:`last_gain`, expected accepted tokens + 1) of the tree :meth:`propose` would draft after
        ``history`` + ``extra``, from the text as :meth:`propose` last indexed it (``history``); (0, 0) where
        nothing matches or pays.  Changes nothing (``auto`` asks it after each token a layer-skip chain drafts,
        ``extra`` being that chain)."""
        if not extra or len(self._text.tokens) != len(history):
            return 0.0, 0.0
        match = self._match([*history[-self.sizes[-1] :], *extra], self.max_draft)
        if match is None:
            return 0.0, 0.0
        n, conts = match
        _, _, kids, share = _trie(conts)
        nodes, gain = self._select(n, kids, share, chain_only=False)
        return (gain, gain * self._costs.ratio(1 + len(nodes))) if nodes and self._costs is not None else (0.0, 0.0)

    def guess(self, history: Sequence[int], extra: Sequence[int], most: int) -> tuple[list[int], list[float], int]:
        """(the likeliest continuation, up to ``most`` tokens, of the longest n-gram ending ``history`` + ``extra``
        in the text as :meth:`propose` last indexed it or in the store, each token's chance of being kept, n);
        ([], [], 0) where nothing matches.  Changes nothing (``auto``'s guesses riding along on a layer-skip
        chain's passes)."""
        if len(self._text.tokens) != len(history) or most < 1:
            return [], [], 0
        match = self._match([*history[-self.sizes[-1] :], *extra], most)
        if match is None:
            return [], [], 0
        n, conts = match
        tokens, _, kids, share = _trie(conts)
        a, node, path, chances = self.acceptance(n), 0, [], []
        while kids[node] and len(path) < most:
            node = max(kids[node], key=lambda c: share[c])
            path.append(tokens[node])
            chances.append(a * share[node])
        return path, chances, n

    # -- internals ------------------------------------------------------------------------------
    def _match(self, text: Sequence[int], depth: int) -> tuple[int, list[list[int]]] | None:
        """The longest n-gram ending ``text`` with continuations (up to ``depth`` tokens) in the indexed text or
        the store: (n, the continuations), or None."""
        for n in reversed(self.sizes):
            if n > len(text) - 1:
                continue
            key = tuple(text[-n:])
            if key not in self._text.index and key not in self.store.index.index:
                continue  # (most sizes of most rounds: priced only where there is something to read)
            deep = self._useful_depth(n, depth)
            conts = self._text.continuations(key, deep, MAX_OCCURRENCES)
            conts += self.store.index.continuations(key, deep, MAX_OCCURRENCES)
            if conts:
                return n, conts
        return None

    def _sync(self, history: Sequence[int]) -> None:
        """Index the text's new tokens; a text that does not continue the indexed one is a new generation."""
        toks = self._text.tokens
        if len(toks) > len(history) or (toks and history[len(toks) - 1] != toks[-1]):
            self.begin()
            toks = self._text.tokens
        if self._prompt_len is None:
            self._prompt_len = max(len(history) - 1, 0)
        self._text.extend(history[len(toks) :])

    def _useful_depth(self, n: int, depth: int) -> int:
        """How deep a continuation is worth reading: a node at depth d is accepted with chance at most a_n^d,
        and below the cheapest extra verified token's cost (in one-token rounds) it cannot pay."""
        if self._costs is None:
            return depth
        a, marginal = self.acceptance(n, OPTIMISM), self._costs.ratio(2) - 1.0
        if marginal <= 0.0 or a >= 0.99:
            return depth
        return max(1, min(depth, math.ceil(math.log(marginal) / math.log(a))))

    def acceptance(self, n: int, optimism: float = 0.0) -> float:
        """Estimated chance that a continuation seen after every occurrence of an n-gram is accepted (see
        smoothed_acceptance; :meth:`_select` adds ``OPTIMISM`` where the estimate alone drafts nothing)."""
        return min(smoothed_acceptance(n, self._accepted[n], self._drafted[n], optimism), 0.99)

    def _select(self, n: int, kids: list[list[int]], share: list[float], *,
                chain_only: bool) -> tuple[list[int], float]:  # fmt: skip
        """The trie's nodes to draft, most likely first (each after its parent), maximising expected tokens per
        unit of cost, and that ratio; no nodes where none beats plain decoding by ``MIN_GAIN``.  Priced by the
        size's acceptance, or where that drafts nothing by the acceptance with ``OPTIMISM``, so that a size the
        estimate would never draft again is tried until the evidence is clear (smoothed_acceptance)."""
        nodes, gain = self._select_at(self.acceptance(n), kids, share, chain_only)
        if nodes:
            return nodes, gain
        return self._select_at(self.acceptance(n, OPTIMISM), kids, share, chain_only)

    def _select_at(self, a: float, kids: list[list[int]], share: list[float],
                   chain_only: bool) -> tuple[list[int], float]:  # fmt: skip
        costs = self._costs
        chance = [1.0] * len(kids)  # the chance of each node being accepted
        heap: list[tuple[float, int]] = []

        def offer(node: int) -> None:
            options = kids[node]
            if chain_only and options:
                options = [max(options, key=lambda c: share[c])]
            for c in options:
                chance[c] = chance[node] * a * share[c]
                heapq.heappush(heap, (-chance[c], c))

        offer(0)
        chosen: list[int] = []
        expected, best, best_len = 1.0, MIN_GAIN, 0
        while heap and len(chosen) < self.max_nodes - 1:
            _, node = heapq.heappop(heap)
            chosen.append(node)
            expected += chance[node]
            ratio = expected / costs.ratio(1 + len(chosen)) if costs is not None else float("inf")
            if ratio > best:
                best, best_len = ratio, len(chosen)
            offer(node)
        return chosen[:best_len], best


def _trie(conts: list[list[int]]) -> tuple[list[int], list[int], list[list[int]], list[float]]:
    """The continuations (each at most as long as a draft may be) merged into a trie: per node (0: the root)
    its token, its parent, its children and its share of the parent's count (how often it followed the
    parent)."""
    tokens, parents, counts = [-1], [-1], [0]
    children: list[dict[int, int]] = [{}]
    for cont in conts:
        node = 0
        counts[0] += 1
        for tok in cont:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                counts.append(0)
                children.append({})
                children[node][tok] = nxt
            counts[nxt] += 1
            node = nxt
    share = [1.0] + [counts[i] / counts[parents[i]] for i in range(1, len(tokens))]
    return tokens, parents, [list(kids.values()) for kids in children], share
