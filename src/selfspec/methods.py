"""The method registry: names, their options, and the policies they build.

Every method is a pair (skip policy, draft-length policy) plugged into the
same decode loop; ``vanilla`` has neither.  Options are validated here so that
a typo gives a clear error listing what the method accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .drafting import AdaptiveDraftExit, FixedDraftLength
from .errors import InvalidInputError
from .policies import ASD_VARIANTS, AsdPolicy, StaticPolicy
from .skipset import SkipSet

DRAFT_OPTIONS = {
    "max_draft": "most tokens drafted per round (default 12)",
    "draft_length": "draft exactly this many tokens per round instead of D&V's adaptive exit",
    "gamma": "initial confidence threshold of the adaptive exit (default 0.6)",
}


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    options: dict[str, str]
    build_skip_policy: Callable[[dict[str, Any]], Any] | None


def _asd(opts: dict[str, Any]) -> AsdPolicy:
    return AsdPolicy(
        alpha=float(opts.get("alpha", 0.985)),
        m=int(opts.get("m", 3)),
        n=int(opts.get("n", 2)),
        variant=str(opts.get("variant", "admg")),
    )


def _static(opts: dict[str, Any]) -> StaticPolicy:
    skip = opts.get("skip_set")
    if skip is None:
        raise InvalidInputError(
            "method 'static' (or 'selfsd') needs a skip set (--skip-set FILE_OR_JSON, or skip_set=...); "
            "`selfspec search` finds one"
        )
    if not isinstance(skip, SkipSet):
        skip = SkipSet.from_dict(skip) if isinstance(skip, dict) else SkipSet.parse(skip)
    return StaticPolicy(skip)


METHODS: dict[str, MethodSpec] = {
    "vanilla": MethodSpec("vanilla", "plain autoregressive decoding on our engine (the baseline)", {}, None),
    "asd": MethodSpec(
        "asd",
        "ASD: skip set from prefill cosine similarity (ADMG), per prompt",
        {
            "alpha": "cosine threshold: attention sublayers with mean cosine >= alpha are skipped (default 0.985)",
            "m": "rule 1: skip every m-th layer's attention and MLP (default 3)",
            "n": "rule 2: never skip the last n layers (default 2)",
            "variant": "ablation: " + "; ".join(f"{k} = {v}" for k, v in ASD_VARIANTS.items()),
            **DRAFT_OPTIONS,
        },
        _asd,
    ),
    "static": MethodSpec(
        "static",
        "a fixed skip set given as a JSON file or literal (Self-SD style)",
        {"skip_set": "JSON file path or literal, or a SkipSet", **DRAFT_OPTIONS},
        _static,
    ),
}
# Self-SD (Draft & Verify): a static skip set, typically one found by `selfspec search`
METHODS["selfsd"] = MethodSpec(
    "selfsd",
    "Self-SD / Draft & Verify: a skip set found offline by `selfspec search`",
    METHODS["static"].options,
    _static,
)


def build_policies(method: str, options: dict[str, Any]):
    """(skip policy, draft policy) for a method, or (None, None) for vanilla."""
    spec = METHODS.get(method)
    if spec is None:
        raise InvalidInputError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
    opts = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(opts) - set(spec.options))
    if unknown:
        valid = ", ".join(spec.options) or "none"
        raise InvalidInputError(f"method '{method}' has no option(s) {', '.join(unknown)}; valid: {valid}")
    if spec.build_skip_policy is None:
        return None, None
    try:
        skip_policy = spec.build_skip_policy(opts)
        if "draft_length" in opts:
            draft_policy = FixedDraftLength(int(opts["draft_length"]))
        else:
            draft_policy = AdaptiveDraftExit(
                gamma=float(opts.get("gamma", 0.6)), max_draft=int(opts.get("max_draft", 12))
            )
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"method '{method}': bad option value: {exc}") from None
    return skip_policy, draft_policy
