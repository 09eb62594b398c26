"""Measured costs of the forward pass on this machine, profiled once per model and cached.

Speculative decoding trades draft work for fewer full-model passes; where the
trade pays depends on the hardware.  On a GPU a pass over 8 tokens costs about
what a pass over 1 costs; on our 2-core CPU it costs 1.5-2x (DESIGN.md section
4).  Draft lengths, tree widths and skip sets are therefore chosen from a
:class:`CostProfile` measured here, not from constants of GPU papers:

* ``forward_ms[T]``: one verification over T new tokens (T = 1..64): the full-model pass with the logits of
  all T rows (a verification needs each row's token; a large LM head, such as Gemma 3's 262k rows, makes
  this nearly twice a pass that keeps only the last row), their finiteness check and their argmax;
* ``head_ms[T]``: the full LM head alone over T final hidden states (T = 1..16), with the same check and
  argmax: what verifies a draft that skipped nothing (head-only verification, :func:`verification`);
* ``prompt_ms[T]``: a prompt's pass over T tokens (``PROMPT_ROWS``, the last row's logits only, on the prompt's own
  path), which the simulated clock charges a prompt with (:meth:`CostProfile.pass_ms`);
* per draft precision (the model's own dtype, and float16 / bfloat16 copies
  of the linear weights, see :mod:`selfspec.core.kernels`): what one attention /
  MLP sublayer adds to a one-token pass (averaged over the layers), the rest
  (embedding, final norm, LM head), so a draft's cost is predicted from its
  skip set, and how often its greedy token agrees with the full model's on a
  text (a precision that overflows, as float16 does on some models, shows
  here and is not used).

The profile is cached as JSON under ``$SELFSPEC_CACHE/profiles`` keyed by the
model, its shape, device, dtype, thread count and torch version; delete the
file (or ``python -m selfspec.cost.costs MODEL --force``) to re-measure.  Timings
are noisy on shared machines: every figure is the lower quartile of repeated,
interleaved runs, and ``forward_ms`` is made non-decreasing in T.  Draft passes are timed as a round makes
them, a few in a row after a verification (what the caches hold shifts a short pass by milliseconds).
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..core import clock, native_thread
from ..core.heap import return_free_heap
from ..core.quant import LOW_BIT_DRAFT
from ..core.skipset import SkipSet
from ..io import atomic_write_text, cache_dir

# 5: forward_ms times verifications (all rows' logits), not last-row passes; 6: cheaper check;
# 7: query heads of one key/value head attended together; 8: sublayer costs from draft passes only; 9: head_ms
# (a version 8 profile is still read: its head costs are derived, CostProfile.head); 10: the low-bit draft "q4"
# (an older profile of a model that has low-bit drafts is measured again: it lacks their costs); 11: prompt_ms (an
# older profile is still read: a prompt's cost is then extrapolated from the 64-row pass); 12: draft passes timed in
# runs after a verification (_draft_run_ms; a cached profile of an older version is measured again, a given one read)
PROFILE_VERSION = 12
READABLE_VERSIONS = (8, 9, 10, 11, 12)
PROMPT_ROWS = 256  # tokens of the timed prompt pass (prompt_ms)
GRID = (*range(1, 13), 16, 20, 24, 32, 48, 64)
HEAD_GRID = (1, 2, 3, 4, 6, 8, 12, 16)  # rows of the head-only timings (a round's nodes: max_draft + 1 at most)
DRAFT_RUN = 3  # draft passes timed in a row (_draft_run_ms), as a round drafts them ...
DRAFT_AFTER = 4  # ... right after a verification over this many rows
# q4: the fused stack's 4-bit copies of a quantised model's 8-bit layer weights (core/quant.py, LOW_BIT_DRAFT)
PRECISIONS = {"same": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "q4": LOW_BIT_DRAFT}
# "auto"'s draft precision is priced (CostProfile.best_precision): a precision agreeing with the full model on fewer
# greedy tokens than this is taken as broken (a half-precision pass that overflowed agrees on about half)
MIN_AGREEMENT = 0.7
# ... and one other than the model's own (copies of its weights, memory) must be predicted this much faster: a
# 4-bit copy of Qwen2.5-Coder 0.5B's Q8_0 weights (87.5% agreement, a draft step 0.63 of one in its own weights,
# its draft vocabulary holding 96.5% of the tokens) is predicted 9% faster than head-only rounds in its own weights,
# and ran 1.33x vanilla against their 1.09x (30 Spec-Bench prompts, prefill included)
PRECISION_MARGIN = 0.05

# A neutral text for the agreement check (any tokenizer can encode it).
_TEXT = (
    "The committee met on Tuesday to discuss the new budget. Several members argued that the funds for "
    "public transport should be increased, while others wanted to lower taxes. After a long debate, they "
    "agreed to publish a report next month. def add(a, b):\n    return a + b\n"
)


@dataclass(frozen=True)
class DraftCosts:
    """One-token pass costs in one draft precision."""

    attention_ms: float  # per attention sublayer
    mlp_ms: float  # per MLP sublayer
    base_ms: float  # embedding + final norm + LM head
    agreement: float  # share of positions where its greedy token equals the full model's


@dataclass(frozen=True)
class CostProfile:
    key: str
    forward_ms: dict[int, float]  # T -> ms of one full-model pass over T new tokens
    drafts: dict[str, DraftCosts]  # precision name ("same", "float16", ...) -> costs
    num_layers: int
    head_ms: dict[int, float] = field(default_factory=dict)  # T -> ms of the full head over T rows (may be empty)
    spread: float = 1.0  # median upper / lower quartile of the full passes' timings (past BUSY_SPREAD: busy)
    others: float = 0.0  # cores' worth of our CPUs other work took while measuring (past BUSY_OTHERS: busy)
    prompt_ms: dict[int, float] = field(default_factory=dict)  # T -> ms of a prompt's pass over T tokens (may be empty)
    coverage: float = 1.0  # share of the full model's tokens its draft vocabulary held (_vocab_coverage; 1: none)

    def forward(self, tokens: int) -> float:
        """ms of a full-model pass over ``tokens`` new tokens (linear interpolation, extrapolated past 64).
        Memoised per size: the pricing of a round asks for the same few sizes dozens of times (the n-gram
        sources' tree selection, about 25 lookups a round), and a profile's tables never change once made."""
        memo = self.__dict__.get("_forward_memo")
        if memo is None:
            memo = self.__dict__["_forward_memo"] = {}  # (frozen: set beside the fields, not one of them)
        ms = memo.get(tokens)
        if ms is None:
            ms = memo[tokens] = _interpolate(self.forward_ms, tokens)
        return ms

    def head(self, tokens: int) -> float:
        """ms of the full LM head over ``tokens`` final hidden states, with the check and argmax a verification
        makes.  Measured (``head_ms``), or, for a profile without it (version 8, hand-written ones), derived: a
        one-token pass less a draft step that keeps every sublayer (the full head less the draft vocabulary's,
        a slight underestimate), growing with the rows as a full pass does."""
        if self.head_ms:
            return _interpolate(self.head_ms, tokens)
        one = max(0.0, self.forward(1) - self.draft_step(_NOTHING, "same"))
        return one * self.forward(tokens) / self.forward(1)

    def verification(self, tokens: int, draft_step: float | None = None) -> float:
        """ms of verifying a round of ``tokens`` nodes (root included; one: a plain round, a full one-token pass).
        A full-model pass over them; or, given ``draft_step`` (the ms of the draft's step), a head-only one (a
        draft that skipped nothing: drafters/layerskip.py): one more draft step over the last drafted token and
        the full head over every node's hidden state.  The one price of verification that ASD's choice
        (:func:`verify_curve`) and the per-round economy (:class:`~selfspec.cost.economy.Economy`) both read."""
        if draft_step is None or tokens <= 1:
            return self.forward(tokens)
        return draft_step + self.head(tokens)

    def verify_curve(self, max_draft: int, draft_step: float | None = None) -> list[float]:
        """V_k for k = 1..``max_draft`` drafted tokens: :meth:`verification` of k + 1 nodes over a one-token
        pass (``draft_step``: head-only rounds, see there)."""
        one = self.forward(1)
        return [self.verification(k + 1, draft_step) / one for k in range(1, max_draft + 1)]

    def draft_step(self, skip: SkipSet, precision: str = "same") -> float:
        """Predicted ms of a one-token draft pass with ``skip`` in ``precision``: the base (embedding, final
        norm, the draft's head) plus the sublayers it keeps.  Skipping nothing it is still a draft: every
        sublayer, but the head over the draft vocabulary only (core/draft_vocab.py), so it may cost well under
        a full pass (Qwen2.5 0.5B: its 152k-row head is ~40% of a step).  In the model's own precision it is
        never priced above a full pass (a model without a draft vocabulary drafts with the full head)."""
        c = self.drafts[precision]
        kept_attn = self.num_layers - len(skip.attention)
        kept_mlp = self.num_layers - len(skip.mlp)
        ms = c.base_ms + kept_attn * c.attention_ms + kept_mlp * c.mlp_ms
        return min(ms, self.forward(1)) if precision == "same" else ms

    def pass_ms(self, tokens: int, skip: SkipSet, precision: torch.dtype | None = None, *,
                draft: bool = False, last_only: bool = False) -> float:  # fmt: skip
        """Predicted ms of any pass: a full one over ``tokens`` rows, or a draft (``draft``, a skip set or a
        ``precision``; the simulated clock's charge).  A draft that skips sublayers or reads lower-precision
        copies grows with its rows as a full pass does, scaled by its one-row cost; one that is the whole model
        over a smaller head (``draft`` alone) adds a full pass's cost per extra row (measured on the Intel VM,
        2026-11-30, extra rows of 2 / 3 / 5: Qwen2.5-Coder 0.5B 0.85 / 1.72 / 3.52 ms against a full pass's
        1.08 / 2.00 / 4.31, Gemma 3 0.50 / 0.71 / 1.57 against 0.38 / 0.96 / 2.53, where the scaled rule
        gave a third of that; with half the attention sublayers skipped Gemma 3's draft added 0.01 / 0.37 /
        0.84).  ``last_only``: the head over the last row alone (a prompt's pass), where ``forward`` times a
        verification's head over every row: a 64-row pass of Qwen2.5-Coder 0.5B spends 40 of its 138 ms there."""
        ms = self.prompt(tokens) if last_only else self.forward(tokens)
        reduced = bool(skip.attention or skip.mlp) or precision is not None  # reads fewer or narrower weights
        if draft or reduced:
            name = next((n for n, d in PRECISIONS.items() if d == precision and n in self.drafts), "same")
            step = self.draft_step(skip, name)
            ms = ms * step / self.forward(1) if reduced else ms + step - self.forward(1)
        return ms

    def prompt(self, tokens: int) -> float:
        """ms of a pass over ``tokens`` rows that keeps the last row's logits alone (a prompt): a verification less its
        head's extra rows up to 64 rows, then toward the measured prompt pass (``prompt_ms``) and along its slope."""
        def up_to_64(t: int) -> float:
            return max(self.forward(t) - self.head(t) + self.head(1), self.forward(1))

        if tokens <= max(self.forward_ms) or not self.prompt_ms:
            return up_to_64(tokens)
        top = max(self.forward_ms)
        return _interpolate({top: up_to_64(top), **{t: ms for t, ms in self.prompt_ms.items() if t > top}}, tokens)

    def draft_ratio(self, skip: SkipSet, precision: str = "same") -> float:
        """c: draft step cost / full one-token pass."""
        return self.draft_step(skip, precision) / self.forward(1)

    def best_precision(self, head_only: bool = False) -> str:
        """The draft precision "auto" means: the one whose chains of drafts keeping every sublayer are predicted to
        earn the most (:meth:`chain_speedup`: its measured step and agreement priced together, so a cheaper copy
        that agrees less wins where it saves more than it loses), another than the model's own only where
        ``PRECISION_MARGIN`` faster and agreeing on ``MIN_AGREEMENT`` of tokens at least.  ``head_only``: a draft in
        the model's own precision that skips nothing is verified by the full head alone
        (:func:`~selfspec.cost.economy.verifies_by_head`), the others by full passes (Gemma 3: its 262k-row head
        is most of a step, and the q4 copies of its layers save less than a verification pass costs)."""
        own = self.chain_speedup("same", head_only)
        others = {name: self.chain_speedup(name, False) for name, c in self.drafts.items()
                  if name != "same" and c.agreement >= MIN_AGREEMENT}  # fmt: skip
        best = max(others, key=others.get, default=None)
        return best if best is not None and others[best] >= (1 + PRECISION_MARGIN) * own else "same"

    def chain_speedup(self, precision: str, head_only: bool, max_draft: int = 12) -> float:
        """Predicted speedup of drafting chains that skip nothing in ``precision``, at their best length, each
        token kept with the precision's measured agreement; ``head_only``: verified by the full head alone."""
        step = self.draft_step(_NOTHING, precision)
        a = min(self.agreement(precision), 0.99)
        best = 0.0
        for k in range(1, max_draft + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            cost = k * step + self.verification(k + 1, step if head_only else None)
            best = max(best, tokens * self.forward(1) / cost)
        return best

    def agreement(self, precision: str = "same") -> float:
        """The share of tokens a draft in ``precision`` that skips nothing is predicted to agree with the full model
        on: its measured greedy agreement, times the draft vocabulary's ``coverage`` (a draft cannot propose a token
        its head lacks): what :meth:`chain_speedup` prices a precision's chains with."""
        return self.drafts[precision].agreement * self.coverage

    def write(self, path: Path) -> None:
        """The profile as JSON at ``path`` (what :meth:`from_dict` reads back), written atomically."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["forward_ms"] = {str(k): v for k, v in self.forward_ms.items()}
        d["head_ms"] = {str(k): v for k, v in self.head_ms.items()}
        d["prompt_ms"] = {str(k): v for k, v in self.prompt_ms.items()}
        d["version"] = PROFILE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostProfile:
        """A profile as :meth:`to_dict` wrote it; one of version 8 has no ``head_ms`` (derived: :meth:`head`)."""
        d = dict(d)
        if d.pop("version", None) not in READABLE_VERSIONS:
            raise ValueError("profile version")
        d["forward_ms"] = {int(k): float(v) for k, v in d["forward_ms"].items()}
        d["head_ms"] = {int(k): float(v) for k, v in d.get("head_ms", {}).items()}
        d["prompt_ms"] = {int(k): float(v) for k, v in d.get("prompt_ms", {}).items()}
        d["drafts"] = {k: DraftCosts(**v) for k, v in d["drafts"].items()}
        return cls(**d)


_NOTHING = SkipSet()


def _interpolate(table: dict[int, float], tokens: int) -> float:
    """``table`` at ``tokens`` rows: linear between its sizes, extrapolated past the largest."""
    grid = sorted(table)
    if tokens <= grid[0]:
        return table[grid[0]]
    for lo, hi in zip(grid, grid[1:], strict=False):
        if tokens <= hi:
            f = (tokens - lo) / (hi - lo)
            return table[lo] + f * (table[hi] - table[lo])
    lo, hi = grid[-2], grid[-1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return table[hi] + slope * (tokens - hi)


def profile_key(model) -> str:
    cfg = model.hf.config
    shape = f"{cfg.model_type}-{model.num_layers}x{cfg.hidden_size}-v{model.adapter.vocab_size}"
    place = f"{model.adapter.device}-{str(model.adapter.dtype).replace('torch.', '')}-t{native_thread.threads()}"
    quant = getattr(model, "quantization", "none")
    if quant != "none":
        from ..core.quant import int8_activations, kv_cache_auto_dtype, kv_cache_dtype

        place += "-" + "".join(ch if ch.isalnum() else "_" for ch in quant)
        place += "-a8" if int8_activations() else ""  # int8 activations: other products, other costs
        kv = kv_cache_dtype()  # a cache form other than the activations' own: other attention costs
        if kv != kv_cache_auto_dtype():
            place += "-kv" + {torch.float16: "f16", torch.float32: "f32"}.get(kv, "q8")
    kernels = getattr(getattr(model, "kernel_report", None), "key", "")  # costs follow the kernels chosen
    kernels += "|" + getattr(getattr(model, "engine", None), "path_signature", "")  # ... and the native code
    digest = hashlib.sha1(f"{model.name}|{shape}|{place}|{torch.__version__}|{kernels}".encode()).hexdigest()[:10]
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model.name.split("/")[-1])
    return f"{safe}-{shape}-{place}-{digest}"


def _profile_dir() -> Path:
    return cache_dir("profiles")


_MEMORY: dict[str, CostProfile] = {}


def cost_profile(model, *, force: bool = False, cache: bool = True) -> CostProfile:
    """The model's profile: from memory, from the disk cache, or measured now (a few seconds) and saved;
    under :func:`selfspec.core.clock.simulated`, the profile given there."""
    given = clock.given_profile(model)
    if given is not None:
        return given
    key = profile_key(model)
    if not force and key in _MEMORY:
        return _MEMORY[key]
    path = _profile_dir() / f"{key}.json"
    prof = None
    if cache and not force and path.is_file():
        try:
            saved = json.loads(path.read_text())
            prof = CostProfile.from_dict(saved) if saved.get("version") == PROFILE_VERSION else None
        except (ValueError, KeyError, TypeError, AttributeError):
            prof = None  # stale or damaged: measure again
        if prof is not None:
            prof = fitted(prof, model)
    if prof is None:
        print(f"selfspec: measuring the decoding costs of {model.name} on this machine (once, about "
              f"{_estimate_s(model):.0f} s)...", file=sys.stderr)
        prof = measure_profile(model, key=key)
        best = prof.best_precision(getattr(model.engine, "draft_vocab", None) is not None)  # (alone: not batched)
        model.adapter.release_draft_copies(PRECISIONS[best])  # keep only the copy "auto" uses
        if best != "q4":
            model.engine.release_low_bit()
        if prof.spread > clock.BUSY_SPREAD or prof.others > clock.BUSY_OTHERS:  # kept for this process only
            why = (f"timings of one pass {prof.spread:.1f}x apart between quartiles" if prof.spread > clock.BUSY_SPREAD
                   else f"other work took {prof.others:.1f} cores' worth of its CPUs")  # fmt: skip
            print(f"selfspec: the machine was busy while measuring ({why}); these costs are not saved and are "
                  "measured again next time", file=sys.stderr)  # fmt: skip
        elif cache:
            prof.write(path)
    _MEMORY[key] = prof
    return prof


def prepare_costs(model, *policies) -> None:
    """Measure (or load) the cost profile now if one of ``policies`` will need it, and make the 4-bit draft copies
    if one drafts with them, so that the first timed generation pays for neither."""
    if any(getattr(p, "needs_profile", False) for p in policies if p is not None):
        cost_profile(model)
    if any(p is not None and hasattr(p, "precision") and p.precision(model) == "q4" for p in policies):
        model.engine.prepare_low_bit()


def _estimate_s(model) -> float:
    """A rough duration of :func:`measure_profile` for the progress line: about 80 passes of growing size."""
    report = getattr(model, "kernel_report", None)
    one = [t[1] for t in (report.ms.get(report.model_dtype, {}) if report else {}).values() if 1 in t]
    step = min(one) if one else 30.0  # ms of a one-token pass as measured by the kernel choice
    return max(1.0, 10 * len(GRID) * 3 * step / 1000)


@torch.inference_mode()
def measure_profile(model, *, key: str = "", reps: int = 9, context: int = 128) -> CostProfile:
    """Time full passes over 1..64 tokens, the full head alone over 1..16 rows, and one-token draft passes per
    precision with sublayers left out."""
    engine = model.engine
    L = model.num_layers
    context = max(8, min(context, model.max_context // 2 - max(GRID)))
    pool = _text_ids(model, context + max(GRID))  # the timed passes' tokens: text, not random ids (the draft
    # vocabulary learns what verifications are fed: thousands of random ids would grow the draft's head)
    vocab_before = engine.draft_vocab.learned() if engine.draft_vocab is not None else None
    text_ids = pool[:context]
    cache = engine.new_cache(context + max(GRID))
    hidden: list[torch.Tensor] = []  # the text's final hidden states: the head's timed input
    full_top = _top_tokens(engine, cache, text_ids, hidden_out=hidden)
    cache.commit(context)
    gen = random.Random(0)
    coverage = _vocab_coverage(model, full_top)

    precisions = draft_precisions(model)
    agreement = {"same": 1.0}
    for name, dtype in precisions.items():
        if dtype is not None:
            scratch = engine.new_cache(context)
            top = _top_tokens(engine, scratch, text_ids, precision=dtype)
            agreement[name] = float((top == full_top).float().mean())

    configs: dict[str, tuple[int, SkipSet, torch.dtype | None]] = {f"T{t}": (t, SkipSet(), None) for t in GRID}
    configs |= {f"H{t}": (t, SkipSet(), None) for t in HEAD_GRID if t <= context}
    # Half the sublayers of a kind left out, not all: a pass with no attention at all drives some models'
    # hidden states to values where low-precision arithmetic slows down (seen: 70 ms instead of 18).
    half = range(0, L, 2)
    for name, dtype in precisions.items():
        configs[f"{name}/half-attention"] = (1, SkipSet.of(half, []), dtype)
        configs[f"{name}/half-mlp"] = (1, SkipSet.of([], half), dtype)
        configs[f"{name}/no-layers"] = (1, SkipSet.of(range(L), range(L)), dtype)
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    with clock.OtherLoad() as load:  # steady load from elsewhere slows every timing alike: watched apart
        for rep in range(reps + 1):  # the first sweep warms up (and makes the low-precision copies); discarded
            gen.shuffle(names)  # interleaved: machine drift hits every configuration alike
            for name in names:
                T, skip, dtype = configs[name]
                at = gen.randrange(len(pool) - max(T, DRAFT_AFTER) + 1)
                ids = pool[at : at + T]
                if "/" in name:  # a draft configuration: timed as decoding runs drafts (see DRAFT_RUN)
                    ms = _draft_run_ms(engine, cache, pool[at : at + DRAFT_AFTER], ids, context, skip, dtype)
                else:
                    _sync(engine.device)
                    t0 = time.perf_counter()
                    if name.startswith("H"):
                        _head_check(engine, hidden[0][:, :T])
                    else:
                        _verification(engine, cache, ids, context)
                    _sync(engine.device)
                    ms = 1000 * (time.perf_counter() - t0)
                if rep:
                    times[name].append(ms)
        prompt = _prompt_pass_ms(model, min(PROMPT_ROWS, model.max_context // 2))

    def q1(name: str) -> float:
        return statistics.quantiles(times[name], n=4)[0] if len(times[name]) > 1 else times[name][0]

    # A pass over more tokens never costs less: the least-squares non-decreasing fit smooths the noise away
    # without letting one slow sample raise every larger T (as a running maximum would).
    forward = dict(zip(GRID, _non_decreasing([statistics.median(times[f"T{t}"]) for t in GRID]), strict=True))
    drafts = {name: _sublayer_costs(q1(f"{name}/no-layers"), q1(f"{name}/half-attention"), q1(f"{name}/half-mlp"),
                                    L, len(half), agreement[name]) for name in precisions}  # fmt: skip
    heads = [t for t in HEAD_GRID if f"H{t}" in times]
    head = dict(zip(heads, _non_decreasing([statistics.median(times[f"H{t}"]) for t in heads]), strict=True))
    spread = statistics.median(clock.quartile_spread(times[f"T{t}"]) for t in GRID)
    # the passes' freed [T, V] logits (60-80 MB on a 152k vocabulary) given back once timed: trimming between
    # passes would make a pass pay the first touch of pages that decoding's passes find in the heap
    return_free_heap()
    if vocab_before is not None:
        engine.draft_vocab.restore(vocab_before)  # the draft vocabulary as decoding left it
    return CostProfile(key or profile_key(model), forward, drafts, L, head, spread, round(load.cores, 3), prompt,
                       coverage)


def _prompt_pass_ms(model, rows: int, reps: int = 3) -> dict[int, float]:
    """{rows: median ms} of a prompt's pass over ``rows`` tokens of text on an empty cache, on the prompt's own path
    (the last row's logits only); empty where the model's context holds too few for one past the 64-row grid."""
    if rows <= max(GRID):
        return {}
    engine = model.engine
    ids = _text_ids(model, rows)
    times = []
    for _ in range(reps):
        cache = engine.new_cache(rows)
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.forward(cache, ids, 0, prefill=True, last_only=True)
        _sync(engine.device)
        times.append(1000 * (time.perf_counter() - t0))
    return {rows: statistics.median(times)}


def fitted(prof: CostProfile, model) -> CostProfile | None:
    """A cached profile as it applies to ``model`` now: None where it lacks a draft precision the model has (measured
    by an older version: measure again); without the precisions the model no longer offers (low-bit copies of a
    1.5B Q4_K_M file, since dropped as saving too little), which must never be picked (that would make them)."""
    offered = draft_precisions(model)
    if set(offered) - set(prof.drafts):
        return None
    if set(prof.drafts) - set(offered):
        return replace(prof, drafts={k: v for k, v in prof.drafts.items() if k in offered})
    return prof


def draft_precisions(model) -> dict[str, torch.dtype | None]:
    """The draft precisions a profile of ``model`` measures: its own, float16 / bfloat16 copies where its linears
    are plain float weights, ``q4`` where the fused stack has 8-bit weights to requantise (quantised models)."""
    if model.adapter.low_precision_drafts:
        return {n: d for n, d in PRECISIONS.items() if d is None or (d != model.adapter.dtype and n != "q4")}
    low_bit = getattr(model.engine, "low_bit_drafts", False)
    return {"same": None} | ({"q4": LOW_BIT_DRAFT} if low_bit else {})


def _sublayer_costs(base: float, half_attention: float, half_mlp: float, L: int, h: int,
                    agreement: float) -> DraftCosts:  # fmt: skip
    """Per-sublayer costs from three draft passes alike in all but the sublayers they keep: none (``base``:
    embedding, norm, the draft's head), all but ``h`` attention sublayers, all but ``h`` MLP sublayers.

    With a attention and m MLP ms per sublayer: half_attention - base = (L - h) a + L m and half_mlp - base =
    L a + (L - h) m, so a + m and m - a follow.  Only draft passes enter: a draft scores a subset of the
    vocabulary (core/draft_vocab.py), a full pass all of it, and on a model whose head is most of a step
    (Gemma 3: 262k rows) mixing the two priced a half-skipped draft at 3.2 ms that took 1.6."""
    A, M = max(0.0, half_attention - base), max(0.0, half_mlp - base)
    both, diff = (A + M) / (2 * L - h), (A - M) / h  # a + m, m - a
    return DraftCosts(max(0.0, (both - diff) / 2), max(0.0, (both + diff) / 2), base, agreement)


@torch.inference_mode()
def decode_step_ms(model, rows=(1, 2, 4, 8, 16), *, context: int = 128, reps: int = 15,
                   verify: bool = False, spread: dict[int, float] | None = None) -> dict[int, float]:  # fmt: skip
    """Median ms of one full-model pass over T new tokens on a warm cache of ``context`` tokens (the figure
    ``selfspec kernels`` sets against the weight-read bound); with ``verify``, of a verification (every row's
    logits and argmax, as a speculative round needs them).  The sizes are interleaved, so that a spell of
    load from elsewhere hits every T alike; ``spread`` (if given) receives each T's upper / lower quartile,
    which tells a busy machine (a quiet one stays under ~1.2)."""
    engine = model.engine
    context = max(8, min(context, model.max_context // 2 - max(rows)))
    cache = engine.new_cache(context + max(rows))
    engine.forward(cache, _text_ids(model, context), 0)
    cache.commit(context)
    gen = random.Random(0)
    times: dict[int, list[float]] = {T: [] for T in rows}
    for rep in range(reps + 1):  # the first sweep warms up; discarded
        for T in rows:
            ids = torch.tensor([gen.randrange(model.adapter.vocab_size) for _ in range(T)], device=engine.device)
            _sync(engine.device)
            t0 = time.perf_counter()
            if verify:
                _verification(engine, cache, ids, context)
            else:
                engine.forward(cache, ids, context, last_only=True)
            _sync(engine.device)
            if rep:
                times[T].append(1000 * (time.perf_counter() - t0))
    if spread is not None:
        spread.update({T: clock.quartile_spread(ts) for T, ts in times.items()})
    return {T: statistics.median(ts) for T, ts in times.items()}


def _top_tokens(engine, cache, ids: torch.Tensor, *, chunk: int = max(HEAD_GRID), precision=None,
                hidden_out: list | None = None) -> torch.Tensor:
    """Each position's argmax over a prefill of ``ids`` into ``cache``, ``chunk`` tokens a pass (a 150k-token
    vocabulary's logits for the whole text would take 80 MB; ``hidden_out`` receives the first pass's hidden
    states, at least the head timings' rows)."""
    tops = []
    for at in range(0, len(ids), chunk):
        logits = engine.forward(cache, ids[at : at + chunk], at, precision=precision,
                                hidden_out=hidden_out if at == 0 else None)  # fmt: skip
        tops.append(logits.argmax(-1))
    return torch.cat(tops)


def _draft_run_ms(engine, cache, after: torch.Tensor, ids: torch.Tensor, start: int, skip: SkipSet,
                  dtype: torch.dtype | None) -> float:  # fmt: skip
    """Mean ms of a one-token draft pass over ``ids`` with ``skip`` in ``dtype`` as decoding makes them: ``DRAFT_RUN``
    passes in a row right after a verification (untimed) over the ``DRAFT_AFTER`` tokens ``after``. A pass timed alone
    between unrelated ones is not what a round pays: what the last pass left in the caches shifts a short pass by
    several ms (seen on a Xeon VM: a draft pass reading a few MB took 1 ms after its like, 3-4 ms after a verification,
    5-6 after a 64-row one), and draft copies smaller than the full weights are partly found in the cache from one draft
    step to the next (Qwen2.5-Coder 0.5B's 4-bit copies: 11.5, 10.5, 10.2 ms after a verification, 9 ms in a long run,
    13-19 ms timed between unrelated passes, which priced them no cheaper than the model's own weights)."""
    _verification(engine, cache, after, start)
    _sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(DRAFT_RUN):
        engine.forward(cache, ids, start, skip=skip, last_only=True, precision=dtype)
    _sync(engine.device)
    return 1000 * (time.perf_counter() - t0) / DRAFT_RUN


def _verification(engine, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """What a round's verification computes from its T tokens (:meth:`Decoder._verify`, greedy acceptance):
    every row's logits, checked finite, and each row's argmax."""
    from ..decoding.loop import check_finite

    logits = engine.forward(cache, ids, start)  # [T, V]
    check_finite(logits, "profiling")
    return logits.argmax(-1)


def _head_check(engine, hidden: torch.Tensor) -> torch.Tensor:
    """What a head-only verification computes from T final hidden states (``[1, T, H]``): the full head's logits
    (:meth:`Engine.head_logits`), checked finite, and each row's argmax."""
    from ..decoding.loop import check_finite

    logits = engine.head_logits([hidden])
    check_finite(logits, "profiling")
    return logits.argmax(-1)


def _non_decreasing(values: list[float]) -> list[float]:
    """Isotonic regression (pool adjacent violators), equal weights."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    out: list[float] = []
    for mean, count in blocks:
        out.extend([mean] * int(count))
    return out


def _text_ids(model, length: int) -> torch.Tensor:
    """``length`` tokens: the neutral text (:func:`_text_tokens`) repeated."""
    ids = _text_tokens(model)
    ids = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor(ids, dtype=torch.long, device=model.engine.device)


def _text_tokens(model) -> list[int]:
    """The neutral text's token ids, once (a fixed pattern where the tokenizer cannot encode it)."""
    try:
        ids = list(model.tokenizer(_TEXT)["input_ids"])
    except Exception:  # a tokenizer that cannot encode plain text: fall back to a fixed token pattern
        ids = []
    vocab = model.adapter.vocab_size
    ids = [i for i in ids if 0 <= i < vocab]  # (a tokenizer larger than the model's embedding)
    return ids or [(i * 7919) % vocab for i in range(64)]


def _vocab_coverage(model, full_top: torch.Tensor) -> float:
    """The share of the full model's greedy tokens on the neutral text that its draft vocabulary
    (core/draft_vocab.py) held when they came: the base rows and the text read so far, over the text's first
    reading (1.0 without a draft vocabulary).  A draft cannot propose the others, so every draft precision agrees
    with the full model this much less often: on Spec-Bench answers of 96 tokens (10 prompts, every category)
    Qwen2.5-Coder 0.5B's subset held 96.5% of the tokens (this text: 96.5%), SmolLM2's 97.8% (96.6%), Gemma 3's 91.1%
    (88.3%).  A chain of drafts that skip nothing stops at the first miss: priced as never missing, drafts in the own
    weights of Qwen's Q8_0 requantisation were predicted 1.28x vanilla's decoding, with the coverage 1.12x, and
    decoded 1.12x (30 Spec-Bench prompts, prefill left out)."""
    dv = model.engine.draft_vocab
    if dv is None:
        return 1.0
    text = _text_tokens(model)[: len(full_top)]
    seen = set(dv.ids[: dv.base_size].tolist())
    held = 0
    for fed, nxt in zip(text, full_top.tolist(), strict=False):
        seen.add(fed)
        held += nxt in seen
    return held / max(1, len(text))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- a profile from the model's shape (the simulated clock's: selfspec.core.clock) ---------------------
ROW_COST = 0.06  # each further verified row adds this share of a one-token pass (CPUs here: 0.04-0.15)


def read_bound_profile(model_or_engine: Any) -> CostProfile:
    """The costs of a machine where a pass is bound by reading the weights: each sublayer costs its weights'
    size, the head its rows, every further verified row ``ROW_COST`` of a pass.  Made from the model's shape
    alone, so it is the same on every CPU: the profile the test suite decides with."""
    engine = getattr(model_or_engine, "engine", model_or_engine)
    cfg = engine.adapter.config
    H = int(cfg.hidden_size)
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    hd = int(getattr(cfg, "head_dim", None) or H // n_q)
    inter = int(cfg.intermediate_size)
    L = engine.num_layers
    per_million = 1.0  # ms per million weights: the scale cancels in every ratio a decision reads
    attention = per_million * (2 * H * n_q * hd + 2 * H * n_kv * hd) / 1e6
    mlp = per_million * 3 * H * inter / 1e6
    layers = 0.02 * L * (attention + mlp)  # norms, residuals, rotary: a small share per layer
    base = per_million * (int(engine.adapter.vocab_size) * H) / 1e6 + layers
    one = base + L * (attention + mlp)
    forward = {t: one * (1 + ROW_COST * (t - 1)) for t in GRID}
    same = DraftCosts(attention, mlp, per_million * _draft_head_rows(engine) * H / 1e6 + layers, 1.0)
    drafts = {"same": same} | {name: same for name in PRECISIONS if name != "same"}  # no cheaper copies
    full_head = per_million * int(engine.adapter.vocab_size) * H / 1e6
    head = {t: full_head * (1 + ROW_COST * (t - 1)) for t in HEAD_GRID}
    return CostProfile(f"read-bound-{L}x{H}", forward, drafts, L, head)


def _draft_head_rows(engine: Any) -> int:
    """Rows a draft's head reads: the draft vocabulary's starting size where the engine keeps one (a shape
    figure: the subset grows with the tokens seen), else the whole vocabulary."""
    vocab = int(engine.adapter.vocab_size)
    if getattr(engine, "draft_vocab", None) is None:
        return vocab
    from ..core.draft_vocab import BASE_ROWS

    return min(vocab, BASE_ROWS + BASE_ROWS // 2)


def _main() -> None:  # pragma: no cover - a manual tool
    import argparse

    from ..model.models import load

    p = argparse.ArgumentParser(description="measure (or show) the cost profile of a model on this machine")
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    args = p.parse_args()
    prof = cost_profile(load(args.model), force=args.force)
    print(json.dumps(prof.to_dict(), indent=1))


if __name__ == "__main__":  # pragma: no cover
    _main()
