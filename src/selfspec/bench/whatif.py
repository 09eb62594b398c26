"""What-if replay of draft sources (``selfspec whatif``): would another drafter, or one token tree merging
several, earn more than the drafters we ship, on this machine and model?

    selfspec whatif --model gemma3-270m --dataset spec-bench --limit 2
    selfspec whatif --temperature 0.7 --top-p 0.9

Speculative decoding's gain is tokens per round over the round's cost, so a drafting rule can be judged
without running it, from three things measured once (:func:`collect`):

* the vanilla output of every prompt (greedy, or coupled sampling with a seed: every lossless method emits
  exactly these tokens, so a draft is again kept by exact match), and the full model's top-``K`` tokens
  after every prefix of prompt and output (one teacher-forced pass): what the model itself predicted,
  which Token Recycling (Luo et al., 2024) keeps as an adjacency table of each token's latest top-k
  successors;
* the layer-skip draft's token at every output position (the skip set the default ``asd`` chooses for the
  prompt, reading the full model's cache of the text before it, as a drafted chain's first token does; under
  coupled sampling chosen with the position's noise, as our coupled drafts are);
* the costs on this machine: a verification over T tokens (T = 1..16) at the prompts' median context, and a
  draft step, both in one-token steps.

:func:`replay` then walks each output round by round: a policy proposes a tree from what is known before the
round (the text so far, the adjacency built from the rounds verified so far), the longest path equal to the
vanilla output is accepted, and the round costs its draft steps plus the verification of its nodes.  Policies:
each source alone (``lookup``: the latest continuation of the longest matching n-gram, as ``pld``;
``recycle``: Token Recycling's chain; ``layerskip``: a chain of draft tokens), one source per round (lookup
where it matches, else the other), and one merged tree holding both.  The figure is the replayed decode
speedup (tokens per one-token step of cost); what the replay leaves out (a drafter's bookkeeping, the
round's own loop, draft chains past the first token reading draft keys) makes it an upper bound that
``selfspec bench`` measures against (``lookup`` replayed vs ``pld`` measured: README).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..core.sampling import GREEDY, Sampler, SamplingParams
from ..core.skipset import SkipSet
from ..datasets import PromptItem
from ..drafters.lookup import NGRAM_SIZES
from ..drafters.suffix import NgramIndex
from ..errors import InvalidInputError
from ..model.models import Model

TOP_K = 8  # successors kept per token (Token Recycling's k)
MAX_NODES = 16  # the largest verification the costs are measured for


@dataclass
class Trace:
    """One prompt's vanilla output and what the model and the draft predicted along it."""

    task: str
    prompt_len: int
    tokens: list[int]  # prompt + output
    top: list[list[int]]  # top[i]: the full model's top-K tokens after tokens[: i + 1]
    draft: dict[int, int]  # draft[j]: the layer-skip draft's token for position j (output positions only)


@dataclass
class Costs:
    verify: dict[int, float]  # T -> a verification over T tokens, in one-token steps
    draft_step: float  # a layer-skip draft step, in one-token steps


@dataclass
class Replay:
    policy: str
    tokens: int = 0
    rounds: int = 0
    cost: float = 0.0  # in one-token steps
    nodes: int = 0
    per_task: dict[str, list[float]] = field(default_factory=dict)  # task -> [tokens, cost]

    @property
    def speedup(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0

    @property
    def mean_accepted(self) -> float:  # M: tokens per round
        return self.tokens / self.rounds if self.rounds else 0.0


# -- collecting -----------------------------------------------------------------------------------
def collect(model: Model, prompts: Sequence[PromptItem], *, max_new_tokens: int = 128,
            sampling: SamplingParams = GREEDY,
            progress: Callable[[int], None] | None = None) -> tuple[list[Trace], Costs]:  # fmt: skip
    """The traces of ``prompts`` (vanilla outputs on our engine: greedy, or coupled sampling with prompt i's seed
    ``seed + i``, as ``selfspec bench`` seeds them) and this machine's costs."""
    from ..api import Session

    if not prompts:
        raise InvalidInputError("whatif needs at least one prompt")
    if not sampling.greedy and not sampling.coupled:
        raise InvalidInputError("whatif replays drafts by exact match: it needs greedy or coupled sampling")
    vanilla, asd = Session(model, "vanilla"), Session(model, "asd")
    traces = []
    for i, item in enumerate(prompts):
        params = sampling if sampling.greedy else replace(sampling, seed=(sampling.seed or 0) + i)
        ids = model.encode(item.prompt)
        out = list(vanilla.generate(item.prompt, max_new_tokens=max_new_tokens, **params.as_kwargs()).token_ids)
        skip_dict = asd.generate(item.prompt, max_new_tokens=8).stats.skip_set
        skip = SkipSet.from_dict(skip_dict) if skip_dict else SkipSet()
        traces.append(_trace(model, item.task, ids, out, skip, params))
        if progress is not None:
            progress(1)
    context = int(statistics.median(t.prompt_len for t in traces))
    return traces, measure_costs(model, context, skip, sampling)  # a draft step of the last prompt's skip set


def _trace(model: Model, task: str, ids: list[int], out: list[int], skip: SkipSet,
           sampling: SamplingParams) -> Trace:  # fmt: skip
    """Teacher-forced passes along prompt + output: the full model's top-K after every prefix from the
    prompt's last token on, and the draft's token at every output position (its greedy token, or under coupled
    sampling its choice with the noise the full model's choice at that position uses, as a drafted chain's
    first token is chosen)."""
    from ..drafters.layerskip import _draft_distribution, _draws

    engine, full, dev = model.engine, ids + out, model.engine.device
    cache = engine.new_cache(len(full) + 1)
    first = engine.forward(cache, torch.tensor(ids, device=dev), 0, last_only=True, prefill=True)
    cache.commit(len(ids))
    rows = [first[-1]]
    if len(out) > 1:  # the output's rows but the last (nothing follows it)
        rows.extend(engine.forward(cache, torch.tensor(out[:-1], device=dev), len(ids)))
    cache.commit(len(full) - 1)
    top = [[-1] * TOP_K] * (len(ids) - 1) + torch.stack(rows).topk(TOP_K, dim=-1).indices.tolist()
    sampler = Sampler(sampling, model.adapter.vocab_size, prompt_len=len(ids), device=dev)
    draft = {}
    for j in range(len(ids), len(full)):  # the draft's token for position j: tokens[j - 1] at its place, in a
        step = torch.tensor([full[j - 1]], device=dev)  # scratch slot, seeing the full model's keys before it
        logits, vocab = engine.forward(cache, step, len(full), positions=torch.tensor([j - 1], device=dev),
                                       skip=skip, visible=j - 1, last_only=True, subset=True)  # fmt: skip
        q, cols, _ = _draft_distribution(engine, logits, vocab, sampler, full[:j], [])
        draft[j] = _draws(q, cols, sampler, 1, t=j - len(ids))[0][0]
    return Trace(task, len(ids), full, top, draft)


def measure_costs(model: Model, context: int, skip: SkipSet, sampling: SamplingParams = GREEDY,
                  reps: int = 15) -> Costs:  # fmt: skip
    """Verification over 1..MAX_NODES tokens and one draft step (each with its choice of tokens, as a round
    makes it; under sampling the noise of a position is drawn once, by the verification) at ``context``, in
    one-token steps: medians of ``reps`` interleaved rounds (a slow spell then hits every size alike), the
    curve made non-decreasing in T."""
    from ..cost.costs import _non_decreasing, _text_ids
    from ..decoding.loop import check_finite
    from ..drafters.layerskip import _draft_distribution, _draws

    engine, dev = model.engine, model.engine.device
    context = max(8, min(context, model.max_context - MAX_NODES - 2))
    cache = engine.new_cache(context + MAX_NODES + 1)
    text = _text_ids(model, context)
    engine.forward(cache, text, 0)
    cache.commit(context)
    history = text.tolist()
    sampler = Sampler(replace(sampling, seed=sampling.seed or 0) if not sampling.greedy else sampling,
                      model.adapter.vocab_size, prompt_len=context, device=dev)  # fmt: skip
    times: dict[int | str, list[float]] = {t: [] for t in range(1, MAX_NODES + 1)}
    times["draft"] = []
    pos = 0  # output positions: each verification chooses at new ones (sampled: their noise is drawn then)
    for _ in range(reps + 1):
        for t in range(1, MAX_NODES + 1):  # a verification: every row's logits, checked, and its token chosen
            ids = torch.tensor(history[-t:], device=dev)
            sampler.forget_before(pos)
            t0 = time.perf_counter()
            logits = engine.forward(cache, ids, context)
            check_finite(logits, "whatif")
            sampler.choose(logits, list(range(pos, pos + t)), [history] * t)
            times[t].append(time.perf_counter() - t0)
            pos += t
        t0 = time.perf_counter()  # a draft step: its pass and its token, at a position whose noise is drawn
        logits, vocab = engine.forward(cache, text[-1:], context, skip=skip, last_only=True, subset=True)
        q, cols, _ = _draft_distribution(engine, logits, vocab, sampler, history, [])
        _draws(q, cols, sampler, 1, t=pos - 1)
        times["draft"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round warms up
    curve = _non_decreasing([med[t] for t in range(1, MAX_NODES + 1)])
    return Costs({t: max(curve[t - 1] / curve[0], 1.0) for t in range(1, MAX_NODES + 1)}, med["draft"] / curve[0])


# -- replaying ------------------------------------------------------------------------------------
class Tree:
    """A token tree under construction: node 0 is the root (the round's last known token); ``add`` merges a
    chain below it."""

    def __init__(self) -> None:
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.children)

    def add(self, chain: Sequence[int]) -> None:
        node = 0
        for tok in chain:
            nxt = self.children[node].get(tok)
            if nxt is None:
                nxt = len(self.children)
                self.children.append({})
                self.children[node][tok] = nxt
            node = nxt

    def accepted(self, truth: Sequence[int]) -> int:
        """How many of ``truth``'s tokens the tree holds as a path from the root."""
        node, n = 0, 0
        for tok in truth:
            node = self.children[node].get(tok, -1)
            if node < 0:
                break
            n += 1
        return n


def lookup_chain(index: NgramIndex, text: Sequence[int], length: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest matching n-gram (``pld``'s draft); ``index``
    holds ``text``'s n-grams (:class:`~selfspec.drafters.suffix.NgramIndex`, kept up to date by the caller)."""
    for n in reversed(index.sizes):
        if n < len(text):
            latest = index.continuations(tuple(text[-n:]), length, most=1)
            if latest:
                return latest[0]
    return []


def recycle_chain(adjacency: dict[int, list[int]], root: int, length: int) -> list[int]:
    """Token Recycling's chain: each token's latest top-1 successor as the model itself predicted it."""
    chain, tok = [], root
    for _ in range(length):
        nxt = adjacency.get(tok)
        if not nxt:
            break
        tok = nxt[0]
        chain.append(tok)
    return chain


POLICIES = ("lookup", "recycle", "layerskip", "lookup|recycle", "lookup|layerskip", "lookup+recycle",
            "lookup+layerskip")  # fmt: skip


def replay(traces: Sequence[Trace], costs: Costs, policy: str, *, lookup_len: int = 4, recycle_len: int = 3,
           draft_len: int = 3) -> Replay:  # fmt: skip
    """Replay ``policy`` over ``traces``: ``a|b`` is a where it proposes, else b; ``a+b`` one tree of both."""
    if policy not in POLICIES:
        raise InvalidInputError(f"unknown policy '{policy}'; choose from {', '.join(POLICIES)}")
    merged, sources = "+" in policy, policy.replace("+", "|").split("|")
    result, adjacency = Replay(policy), {}  # the adjacency carries over between prompts (a session)
    for tr in traces:
        pos = tr.prompt_len + 1  # the first output token comes from the prefill
        index = NgramIndex(NGRAM_SIZES, keep=1)
        while pos < len(tr.tokens):
            text, tree, steps = tr.tokens[:pos], Tree(), 0
            index.extend(text[len(index) :])
            for name in sources:
                if name == "lookup":
                    chain = lookup_chain(index, text, lookup_len)
                elif name == "recycle":
                    chain = recycle_chain(adjacency, text[-1], recycle_len)
                else:  # the draft's chain, read along the output (exact while it is accepted)
                    chain = [tr.draft.get(pos + i, -1) for i in range(min(draft_len, len(tr.tokens) - pos))]
                    steps += len(chain)
                tree.add(chain)
                if chain and not merged:
                    break
            accepted = tree.accepted(tr.tokens[pos:])
            for j in range(pos - 1, min(pos + accepted, len(tr.top))):  # the verified rows' predictions
                adjacency[tr.tokens[j]] = tr.top[j]
            gained = min(accepted + 1, len(tr.tokens) - pos)
            cost = steps * costs.draft_step + costs.verify[min(len(tree), MAX_NODES)]
            result.tokens += gained
            result.rounds += 1
            result.cost += cost
            result.nodes += len(tree)
            acc = result.per_task.setdefault(tr.task, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + gained, acc[1] + cost
            pos += gained
    return result


def report(traces: Sequence[Trace], costs: Costs, results: Sequence[Replay]) -> str:
    """A markdown table: each policy's replayed decode speedup overall and per task, M and nodes per round."""
    tasks = list(dict.fromkeys(t.task for t in traces))
    per_task = tasks if len(tasks) > 1 else []
    head = ["policy", "speedup", "M", "nodes/round", *per_task]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r.policy, f"{r.speedup:.2f}x", f"{r.mean_accepted:.2f}", f"{r.nodes / max(r.rounds, 1):.1f}"]
        cells += [f"{r.per_task[t][0] / r.per_task[t][1]:.2f}x" if t in r.per_task else "-" for t in per_task]
        lines.append("| " + " | ".join(cells) + " |")
    curve = ", ".join(f"{t}: {costs.verify[t]:.2f}" for t in (2, 4, 8, 16) if t in costs.verify)
    lines.append("")
    lines.append(
        f"{len(traces)} prompts, {sum(len(t.tokens) - t.prompt_len for t in traces)} output tokens; "
        f"verification over T tokens, in one-token steps: {curve}; a draft step {costs.draft_step:.2f}"
    )
    return "\n".join(lines)
