"""What one generation reports: counts, times, and the paper metrics derived from them (DESIGN.md section 3)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerationStats:
    method: str
    prompt_tokens: int
    new_tokens: int
    forwards: int  # full-model forwards, prefill included (vanilla: one per token)
    draft_forwards: int
    drafted: int
    accepted: int
    prefill_time: float
    draft_time: float
    verify_time: float
    total_time: float
    stop_reason: str  # "eos" | "length"
    optimise_time: float = 0.0  # SWIFT's skip-set optimisation steps
    skip_set: dict[str, Any] | None = None
    cosine: dict[str, list[float]] | None = None  # prefill's per-sublayer cosine, when measured
    accept_lengths: tuple[int, ...] = field(default=(), repr=False)  # accepted drafts per round
    verified_tokens: int = 0  # tokens through verification passes (tree nodes included)
    draft_precision: str | None = None
    sources: dict[str, dict[str, Any]] | None = None  # per draft source (hybrid): rounds, drafted, accepted, ms
    draft_pass_time: float | None = None  # drafting time of the rounds that ran draft passes (None: not recorded)
    reused_tokens: int = 0  # prompt tokens whose keys and values came from a prefix store, not prefilled
    grammar_drafted: int = 0  # of ``drafted``: tokens a grammar forced (structured output), drafted for free
    grammar_accepted: int = 0

    @property
    def mean_generated_length(self) -> float:
        """M: new tokens per full-model forward (bonus token included)."""
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.total_time / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["accept_lengths"] = list(self.accept_lengths)
        d.update(
            M=self.mean_generated_length,
            acceptance_rate=self.acceptance_rate,
            tokens_per_second=self.tokens_per_second,
            ms_per_token=self.ms_per_token,
        )
        return d
