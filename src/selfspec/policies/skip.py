"""Skip policies: which sublayers the draft model skips.

A policy *proposes* a skip set once the prompt has been prefilled (it sees the
per-sublayer cosine statistics of the prefill) and may *observe* the outcome
of every verification.  Methods differ only in their policy:

* :class:`StaticPolicy` -- a fixed skip set (Self-SD / Draft & Verify style).
* :class:`AsdPolicy` -- ASD's Adaptive Draft Model Generator (Algorithm 1 of
  "Draft on the Fly"), chosen afresh for every prompt, with the paper's fixed
  alpha / m / n (``asd:preset=paper``).  The default of ``method="asd"`` chooses
  them by expected speedup: :class:`~selfspec.policies.asd.AutoAsdPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.skipset import SkipSet
from ..errors import InvalidInputError
from ..model.engine import SublayerCosine

ASD_VARIANTS = {
    "admg": "CS thresholding + rule 1 (every m-th layer) + rule 2 (keep the last n)",
    "cs": "CS thresholding only",
    "cs+r2": "CS thresholding + rule 2",
    "r1+r2": "rules 1 and 2, no CS thresholding",
}


def admg(cosine: SublayerCosine, *, alpha: float, m: int, n: int, variant: str = "admg") -> SkipSet:
    """Algorithm 1 (ADMG) and its ablation variants (paper Table 5).

    The paper counts layers l = 1..L; the returned skip set is 0-based
    (paper layer l is index l-1).  Rule 2 protects the last n layers from both
    CS thresholding and rule 1.
    """
    if variant not in ASD_VARIANTS:
        raise InvalidInputError(f"unknown ASD variant '{variant}'; choose one of {', '.join(ASD_VARIANTS)}")
    L = len(cosine.attention)
    use_cs = variant in ("admg", "cs", "cs+r2")
    use_r1 = variant in ("admg", "r1+r2")
    keep_last = n if variant != "cs" else 0
    allowed = range(1, L - keep_last + 1)  # paper's 1-based l <= L - n
    remove_attn = {l for l in allowed if use_cs and cosine.attention[l - 1] >= alpha}
    remove_mlp = {l for l in allowed if use_r1 and l % m == 0}
    remove_attn |= remove_mlp
    return SkipSet.of((l - 1 for l in remove_attn), (l - 1 for l in remove_mlp))


class StaticPolicy:
    needs_cosine = False

    def __init__(self, skip_set: SkipSet) -> None:
        self.skip_set = skip_set

    def propose(self, cosine: SublayerCosine | None, num_layers: int) -> SkipSet:
        return self.skip_set.validate(num_layers)

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class AsdPolicy:
    alpha: float = 0.985
    m: int = 3
    n: int = 2
    variant: str = "admg"
    needs_cosine = True

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise InvalidInputError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.m < 1:
            raise InvalidInputError(f"m must be >= 1, got {self.m}")
        if self.n < 0:
            raise InvalidInputError(f"n must be >= 0, got {self.n}")
        if self.variant not in ASD_VARIANTS:
            raise InvalidInputError(f"unknown ASD variant '{self.variant}'; choose one of {', '.join(ASD_VARIANTS)}")

    def propose(self, cosine: SublayerCosine | None, num_layers: int) -> SkipSet:
        assert cosine is not None, "ASD needs the prefill's cosine statistics"
        return admg(cosine, alpha=self.alpha, m=self.m, n=self.n, variant=self.variant)

    def observe(self, drafted: int, accepted: int) -> None:
        pass
