"""The method registry: names, their options, and the policies they build.

Every method is a pair (skip policy, draft-length policy) plugged into the
same decode loop; ``vanilla`` has neither.  Options are validated here so that
a typo gives a clear error listing what the method accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .core.skipset import SkipSet
from .drafters.layerskip import (
    DRAFT_DTYPES,
    AdaptiveDraftExit,
    ConfidenceExit,
    CostAwareExit,
    CostAwareTreeWidths,
    Drafter,
    FixedDraftLength,
    PaperTreeWidths,
)
from .errors import InvalidInputError
from .policies.asd import AutoAsdConfig, AutoAsdPolicy, DraftGate
from .policies.skip import ASD_VARIANTS, AsdPolicy, StaticPolicy
from .policies.swift import SwiftConfig, SwiftPolicy

DRAFT_OPTIONS = {
    "max_draft": "most tokens drafted per round (default 12)",
    "draft_length": "draft exactly this many tokens per round instead of D&V's adaptive exit",
    "gamma": "initial confidence threshold of the adaptive exit (default 0.6)",
    "draft_dtype": "precision of the draft passes' weights: " + ", ".join(DRAFT_DTYPES)
    + " (default auto: the cheapest one that agrees with the full model, measured once per model)",
}


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    options: dict[str, str]
    build_skip_policy: Callable[[dict[str, Any]], Any] | None
    build_drafter: Callable[[dict[str, Any]], Drafter] | None = None  # default: D&V's chain drafting


ASD_PINNED = ("alpha", "m", "n")  # ADMG's own values: giving one pins ADMG (preset=paper)
ASD_AUTO_ONLY = ("explore_every",)


def _asd_preset(opts: dict[str, Any]) -> str:
    """'auto' (the default) or 'paper'; alpha, m or n given imply 'paper', and so does a variant without a preset
    (a row of Table 5 with the paper's values; ``preset=auto`` with a variant chooses among that row's rules)."""
    pinned = [k for k in ASD_PINNED if k in opts]
    preset = str(opts.get("preset", "paper" if pinned or "variant" in opts else "auto"))
    if preset not in ("auto", "paper"):
        raise InvalidInputError(f"preset must be 'auto' or 'paper', got {preset!r}")
    if preset == "auto" and pinned:
        raise InvalidInputError(
            f"preset=auto chooses alpha, m and n itself; drop {', '.join(pinned)} or use preset=paper"
        )
    given = [k for k in ASD_AUTO_ONLY if k in opts]
    if preset == "paper" and given:
        raise InvalidInputError(f"{', '.join(given)} applies to preset=auto only (ADMG's values are pinned)")
    return preset


def _asd(opts: dict[str, Any]) -> AsdPolicy | AutoAsdPolicy:
    if _asd_preset(opts) == "auto":
        return AutoAsdPolicy(AutoAsdConfig(explore_every=int(opts.get("explore_every", 16)),
                                           rules=str(opts.get("variant", "all"))))  # fmt: skip
    return AsdPolicy(
        alpha=float(opts.get("alpha", 0.985)),
        m=int(opts.get("m", 3)),
        n=int(opts.get("n", 2)),
        variant=str(opts.get("variant", "admg")),
    )


def _asd_drafter(opts: dict[str, Any]) -> Drafter:
    """D&V's chain drafting; under preset=auto behind the gate through which the policy skips losing rounds."""
    drafter = _chain_drafter(opts)
    if _asd_preset(opts) == "auto":
        drafter.length = DraftGate(drafter.length)
    return drafter


class VocabDrafter(Drafter):
    """Method ``vocab``: drafts that skip nothing, made only where the model has a draft vocabulary (elsewhere
    such a draft is the full model itself, which saves nothing: plain rounds)."""

    def draft(self, model, *args, **kwargs):
        return None if model.engine.draft_vocab is None else super().draft(model, *args, **kwargs)


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
        "ASD: skip set from prefill cosine similarity (ADMG), per prompt; alpha/m/n chosen by expected speedup "
        "(skipping nothing, verified by the head alone as vocab, where that pays)",
        {
            "preset": "'auto' (default: alpha, m and n chosen per model and machine from the cosine profile, the "
            "acceptance observed and the measured costs; rounds that would lose are plain decoding) or 'paper' "
            "(alpha 0.985, m 3, n 2; implied by giving alpha, m or n, or a variant without preset=auto)",
            "alpha": "preset=paper: cosine threshold: attention sublayers with mean cosine >= alpha are skipped "
            "(default 0.985)",
            "m": "preset=paper: rule 1: skip every m-th layer's attention and MLP (default 3)",
            "n": "preset=paper: rule 2: never skip the last n layers (default 2)",
            "variant": "the rules (Table 5's ablation): " + "; ".join(f"{k} = {v}" for k, v in ASD_VARIANTS.items())
            + "; with preset=auto the choice is among that row's rules only (default all: every candidate)",
            "explore_every": "preset=auto: while no choice pays, draft once after this many plain rounds "
            "(default 16; the wait doubles, up to 8x, while drafting keeps losing)",
            **DRAFT_OPTIONS,
        },
        _asd,
        _asd_drafter,
    ),
    "static": MethodSpec(
        "static",
        "a fixed skip set given as a JSON file or literal (Self-SD style)",
        {"skip_set": "JSON file path or literal, or a SkipSet", **DRAFT_OPTIONS},
        _static,
    ),
    "vocab": MethodSpec(
        "vocab",
        "the whole model drafts, scoring only its draft vocabulary; the full head alone verifies (large vocabularies)",
        {k: v for k, v in DRAFT_OPTIONS.items() if k != "draft_dtype"},
        lambda opts: StaticPolicy(SkipSet.of([], [])),
        lambda opts: VocabDrafter(_chain_drafter(opts).length, None, "same"),
    ),
    "lowbit": MethodSpec(
        "lowbit",
        "the whole model drafts from 4-bit copies of its own 5-8-bit weights (QSpec / ML-SpecQD style, no "
        "training; quantised models), scoring its draft vocabulary; a full pass verifies",
        {k: v for k, v in DRAFT_OPTIONS.items() if k != "draft_dtype"},
        lambda opts: StaticPolicy(SkipSet.of([], [])),
        lambda opts: Drafter(_chain_drafter(opts).length, None, "q4"),
    ),
}



def _swift(opts: dict[str, Any]) -> SwiftPolicy:
    keys = ("context_window", "skip_ratio", "objective", "bo_interval", "max_steps", "patience", "score_threshold",
            "search", "budget", "give_up_after", "seed")  # fmt: skip
    config = SwiftConfig(**{k: opts[k] for k in keys if k in opts})
    return SwiftPolicy(config, state_path=opts.get("state"))


def _swift_drafter(opts: dict[str, Any]) -> Drafter:
    """SWIFT's drafting: early-stop chain + top-k leaves; by measured costs, or the paper's schedule."""
    schedule = str(opts.get("schedule", "cost"))
    if schedule not in ("cost", "paper"):
        raise InvalidInputError(f"schedule must be 'cost' or 'paper', got {schedule!r}")
    if "draft_length" in opts:
        length = FixedDraftLength(int(opts["draft_length"]))
    elif schedule == "paper":
        length = ConfidenceExit(epsilon=float(opts.get("epsilon", 0.8)), max_draft=int(opts.get("max_draft", 25)))
    else:
        length = CostAwareExit(max_draft=int(opts.get("max_draft", 16)))
    tree = None
    if _flag(opts.get("tree", True), "tree"):
        tree = PaperTreeWidths() if schedule == "paper" else CostAwareTreeWidths()
    return Drafter(length, tree, str(opts.get("draft_dtype", "auto")))


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise InvalidInputError(f"{name} must be true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    return bool(value)


METHODS["swift"] = MethodSpec(
    "swift",
    "SWIFT: skip set optimised on the fly from the generated text; early-stop drafting; token trees",
    {
        "context_window": "tokens of a response scored per optimisation step (default 32)",
        "skip_ratio": "share of inner sublayers skipped: 'auto' (default: adapts, by predicted speed) or a number "
        "(the paper: 0.45)",
        "objective": "'speed' (default: predicted from matchness and measured costs) or 'matchness' (the paper; "
        "needs a fixed skip_ratio)",
        "search": "'local' (default: mutate the best set) or 'paper' (fresh random sets at the ratio)",
        "bo_interval": "a Bayesian optimisation proposal every this many steps (default 25)",
        "max_steps": "stop optimising after this many steps (default 1000; 0: never optimise, the starting set drafts)",
        "patience": "... or after this many steps without improvement (default 300)",
        "score_threshold": "... or once the best set's matchness exceeds this (default 0.95)",
        "budget": "most optimisation time as a share of decoding time (default 0.1)",
        "give_up_after": "objective speed: stop searching after this many steps if still no set is predicted to "
        "pay (default 40; searching again if the text gets easier to draft)",
        "seed": "random seed of the search (default 0)",
        "state": "JSON file to load the optimiser's state from and save it to (keyed by model)",
        "schedule": "'cost' (default: draft length and tree width from measured costs) or 'paper' "
        "(epsilon 0.8, max 25 drafts, k = 10/5/3/1 by confidence)",
        "tree": "verify top-k alternatives as a token tree (default true)",
        "epsilon": "schedule=paper: stop drafting below this top-1 probability (default 0.8)",
        "max_draft": "most tokens drafted per round (default 16; paper schedule 25)",
        "draft_length": "draft exactly this many tokens per round",
        "draft_dtype": DRAFT_OPTIONS["draft_dtype"],
    },
    _swift,
    _swift_drafter,
)

def _s3d_skip(opts: dict[str, Any]):
    from .drafters.s3d import S3DSkipPolicy

    return S3DSkipPolicy()


def _s3d_drafter(opts: dict[str, Any]) -> Drafter:
    from .drafters.s3d import s3d_drafter

    return s3d_drafter(opts)


METHODS["s3d"] = MethodSpec(
    "s3d",
    "S3D: middle layers skipped, the root plus gamma-1 mask tokens drafted in one pass (needs a trained adapter)",
    {
        "adapter": "directory written by `selfspec train-s3d` (or an S3DAdapter)",
        "gamma": "tokens drafted per pass (default: the adapter's, 4)",
        "draft_dtype": DRAFT_OPTIONS["draft_dtype"],
    },
    _s3d_skip,
    _s3d_drafter,
)

# Self-SD (Draft & Verify): a static skip set, typically one found by `selfspec search`
METHODS["selfsd"] = MethodSpec(
    "selfsd",
    "Self-SD / Draft & Verify: a skip set found offline by `selfspec search`",
    METHODS["static"].options,
    _static,
)


def _pld_drafter(opts: dict[str, Any]):
    from .drafters.lookup import PromptLookupDrafter

    fixed = opts.get("draft_length")
    return PromptLookupDrafter(max_ngram=int(opts.get("max_ngram", 16)), min_ngram=int(opts.get("min_ngram", 1)),
                               max_draft=int(opts.get("max_draft", 10)),
                               draft_length=None if fixed is None else int(fixed))  # fmt: skip


# Prompt lookup: no layer is skipped, no model pass drafts; the draft is copied from the history
METHODS["pld"] = MethodSpec(
    "pld",
    "prompt lookup: the draft is what followed the last n tokens earlier in the prompt or output (no draft pass)",
    {
        "max_ngram": "longest n-gram matched (default 16; sizes 1, 2, 3, 4, 6, 8, 12, 16 up to it, longest first)",
        "min_ngram": "shortest n-gram matched (default 1)",
        "max_draft": "most tokens drafted per round (default 10); the length is priced with measured costs",
        "draft_length": "draft exactly this many tokens per match instead",
    },
    None,
    _pld_drafter,
)


def _suffix_drafter(opts: dict[str, Any]):
    from .drafters.suffix import SuffixDrafter

    return SuffixDrafter(max_ngram=int(opts.get("max_ngram", 16)), min_ngram=int(opts.get("min_ngram", 1)),
                         max_draft=int(opts.get("max_draft", 10)), max_nodes=int(opts.get("max_nodes", 16)),
                         store_tokens=int(opts.get("store_tokens", 16384)))  # fmt: skip


# Suffix drafting (SuffixDecoding's idea): trees of the continuations of every occurrence of the last n tokens
METHODS["suffix"] = MethodSpec(
    "suffix",
    "suffix drafting: a token tree of what followed every earlier occurrence of the last n tokens, in the prompt, "
    "the output and the session's earlier outputs, weighted by frequency (no draft pass)",
    {
        "max_ngram": METHODS["pld"].options["max_ngram"],
        "min_ngram": METHODS["pld"].options["min_ngram"],
        "max_draft": "deepest branch drafted per round (default 10)",
        "max_nodes": "most tokens one verification holds, root included (default 16); the tree is priced",
        "store_tokens": "the session's earlier outputs kept for matching, in tokens (default 16384; 0: none)",
    },
    None,
    _suffix_drafter,
)


def _lookahead_drafter(opts: dict[str, Any]):
    from .drafters.lookahead import LookaheadDrafter

    def size(key: str) -> int | None:
        return int(opts[key]) if key in opts else None

    return LookaheadDrafter(window=size("window"), ngram=size("ngram_size"), guesses=size("guesses"))


# Lookahead decoding (Fu et al. 2024): Jacobi iterations in a window, their n-grams verified in the same pass
METHODS["lookahead"] = MethodSpec(
    "lookahead",
    "lookahead decoding: n-grams from the model's own Jacobi iterations, generated and verified in one pass per "
    "round (no draft pass; the peer in SWIFT's paper)",
    {
        "window": "W, the Jacobi window's columns (default 3 on a CPU, else the paper's 15)",
        "ngram_size": "N, the n-gram size: N - 1 levels of guesses (default 2 on a CPU, else the paper's 5)",
        "guesses": "G, most n-grams verified per round (default 3 on a CPU, else the paper's 15)",
    },
    None,
    _lookahead_drafter,
)


AUTO_SOURCES = ("asd", "swift", "lowbit", "vocab")
WHOLE_MODEL_SOURCES = ("lowbit", "vocab")  # sources that skip nothing: their methods' own policy and drafter


def _auto_source(opts: dict[str, Any]) -> str:
    """The hybrid's self-draft source: 'asd' (default), 'swift', 'lowbit' or 'vocab'; options of another one are
    refused."""
    source = str(opts.get("layerskip", "asd"))
    if source not in AUTO_SOURCES:
        raise InvalidInputError(f"layerskip must be one of {', '.join(AUTO_SOURCES)}, got {source!r}")
    for other in AUTO_SOURCES:
        theirs = set(METHODS[other].options) - set(METHODS[source].options) - set(AUTO_OWN_OPTIONS)
        foreign = sorted(k for k in opts if k in theirs)
        if other != source and foreign:
            raise InvalidInputError(f"{', '.join(foreign)} applies to layerskip={other}")
    if source in WHOLE_MODEL_SOURCES and "draft_dtype" in opts:
        precision = "q4" if source == "lowbit" else "the model's own precision"
        raise InvalidInputError(f"layerskip={source} drafts in {precision} by definition; drop draft_dtype")
    return source


def _auto_drafter(opts: dict[str, Any]):
    from .drafters.hybrid import HybridDrafter

    ngram = str(opts.get("ngram", "suffix"))
    if ngram not in ("suffix", "pld"):
        raise InvalidInputError(f"ngram must be 'suffix' or 'pld', got {ngram!r}")
    shared = {k: opts[k] for k in ("max_ngram", "min_ngram") if k in opts}
    lookup = _suffix_drafter(shared) if ngram == "suffix" else _pld_drafter(shared)
    source = _auto_source(opts)
    if source == "asd":
        layerskip = _asd_drafter(_options_of("asd", opts))
    elif source in WHOLE_MODEL_SOURCES:
        layerskip = METHODS[source].build_drafter(_options_of(source, opts))
    else:
        layerskip = _swift_drafter(opts)
    return HybridDrafter(lookup, layerskip, ride=_flag(opts.get("ride", True), "ride"))


def default_self_draft(model: Any, opts: dict[str, Any]) -> str:
    """``auto``'s self-draft source where none is named: ``lowbit`` where the model's cost profile takes the 4-bit
    copies of its weights as its draft precision (they agree with the full model and save a share of a draft step:
    quantised models with 5-8-bit tensors, such as Qwen2.5's Q4_K_M), unless options of ASD's are given; else ASD's
    automatic choice.  On Qwen2.5-Coder 0.5B ASD's choice in q4 tried skip sets that saved little (an attention
    sublayer of a GQA model is a small share of a step) and cost acceptance (docs/methods.md, lowbit)."""
    asd_only = set(METHODS["asd"].options) - set(METHODS["lowbit"].options) - set(AUTO_OWN_OPTIONS)  # as _auto_source
    if "draft_dtype" in opts or asd_only & set(opts) or not getattr(model.engine, "low_bit_drafts", False):
        return "asd"
    from .cost.economy import best_precision

    return "lowbit" if best_precision(model) == "q4" else "asd"


def _options_of(method: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The options among ``opts`` that ``method`` takes (auto hands its layer-skip source its own)."""
    return {k: v for k, v in opts.items() if k in METHODS[method].options}


# The hybrid: an n-gram source and a layer-skip self-draft, one source per round by expected gain.  Its
# layer-skip source is ASD's automatic choice by default: on the built-in (quantised) models a draft's saving is
# mostly its head (the draft vocabulary) and the sublayers worth keeping are nearly all of them, which ASD's
# cosine ranking finds at once (Gemma 3, 12 Spec-Bench prompts: asd 1.26x, swift 0.93x; its search found sets
# skipping MLP sublayers, accepted a third as often); SWIFT's on-line search stays one option away.
def _auto_skip(opts: dict[str, Any]):
    source = _auto_source(opts)
    if source == "asd":
        return _asd(_options_of("asd", opts))
    if source in WHOLE_MODEL_SOURCES:
        return METHODS[source].build_skip_policy({})
    return _swift({"budget": AUTO_SEARCH_BUDGET, **_options_of("swift", opts)})


# SWIFT's search within the hybrid gets a smaller share of the time: a scoring pass costs ~10 decoding steps on
# our quantised models, where the lookup source usually pays more than any skip set (measured, README); at 0.03
# the search (mostly rescoring the best set on each new prompt) was the whole of auto's gap to its n-gram source
AUTO_SEARCH_BUDGET = 0.015
AUTO_OWN_OPTIONS = ("layerskip", "max_ngram", "min_ngram", "ngram", "draft_dtype", "max_draft", "ride")

METHODS["auto"] = MethodSpec(
    "auto",
    "hybrid: each round, the n-gram source (suffix trees) or a layer-skip self-draft (ASD's automatic choice, or "
    "SWIFT's), whichever is expected to pay more (default)",
    {
        **{k: v for k, v in METHODS["swift"].options.items() if k not in ("draft_length",)},
        **{k: v for k, v in METHODS["asd"].options.items() if k not in ("draft_length",) + ASD_PINNED + ("preset",)},
        "budget": f"layerskip=swift: most skip-set search time as a share of decoding time (default "
        f"{AUTO_SEARCH_BUDGET})",
        "layerskip": "the self-draft source: asd (default: ASD's automatic choice), swift (its on-line search), "
        "lowbit (the whole model in 4-bit copies of its weights) or vocab (the whole model over its draft vocabulary, "
        "verified by the head alone)",
        "max_ngram": METHODS["pld"].options["max_ngram"],
        "min_ngram": METHODS["pld"].options["min_ngram"],
        "ngram": "the n-gram source: suffix (default: trees over the text and the session's outputs) or pld",
        "ride": "true (default): the n-gram source's guesses of what follows a self-draft chain ride along on its "
        "draft passes as extra rows, where their chance of being kept pays for the row (greedy and coupled "
        "chains); false: a pass drafts one token",
    },
    _auto_skip,
    _auto_drafter,
)


def build_policies(method: str, options: dict[str, Any], model: Any = None):
    """(skip policy, draft policy) for a method, or (None, None) for vanilla; given the ``model``, ``auto``
    without a ``layerskip`` takes the self-draft source that suits it (:func:`default_self_draft`)."""
    spec = METHODS.get(method)
    if spec is None:
        raise InvalidInputError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
    opts = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(opts) - set(spec.options))
    if unknown:
        valid = ", ".join(spec.options) or "none"
        raise InvalidInputError(f"method '{method}' has no option(s) {', '.join(unknown)}; valid: {valid}")
    if method == "auto" and "layerskip" not in opts and model is not None:
        _auto_source(opts)  # options of one source only, checked before choosing
        opts["layerskip"] = default_self_draft(model, opts)
    if spec.build_skip_policy is None and spec.build_drafter is None:
        return None, None
    try:
        skip_policy = spec.build_skip_policy(opts) if spec.build_skip_policy is not None else None
        drafter = (spec.build_drafter or _chain_drafter)(opts)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"method '{method}': bad option value: {exc}") from None
    return skip_policy, drafter


def _chain_drafter(opts: dict[str, Any]) -> Drafter:
    """Draft & Verify's drafting (ASD, static, selfsd): a chain, adaptive exit or a fixed length."""
    if "draft_length" in opts:
        length = FixedDraftLength(int(opts["draft_length"]))
    else:
        length = AdaptiveDraftExit(gamma=float(opts.get("gamma", 0.6)), max_draft=int(opts.get("max_draft", 12)))
    return Drafter(length, None, str(opts.get("draft_dtype", "auto")))
