"""Sampling: the distribution a token is drawn from, and the two exact ways of drawing it speculatively.

:class:`SamplingParams` holds the temperature, the cuts (top-k, top-p, min-p),
the repetition penalty, a seed and the *scheme*; ``temperature 0`` means greedy
decoding.  :func:`scaled_logits` turns logits into the log-weights a token is
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
from collections.abc import Sequence
from dataclasses import dataclass

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
        if self.scheme not in SCHEMES:
            raise InvalidInputError(f"sampling scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        return not self.greedy and self.scheme == "coupled"

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen


GREEDY = SamplingParams()

Seen = Sequence[torch.Tensor] | None  # per row: the token ids of its history (for the repetition penalty)


def scaled_logits(logits: torch.Tensor, params: SamplingParams, seen: Seen = None) -> torch.Tensor:
    """Log-weights ``[..., V]`` (float32, ``-inf`` outside the kept set) that a token is drawn from.

    ``seen``: per row, the ids of the tokens in that row's history (prompt and
    output before it); needed when a repetition penalty is set.
    """
    x = logits.float()
    if params.penalised:
        if seen is None:
            raise ValueError("a repetition penalty needs each row's history")
        x = _penalise(x.clone(), seen, params.repetition_penalty)
    x = x / params.temperature
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


def _penalise(x: torch.Tensor, seen: Sequence[torch.Tensor], penalty: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if len(seen) != rows.shape[0]:
        raise ValueError(f"{len(seen)} histories for {rows.shape[0]} rows")
    for row, ids in zip(rows, seen, strict=True):
        if ids.numel():
            v = row[ids]
            row[ids] = torch.where(v < 0, v * penalty, v / penalty)
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


def _mix(seed: int, t: int) -> int:
    """A 63-bit generator seed for output position ``t`` (splitmix64 of seed and t): distinct positions get
    unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (t + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class PositionNoise:
    """Gumbel noise ``g_t`` ``[V]`` per output position t, a function of (seed, t) only; computed once per
    position (~0.75 ms for a 262k vocabulary on 2 cores) and kept until :meth:`forget_before`."""

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.vocab_size, self.device = seed, vocab_size, device
        self._cache: dict[int, torch.Tensor] = {}

    def __call__(self, t: int) -> torch.Tensor:
        g = self._cache.get(t)
        if g is None:
            gen = torch.Generator(device=self.device).manual_seed(_mix(self.seed, t))
            u = torch.rand(self.vocab_size, generator=gen, device=self.device).clamp_min_(1e-30)
            g = self._cache[t] = -(-u.log()).log()
        return g

    def forget_before(self, t: int) -> None:
        for key in [k for k in self._cache if k < t]:
            del self._cache[key]


class Sampler:
    """One generation's sampling: the rule that picks the full model's token, and the draft's candidates.

    ``history``: the token ids before a row (prompt and output so far), for
    the repetition penalty; an output position t counts new tokens (0 = the
    first one), so a history of ``prompt_len + t`` tokens precedes position t.
    """

    def __init__(self, params: SamplingParams, vocab_size: int = 0, device: torch.device | str = "cpu",
                 prompt_len: int = 0) -> None:  # fmt: skip
        self.params, self.prompt_len = params, prompt_len
        self.generator: torch.Generator | None = None
        self.noise: PositionNoise | None = None
        if params.greedy:
            return
        if params.coupled:
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
        return [*history, *path] if self.params.penalised and path else history

    def _seen(self, histories: Sequence[Sequence[int]], device) -> Seen:
        if not self.params.penalised:
            return None
        return [torch.tensor(sorted(set(h)), dtype=torch.long, device=device) for h in histories]

    # -- the full model ------------------------------------------------------------------------
    def choose(self, logits: torch.Tensor, positions: Sequence[int], histories: Sequence[Sequence[int]]) -> list[int]:
        """The full model's token after each row of ``logits`` ``[T, V]``: argmax (greedy) or argmax of the
        log-weights plus the position's noise (coupled).  Not for the rejection scheme."""
        if self.greedy:
            return logits.argmax(-1).tolist()
        assert self.noise is not None, "the rejection scheme samples during acceptance"
        x = scaled_logits(logits, self.params, self._seen(histories, logits.device))
        g = torch.stack([self.noise(t) for t in positions])
        return (x + g).argmax(-1).tolist()

    def probs(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        """The full model's distribution after each row (the rejection scheme's p)."""
        return warp(logits, self.params, self._seen(histories, logits.device))

    def next_token(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """The token after ``history`` from one row of logits ``[V]`` (vanilla decoding)."""
        if self.records_q:
            return sample(self.probs(logits[None], [history])[0], self.generator)
        return self.choose(logits[None], [self.position(len(history))], [history])[0]

    def forget_before(self, t: int) -> None:
        if self.noise is not None:
            self.noise.forget_before(t)

    # -- the draft -----------------------------------------------------------------------------
    def draft_distribution(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The draft's distribution q ``[V]`` after ``history``: its plain softmax when greedy, else warped as
        the full model's is."""
        if self.greedy:
            return logits.float().softmax(-1)
        return warp(logits[None], self.params, self._seen([history], logits.device))[0]

    def draft_tokens(self, q: torch.Tensor, k: int, t: int) -> list[int]:
        """Up to ``k`` distinct candidates for output position ``t``, best first.

        Greedy: q's top k.  Coupled: the top k of log q plus ``g_t``, the noise
        the full model's choice at t will use, so a draft as good as the model
        proposes the model's token.  Rejection: k draws without replacement
        from q (acceptance then needs q).
        """
        if self.greedy:
            return q.topk(min(k, q.shape[-1])).indices.tolist()
        if self.noise is not None:
            k = min(k, int((q > 0).sum()))
            return (q.log() + self.noise(t)).topk(k).indices.tolist()
        return sample_without_replacement(q, k, self.generator)


GREEDY_SAMPLER = Sampler(GREEDY)
