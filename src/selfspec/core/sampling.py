"""Sampling: the distribution a token is drawn from, and the two exact ways of drawing it speculatively.

:class:`SamplingParams` holds the temperature, the cuts (top-k, top-p, min-p),
the penalties (repetition; OpenAI's presence and frequency), a seed and the *scheme*; ``temperature 0``
means greedy decoding (after the penalties).  :func:`scaled_logits` turns logits into the log-weights a token is
drawn from (penalty, temperature, top-k, top-p, min-p, in transformers' order;
``-inf`` outside the kept set) and :func:`warp` into probabilities.  Every cut
is tie-inclusive and computed row by row, so a row gives the same result alone
(vanilla) and inside a verification batch.

Schemes (both exact: the output is distributed exactly as the model's):

* ``coupled`` (default) -- the Gumbel-max trick with noise that depends only on
  (seed, output position t): the token at t is
  ``argmax(scaled_logits + g_t)``.  Vanilla sampling uses it too, so a
  speculative method emits *the same tokens* as vanilla sampling with the same
  seed, whatever was drafted and however long anything took; drafts use the
  same ``g_t`` on the draft's logits and are verified by exact match, like
  greedy drafts (Daliri, Musco & Suresh 2024, "Coupling without
  Communication and Drafter-Invariant Speculative Decoding").
* ``rejection`` -- speculative sampling (Leviathan et al. 2023; Chen et al.
  2023): drafts drawn from q, kept with probability min(1, p/q), the residual
  on rejection (:mod:`selfspec.decoding.acceptance`).  Exact in distribution;
  a seed reproduces a run only where the draft schedule does not read the
  clock.

All randomness comes from explicit ``torch.Generator``s seeded from the seed
(a fresh random seed when none is given); no global RNG state is read or changed.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import InvalidInputError

SCHEMES = ("coupled", "rejection")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None
    min_p: float = 0.0  # 0: no min-p cut
    repetition_penalty: float = 1.0  # 1: none (CTRL's penalty, as transformers applies it)
    scheme: str = "coupled"
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of each token the output holds
    frequency_penalty: float = 0.0  # OpenAI's: times the number of times the output holds the token
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, added to its logit), sorted by id
    grammar: str | None = None  # structured output: an llguidance grammar (decoding/grammar.py makes them)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidInputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidInputError(f"min_p must be in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidInputError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise InvalidInputError(f"{name} must be between -2 and 2 (OpenAI's range), got {value}")
        if isinstance(self.logit_bias, dict):  # a mapping as OpenAI's requests give it: stored sorted, hashable
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidInputError(f"logit_bias: {token!r} is not a token id")
            if not (-100.0 <= bias <= 100.0):
                raise InvalidInputError(f"logit_bias of token {token} must be between -100 and 100, got {bias}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise InvalidInputError("grammar must be a non-empty grammar string (see selfspec.grammar)")
        if self.scheme not in SCHEMES:
            raise InvalidInputError(f"sampling scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_kwargs(self) -> dict:
        """These parameters as the keywords of :meth:`selfspec.api.Session.generate` (and ``selfspec.generate``)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty, "seed": self.seed, "sampling_scheme": self.scheme,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "logit_bias": dict(self.logit_bias), "grammar": self.grammar}

    @property
    def coupled(self) -> bool:
        return not self.greedy and self.scheme == "coupled"

    @property
    def cuts(self) -> bool:
        """Whether top-k, top-p or min-p removes tokens (else every token keeps its weight)."""
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse a ``logit_bias`` naming an id beyond a vocabulary of ``vocab_size`` tokens."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise InvalidInputError(f"logit_bias: token id {self.logit_bias[-1][0]} is not in the model's "
                                    f"vocabulary (ids 0 to {vocab_size - 1})")  # fmt: skip

    @property
    def adjusted(self) -> bool:
        """Whether the logits are changed before the choice (a logit bias, a penalty or a grammar)."""
        return bool(self.logit_bias) or self.reads_history

    @property
    def reads_history(self) -> bool:
        """Whether a row's logits depend on the output before it (a penalty or a grammar)."""
        return self.penalised or self.grammar is not None

    @property
    def penalised(self) -> bool:
        """Whether a token's weight depends on the history (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen


GREEDY = SamplingParams()

@dataclass(frozen=True)
class RowHistory:
    """What the penalties read of one row's history: every distinct id of it, prompt and output (the
    repetition penalty's, as transformers'), and the output's distinct ids with their counts (OpenAI's
    presence and frequency penalties, on the generated tokens alone, as vLLM applies them)."""

    ids: torch.Tensor
    out_ids: torch.Tensor
    out_counts: torch.Tensor  # float32


# per row: a RowHistory, or a tensor of the history's ids (the repetition penalty alone)
Seen = Sequence[RowHistory | torch.Tensor] | None
Columns = Callable[[torch.Tensor], torch.Tensor]  # token ids -> their columns in a subset's logits (-1: absent)


class Constraint(Protocol):
    """What a grammar does to logits (decoding/grammar.py's): -inf where it forbids a token after a row."""

    def apply(self, x: torch.Tensor, histories: Sequence[Sequence[int]],
              columns: Columns | None = None) -> torch.Tensor: ...  # fmt: skip


def rows_maxima_finite(x: torch.Tensor) -> bool:
    """Whether every row's maximum over the last dimension is finite: False where a row holds a NaN or +inf
    anywhere (the maximum propagates both) or no finite value at all.  A CPU float32 tensor goes through numpy
    on one thread: torch's parallel reduction over a row that the head's threads just wrote cost a tenth of a
    SmolLM2 verification round (py-spy, 2026-11-28)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return bool(np.isfinite(x.numpy().max(-1)).all())
    return bool(torch.isfinite(x.amax(-1)).all())


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax over the last dimension (the first of equal maxima, as ``torch.argmax``), as ints.

    A CPU float tensor goes through numpy, whose vectorised argmax takes a tenth of torch's time on our CPUs
    (6 x 49152 logits: 15 us against 170; 4 x 151936: 29 against 344): every greedy round pays it on each
    verified row, so it was up to a twentieth of a verification on a 150k-token vocabulary."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return x.numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def scaled_logits(logits: torch.Tensor, params: SamplingParams, seen: Seen = None) -> torch.Tensor:
    """Log-weights ``[..., V]`` (float32, ``-inf`` outside the kept set) that a token is drawn from.

    ``seen``: per row, the ids of the tokens in that row's history (prompt and
    output before it); needed when a repetition penalty is set.
    """
    x = _biased(logits.float(), params)
    if params.penalised:
        if seen is None:
            raise ValueError("a penalty needs each row's history")
        x = _penalise(x.clone(), seen, params)
    return cut(x / params.temperature, params)


def _biased(x: torch.Tensor, params: SamplingParams, columns: Columns | None = None) -> torch.Tensor:
    """``x`` (float32 logits ``[..., V]``) with OpenAI's ``logit_bias`` added (a new tensor; ``x`` itself when
    there is none); ``columns``: the ids' columns where ``x`` covers a subset of the vocabulary."""
    if not params.logit_bias:
        return x
    ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
    values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    if columns is not None:
        ids = columns(ids)
        ids, values = ids[ids >= 0], values[ids >= 0]
    else:
        inside = ids < x.shape[-1]
        ids, values = ids[inside], values[inside]
    x = x.clone()
    x[..., ids.to(x.device)] += values.to(x.device)
    return x


def cut(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-weights ``x`` (scaled by the temperature) with top-k, top-p and min-p applied: ``-inf`` outside."""
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = _nucleus(x, params.top_p)
    if params.min_p > 0.0:  # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        floor = x.max(dim=-1, keepdim=True).values + math.log(params.min_p)
        x = x.masked_fill(x < floor, float("-inf"))
    return x


def warp(logits: torch.Tensor, params: SamplingParams, seen: Seen = None) -> torch.Tensor:
    """Probabilities ``[..., V]`` (float32) after the penalty and the cuts, renormalised."""
    return scaled_logits(logits, params, seen).softmax(-1)


def _penalise(x: torch.Tensor, seen: Sequence[RowHistory | torch.Tensor], params: SamplingParams) -> torch.Tensor:
    """``x`` (rows of logits, changed in place) with the penalties applied: the repetition penalty first, then
    the frequency and presence ones (vLLM's order)."""
    rows = x.reshape(-1, x.shape[-1])
    if len(seen) != rows.shape[0]:
        raise ValueError(f"{len(seen)} histories for {rows.shape[0]} rows")
    penalty, presence, frequency = params.repetition_penalty, params.presence_penalty, params.frequency_penalty
    for row, h in zip(rows, seen, strict=True):
        ids = h if isinstance(h, torch.Tensor) else h.ids
        if penalty != 1.0 and ids.numel():
            v = row[ids]
            row[ids] = torch.where(v < 0, v * penalty, v / penalty)
        if (presence or frequency) and not isinstance(h, torch.Tensor) and h.out_ids.numel():
            row[h.out_ids] -= frequency * h.out_counts.to(row.device) + presence
    return x


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row, the most likely tokens up to the first whose cumulative mass reaches ``top_p``, and every
    token tied with the last one kept (so the cut does not depend on how a sort orders ties).

    Looks at the top 64, 512, ... values rather than sorting the whole vocabulary (a full sort of 262k
    logits costs ~18 ms on 2 cores; the top 64 usually hold the nucleus)."""
    V = x.shape[-1]
    lse = x.logsumexp(-1, keepdim=True)
    k = min(64, V)
    while True:
        top = x.topk(k, dim=-1).values  # sorted, descending
        p = (top - lse).exp()
        before = p.cumsum(-1) - p  # mass of the tokens ranked above each one
        kept = (before < top_p).sum(-1, keepdim=True)  # >= 1: the top token always stays
        if k == V or bool((kept < k).all()):
            break
        k = min(k * 8, V)
    last = top.gather(-1, kept - 1)
    return x.masked_fill(x < last, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` ``[V]``."""
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` distinct tokens, as k successive draws from ``probs`` each excluding the earlier ones.

    The Gumbel-top-k trick: the k largest of log p + Gumbel noise are such
    draws, in order (Kool et al. 2019).  Fewer come back when fewer tokens
    have non-zero probability.
    """
    k = min(k, int((probs > 0).sum()))
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    keys = torch.log(probs.double()) + gumbel  # -inf where p = 0
    return keys.topk(k).indices.tolist()


_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch multiplies with (wrapping, as two's complement does)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(seed: int, t: int) -> int:
    """A 64-bit key for output position ``t`` (splitmix64 of seed and t): distinct positions get unrelated
    streams."""
    z = (seed * _GOLDEN + (t + 1) * _MIX1) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def gumbel_at(key: int | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log u)`` (float64) for token ``ids``: ``u`` in (0, 1) on a grid of 2^24 steps, from
    splitmix64's output function of ``key + (id + 1) * golden``.  Each token's value depends on (key, id)
    alone, so any subset of the vocabulary is drawn alike in any order, batch or device; the grid bounds every
    value to [-2.86, 17.33] (see :data:`REACH`).  ``key``: one 64-bit key, or a tensor of them (as int64)
    broadcast against ``ids``, e.g. one per row."""
    offset = key + _signed(_GOLDEN) if isinstance(key, torch.Tensor) else _signed((key + _GOLDEN) & _MASK64)
    z = ids.to(torch.int64) * _signed(_GOLDEN) + offset
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    u = (_shr(z, 40).double() + 0.5) * 2.0**-24  # the top 24 bits (splitmix's last xor-shift leaves them as is)
    return -(-u.log()).log()


G_MAX = -math.log(-math.log1p(-(2.0**-25))) + 1e-9  # the largest Gumbel value gumbel_at can return (17.33)
PROBE = 8  # top log-weights whose noise sets a row's bar before the rest is drawn
DRAW_ALL = 512  # rows of at most this many tokens are drawn whole


def perturbed_topk(keys: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Per row, the columns of the ``k`` largest ``w + g`` (best first), g the noise of ``ids`` under the row's
    key (``keys`` ``[T, 1]``, ``ids`` and log-weights ``w`` ``[T, K]``, -inf where excluded).

    The noise is drawn for few tokens: that of the PROBE largest w sets a bar (their k-th best score; the
    true k-th best is no lower), and a token whose w + G_MAX is under the bar cannot make the top k.  At
    temperature 1 without cuts this leaves a few thousand of SmolLM2's tens of thousands of tokens in reach."""
    k = min(k, w.shape[-1])
    if w.shape[-1] <= DRAW_ALL:  # few tokens (a nucleus): drawing them all costs less than probing
        return (w.double() + gumbel_at(keys, ids)).topk(k, dim=-1).indices
    probe_w, probe_j = w.topk(min(max(PROBE, k), w.shape[-1]), dim=-1)
    probe = probe_w.double() + gumbel_at(keys, ids.gather(-1, probe_j))
    bar = probe.topk(k, dim=-1).values[:, -1:] - G_MAX
    rows, cols = ((w.double() >= bar) & (w > float("-inf"))).nonzero(as_tuple=True)
    scores = torch.full(w.shape, float("-inf"), dtype=torch.float64, device=w.device)
    scores[rows, cols] = w[rows, cols].double() + gumbel_at(keys[rows, 0], ids[rows, cols])
    return scores.topk(k, dim=-1).indices


# Gumbel values on the grid of gumbel_at lie in [-log(-log(1 - 2^-25)), -log(-log 2^-25)] = [-2.86, 17.33]:
# a token whose log-weight is more than REACH below the row's largest never wins the argmax, whatever the
# noise (and holds e^-REACH ~ 1e-9 of the mass or less).  Only the tokens within REACH are cut and drawn.
REACH = 20.5


def _gather_rows(y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked entries, left-aligned in id order: (ids ``[T, K]``, values ``[T, K]``), K the largest
    count, padded with id 0 and value -inf (all rows' tokens in a few batched operations)."""
    rows, cols = mask.nonzero(as_tuple=True)  # row-major
    counts = torch.bincount(rows, minlength=y.shape[0])
    slot = torch.arange(len(cols), device=y.device) - (counts.cumsum(0) - counts)[rows]
    width = int(counts.max())
    ids = torch.zeros(y.shape[0], width, dtype=torch.int64, device=y.device)
    vals = torch.full((y.shape[0], width), float("-inf"), dtype=y.dtype, device=y.device)
    ids[rows, slot] = cols
    vals[rows, slot] = y[rows, cols]
    return ids, vals


WHOLE_ROWS_MAX_VOCAB = 1 << 17  # vocabularies up to this size are perturbed and cut row by whole row


class PositionNoise:
    """Gumbel noise ``g_t[i]`` per output position t and token id i, a function of (seed, t, i) only.

    Two ways to draw it, by vocabulary size (fixed per model, so every path of one generation agrees):

    * up to :data:`WHOLE_ROWS_MAX_VOCAB` tokens (SmolLM2's 49k): one vector per position from torch's
      generator seeded by (seed, t), kept until :meth:`forget_before`; a choice perturbs whole rows (contiguous
      passes over 49k values cost less than picking candidates out of them: 0.6 against 2.4 ms for 8 rows);
    * larger vocabularies (Gemma 3's 262k): :func:`gumbel_at` for the ids a choice reads, the tokens within
      REACH of a row's best (a whole 262k vector cost ~0.8 ms a position; the candidates, a few thousand).
    """

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.vocab_size, self.device = seed, vocab_size, device
        self.whole_rows = vocab_size <= WHOLE_ROWS_MAX_VOCAB
        self._cache: dict[int, torch.Tensor] = {}

    def vector(self, t: int) -> torch.Tensor:
        """The whole vocabulary's noise at position t (float32 ``[V]``; whole-row mode only)."""
        g = self._cache.get(t)
        if g is None:
            gen = torch.Generator(device=self.device).manual_seed(_mix(self.seed, t) & 0x7FFFFFFFFFFFFFFF)
            u = torch.rand(self.vocab_size, generator=gen, device=self.device).clamp_min_(1e-30)
            g = self._cache[t] = -(-u.log()).log()
        return g

    def at(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        """The noise of ``ids`` at position t (float64)."""
        if self.whole_rows:
            return self.vector(t)[ids].double()
        return gumbel_at(_mix(self.seed, t), ids)

    def keys(self, positions: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """The noise keys of output ``positions``, as a column ``[T, 1]`` (int64) for :func:`perturbed_topk`."""
        return torch.tensor([[_signed(_mix(self.seed, t))] for t in positions], dtype=torch.int64, device=device)

    def forget_before(self, t: int) -> None:
        for key in [k for k in self._cache if k < t]:
            del self._cache[key]


class Sampler:
    """One generation's sampling: the rule that picks the full model's token, and the draft's candidates.

    ``history``: the token ids before a row (prompt and output so far), for
    the repetition penalty; an output position t counts new tokens (0 = the
    first one), so a history of ``prompt_len + t`` tokens precedes position t.
    """

    def __init__(self, params: SamplingParams, vocab_size: int = 0, *, prompt_len: int = 0,
                 device: torch.device | str = "cpu", constraint: Constraint | None = None) -> None:  # fmt: skip
        self.params, self.prompt_len = params, prompt_len
        if (params.grammar is None) != (constraint is None):
            raise ValueError("a grammar needs its constraint (decoding/grammar.py), and only a grammar has one")
        self.constraint = constraint
        if vocab_size > 0:
            params.check_vocabulary(vocab_size)
        self.generator: torch.Generator | None = None
        self.noise: PositionNoise | None = None
        if params.greedy:
            return
        if params.coupled:
            if vocab_size <= 0:
                raise ValueError("coupled sampling needs the vocabulary size")
            seed = secrets.randbits(63) if params.seed is None else int(params.seed)
            self.noise = PositionNoise(seed, vocab_size, device)
        else:
            self.generator = params.generator(device)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def coupled(self) -> bool:
        return self.noise is not None

    @property
    def records_q(self) -> bool:
        """Whether acceptance needs the draft distributions (the rejection scheme)."""
        return self.generator is not None

    def position(self, history_len: int) -> int:
        return history_len - self.prompt_len

    def extend(self, history: Sequence[int], path: Sequence[int]) -> Sequence[int]:
        """``history`` followed by ``path`` where the penalty reads it (else ``history``, uncopied)."""
        return [*history, *path] if self.params.reads_history and path else history

    def _seen(self, histories: Sequence[Sequence[int]], device, columns: Columns | None = None) -> Seen:
        """Per row, the ids its history holds (the penalty's tokens), as columns of the logits when those cover
        a subset of the vocabulary (``columns`` maps ids to the subset's columns, dropping ids outside it)."""
        if not self.params.penalised:
            return None
        seen = []
        for h in histories:
            ids = torch.tensor(sorted(set(h)), dtype=torch.long, device=device)
            counts = Counter(h[self.prompt_len :])
            out_ids = torch.tensor(list(counts), dtype=torch.long, device=device)
            out_counts = torch.tensor(list(counts.values()), dtype=torch.float32, device=device)
            if columns is not None:  # (columns come from the CPU: moved to the logits' device)
                ids = columns(ids).to(device)
                ids = ids[ids >= 0]
                out_ids = columns(out_ids).to(device)
                out_ids, out_counts = out_ids[out_ids >= 0], out_counts[out_ids >= 0]
            seen.append(RowHistory(ids, out_ids, out_counts))
        return seen

    # -- the full model ------------------------------------------------------------------------
    def choose(self, logits: torch.Tensor, positions: Sequence[int], histories: Sequence[Sequence[int]]) -> list[int]:
        """The full model's token after each row of ``logits`` ``[T, V]``: argmax (greedy) or argmax of the
        log-weights plus the position's noise (coupled).  Not for the rejection scheme."""
        seen = self._seen(histories, logits.device)
        logits = self._constrained(logits, histories)
        if self.greedy and not self.params.adjusted:
            return argmax_rows(logits)
        x = _biased(logits.float(), self.params)
        if seen is not None:
            x = _penalise(x.clone(), seen, self.params)
        if self.greedy:  # the bias and the penalties apply to greedy choices too (transformers' greedy search)
            return argmax_rows(x)
        assert self.noise is not None, "the rejection scheme samples during acceptance"
        if self.noise.whole_rows:
            g = torch.stack([self.noise.vector(t) for t in positions])
            return argmax_rows(cut(x / self.params.temperature, self.params) + g)
        temperature, keys = self.params.temperature, self.noise.keys(positions, x.device)
        floor = x.amax(-1, keepdim=True) - REACH * temperature  # every token that can win lies above (REACH)
        if not self.params.cuts:  # all kept: the top few tokens' scores raise the floor (see perturbed_topk)
            probe_x, probe_ids = x.topk(min(PROBE, x.shape[-1]), dim=-1)
            bar = (probe_x.double() / temperature + gumbel_at(keys, probe_ids)).amax(-1, keepdim=True) - G_MAX
            floor = torch.maximum(floor, (bar * temperature).float() - 1e-3 * temperature)
        ids, w = _gather_rows(x, x >= floor)
        w = cut(w / temperature, self.params)  # the padding is -inf: a token outside the kept set, in every cut
        best = perturbed_topk(keys, ids, w)
        return ids.gather(-1, best).squeeze(-1).tolist()

    def _constrained(self, logits: torch.Tensor, histories: Sequence[Sequence[int]],
                     columns: Columns | None = None) -> torch.Tensor:  # fmt: skip
        """``logits`` with what the grammar forbids after each row's history at -inf (as is without one)."""
        return logits if self.constraint is None else self.constraint.apply(logits, histories, columns)

    def forget_before(self, t: int) -> None:
        """Positions before t are decided: their noise is not needed again."""
        if self.noise is not None:
            self.noise.forget_before(t)

    def probs(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        """The full model's distribution after each row (the rejection scheme's p)."""
        return warp(self._constrained(logits, histories), self.params, self._seen(histories, logits.device))

    def next_token(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """The token after ``history`` from one row of logits ``[V]`` (vanilla decoding)."""
        if self.records_q:
            return sample(self.probs(logits[None], [history])[0], self.generator)
        return self.choose(logits[None], [self.position(len(history))], [history])[0]

    # -- the draft -----------------------------------------------------------------------------
    def draft_distribution(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The draft's distribution q ``[V]`` after ``history``: its softmax (after the penalty) when greedy,
        else warped as the full model's is (what the rejection scheme weighs drafts by)."""
        if self.greedy:
            return self.greedy_draft_logits(logits, history).softmax(-1)
        x = self._constrained(logits[None], [history])
        return warp(x, self.params, self._seen([history], logits.device))[0]

    def greedy_draft_logits(self, logits: torch.Tensor, history: Sequence[int],
                            columns: Columns | None = None) -> torch.Tensor:  # fmt: skip
        """A greedy draft's logits ``[V']`` (float32) as the full model's choice will weigh them: with the logit
        bias and the penalties where set (``columns``: the ids' columns where the logits cover a subset)."""
        x = _biased(self._constrained(logits[None], [history], columns)[0].float(), self.params, columns)
        seen = self._seen([history], logits.device, columns)
        return x if seen is None else _penalise(x[None].clone(), seen, self.params)[0]

    def coupled_draft_distribution(self, logits: torch.Tensor, history: Sequence[int],
                                   columns: Columns | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A coupled draft's q over its candidates, and their columns of ``logits`` ``[V']``: the tokens within
        REACH of the best log-weight (after the penalty), warped among themselves.  A draft only proposes (its
        tokens are verified by exact match), so narrowing it costs nothing but the rare far-off proposal, and
        spares the cut and the noise a pass over a 16-30k-token draft vocabulary (~0.2 ms a step)."""
        x = _biased(self._constrained(logits[None], [history], columns).float(), self.params, columns)
        seen = self._seen([history], logits.device, columns)
        if seen is not None:
            x = _penalise(x.clone(), seen, self.params)
        cols = (x[0] >= x.max() - REACH * self.params.temperature).nonzero().squeeze(1)
        return cut(x[0, cols] / self.params.temperature, self.params).softmax(-1), cols

    def draft_tokens(self, q: torch.Tensor, k: int, t: int, vocab: torch.Tensor | None = None) -> list[int]:
        """Up to ``k`` distinct candidates for output position ``t``, best first, as columns of ``q`` (token
        ids when q covers the whole vocabulary; ``vocab``: the token ids of q's columns when it covers a subset).

        Greedy: q's top k.  Coupled: the top k of log q plus ``g_t``, the noise
        the full model's choice at t will use (at the same token ids), so a draft
        as good as the model proposes the model's token.  Rejection: k draws
        without replacement from q (acceptance then needs q over the whole vocabulary).
        """
        if self.greedy:
            return q.topk(min(k, q.shape[-1])).indices.tolist()
        if self.noise is not None:
            cols = (q > 0).nonzero().squeeze(1)  # the kept set
            ids = cols if vocab is None else vocab[cols]
            if self.noise.whole_rows:
                scores = q[cols].double().log() + self.noise.at(t, ids)
                return cols[scores.topk(min(k, len(cols))).indices].tolist()
            best = perturbed_topk(self.noise.keys([t], q.device), ids[None], q[cols].log()[None], k)[0]
            return cols[best].tolist()
        if vocab is not None:
            raise ValueError("the rejection scheme draws from q over the whole vocabulary")
        return sample_without_replacement(q, k, self.generator)


GREEDY_SAMPLER = Sampler(GREEDY)
