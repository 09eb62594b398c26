"""Method specs for ``selfspec bench --methods``: parsing and validation.

Syntax (documented in ``selfspec bench --help``)::

    --methods "vanilla,asd,asd:alpha=0.995:m=5@asd-strict,static:skip.json,hf,hf-lookup,hf-early-exit:8"

* methods are separated by commas;
* options follow the method name, each introduced by ``:``, as ``key=value``;
  values are read as int, then float, then ``true``/``false``, else text;
* a bare value (no ``=``) sets the method's main option: the skip-set file of
  ``static``, the exit layer of ``hf-early-exit``, the lookup length of
  ``hf-lookup``;
* ``@label`` at the end names the method in tables and files (default: the
  spec text itself); labels must be unique.

Our methods (``selfspec.METHODS``) are validated by building their policies,
so a typo fails here, before any model is loaded.  Peers (``hf``,
``hf-lookup``, ``hf-early-exit``) run through ``transformers.generate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.sampling import SCHEMES
from ..errors import InvalidInputError
from ..methods import METHODS, build_policies

BASELINE = "vanilla"


@dataclass(frozen=True)
class PeerSpec:
    name: str
    summary: str
    options: dict[str, str]
    positional: str | None  # the option a bare value sets
    judged: bool = True  # outputs compared with vanilla's (False: another engine, which rounds differently)


PEERS: dict[str, PeerSpec] = {
    "hf": PeerSpec("hf", "transformers generate(), greedy", {}, None),
    "hf-lookup": PeerSpec(
        "hf-lookup",
        "transformers prompt lookup decoding",
        {
            "tokens": "prompt_lookup_num_tokens: tokens copied from the prompt per round (default 10)",
            "ngram": "max_matching_ngram_size (default: transformers' own, 2)",
        },
        "tokens",
    ),
    "hf-early-exit": PeerSpec(
        "hf-early-exit",
        "transformers assistant_early_exit: draft with the first `layer` layers of the model itself",
        {
            "layer": "assistant_early_exit: layers used to draft (default num_layers // 2)",
            "tokens": "num_assistant_tokens: draft tokens per round (default: transformers' own)",
        },
        "layer",
    ),
    "llamacpp": PeerSpec(
        "llamacpp",
        "llama.cpp's llama-server on the model's GGUF file (run only where the binary is found)",
        {
            "bin": "llama-server binary or its folder (default: --llama-cpp, $SELFSPEC_LLAMA_CPP, PATH)",
            "gguf": "GGUF file (default: the built-in model's, or the .gguf the model was loaded from)",
            "threads": "threads (default: torch's thread count)",
            "spec": "llama-server --spec-type, e.g. ngram-mod (llama.cpp's draft-free speculation; default none)",
        },
        "gguf",
        judged=False,
    ),
}

# The option a bare value sets, for our methods.
_OUR_POSITIONAL = {"static": "skip_set", "selfsd": "skip_set", "s3d": "adapter"}


@dataclass(frozen=True)
class BenchMethod:
    """One column of the benchmark: a method, its options and the label it is reported under."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", format_spec(self.name, self.options))

    @property
    def is_peer(self) -> bool:
        return self.name in PEERS

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE and not self.options

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "name": self.name, "options": dict(self.options), "peer": self.is_peer}


def format_spec(name: str, options: dict[str, Any]) -> str:
    return ":".join([name, *(f"{k}={v}" for k, v in options.items())])


def parse_value(text: str) -> int | float | bool | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def known_methods() -> list[str]:
    return [*METHODS, *PEERS]


def parse_spec(text: str) -> BenchMethod:
    """One spec, ``name[:key=value|:value]...[@label]``; raises InvalidInputError with the reason."""
    spec = text.strip()
    label = ""
    if "@" in spec:
        spec, label = (s.strip() for s in spec.rsplit("@", 1))
        if not label:
            raise InvalidInputError(f"method spec '{text}': empty label after '@'")
    name, *parts = (p.strip() for p in spec.split(":"))
    if not name:
        raise InvalidInputError(f"method spec '{text}': no method name")
    if name not in METHODS and name not in PEERS:
        raise InvalidInputError(
            f"method spec '{text}': unknown method '{name}'; choose from {', '.join(known_methods())}"
        )
    positional = PEERS[name].positional if name in PEERS else _OUR_POSITIONAL.get(name)
    options: dict[str, Any] = {}
    for part in parts:
        if not part:
            raise InvalidInputError(f"method spec '{text}': empty option (two ':' in a row?)")
        if "=" in part:
            key, value = (s.strip() for s in part.split("=", 1))
        elif positional is not None:
            key, value = positional, part
        else:
            raise InvalidInputError(f"method spec '{text}': option '{part}' needs the form key=value")
        if not key or value == "":
            raise InvalidInputError(f"method spec '{text}': option '{part}' needs the form key=value")
        if key in options:
            raise InvalidInputError(f"method spec '{text}': option '{key}' given twice")
        # a skip-set file name is text even when it looks like a number
        options[key] = value if key == "skip_set" else parse_value(value)
    method = BenchMethod(name, options, label or format_spec(name, options))
    validate(method)
    return method


TEXT_OPTIONS = {"bin", "gguf", "spec"}  # peer options that are paths or names, not counts
SCHEME_OPTION = "sampling_scheme"  # an option of every method of ours: this column's sampling scheme


def validate(method: BenchMethod) -> None:
    """Check the options without a model (peer layer ranges are checked once the model is known)."""
    if method.name in METHODS:
        options = dict(method.options)
        scheme = options.pop(SCHEME_OPTION, None)
        if scheme is not None and scheme not in SCHEMES:
            raise InvalidInputError(f"method '{method.label}': {SCHEME_OPTION} must be one of {', '.join(SCHEMES)}")
        build_policies(method.name, options)
        return
    peer = PEERS[method.name]
    unknown = sorted(set(method.options) - set(peer.options))
    if unknown:
        valid = ", ".join(peer.options) or "none"
        raise InvalidInputError(f"method '{method.label}' has no option(s) {', '.join(unknown)}; valid: {valid}")
    for key, value in method.options.items():
        if key in TEXT_OPTIONS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidInputError(f"method '{method.label}': option {key} must be a positive integer, got {value!r}")


def parse_methods(text: str | Iterable[str]) -> list[BenchMethod]:
    """Comma-separated specs (or a list of specs); the vanilla baseline is added first when absent."""
    items = text.split(",") if isinstance(text, str) else list(text)
    methods = [parse_spec(s) for s in items if s.strip()]
    if not methods:
        raise InvalidInputError("--methods names no method")
    return with_baseline(methods)


def with_baseline(methods: Sequence[BenchMethod | str]) -> list[BenchMethod]:
    """Validated methods with a plain ``vanilla`` first unless already present; labels must be unique."""
    out = [parse_spec(m) if isinstance(m, str) else m for m in methods]
    for m in out:
        validate(m)
    if not any(m.is_baseline for m in out):
        out.insert(0, BenchMethod(BASELINE, {}, BASELINE))
    seen: set[str] = set()
    for m in out:
        if m.label in seen:
            raise InvalidInputError(f"method label '{m.label}' appears twice; give one of them a label with @NAME")
        seen.add(m.label)
    return out


def baseline_of(methods: Sequence[BenchMethod]) -> BenchMethod:
    return next(m for m in methods if m.is_baseline)


def hf_of(methods: Sequence[BenchMethod]) -> BenchMethod | None:
    return next((m for m in methods if m.name == "hf" and not m.options), None)


def methods_help() -> str:
    ours = "; ".join(f"{n} ({', '.join(s.options) or 'no options'})" for n, s in METHODS.items())
    peers = "; ".join(f"{n} ({', '.join(s.options) or 'no options'})" for n, s in PEERS.items())
    return f"ours: {ours}. peers: {peers}"
