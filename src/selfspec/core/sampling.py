"""Sampling: the warped distribution both the draft and the full model sample from, and its random source.

:class:`SamplingParams` holds temperature, top-k, top-p and a seed; ``temperature
0`` means greedy decoding.  :func:`warp` turns logits into the distribution a
token is sampled from: temperature, then top-k, then top-p (nucleus), then
renormalisation, in that order for the draft (q) and the full model (p) alike;
speculative sampling is exact only when q is the distribution the draft token
was really drawn from.

All randomness comes from one explicit ``torch.Generator`` per generation,
seeded from ``seed`` (no global RNG state is read or changed), so a seeded run
is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen


GREEDY = SamplingParams()


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[..., V]`` (float32) after temperature, top-k and top-p, renormalised."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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
