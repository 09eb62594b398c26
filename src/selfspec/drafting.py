"""Draft-length policies: when to stop drafting and hand over to verification.

* :class:`AdaptiveDraftExit` -- Draft & Verify's adaptive draft exiting
  (Zhang et al. 2024, section 3.4): stop when the draft's top-1 probability
  falls below a threshold gamma that is itself tuned after every verification
  towards a target acceptance rate.  State carries over between prompts.
* :class:`FixedDraftLength` -- always draft k tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidInputError


@dataclass
class AdaptiveDraftExit:
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
        if self.max_draft < 1:
            raise InvalidInputError(f"max_draft must be >= 1, got {self.max_draft}")

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
class FixedDraftLength:
    k: int = 4

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InvalidInputError(f"draft_length must be >= 1, got {self.k}")

    @property
    def max_draft(self) -> int:
        return self.k

    def should_stop(self, drafted: int, top1_prob: float) -> bool:
        return drafted >= self.k

    def observe(self, drafted: int, accepted: int) -> None:
        pass
