"""Skip sets: which attention and MLP sublayers the draft model leaves out.

A :class:`SkipSet` is an immutable value passed to every forward call; nothing
global is ever switched on or off.  Layer indices are **0-based** here and in
the JSON files (papers count from 1; conversions happen where a paper's rule is
implemented).

JSON form (what ``--skip-set`` accepts, as a file path or a literal)::

    {"attention": [3, 5, 8], "mlp": [6, 12]}

Extra keys (model, date, objective, ...) are kept in ``meta`` on load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError
from ..io import atomic_write_text


@dataclass(frozen=True)
class SkipSet:
    attention: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, attention=(), mlp=(), **meta: Any) -> SkipSet:
        return cls(frozenset(int(i) for i in attention), frozenset(int(i) for i in mlp), dict(meta))

    @property
    def is_empty(self) -> bool:
        return not self.attention and not self.mlp

    def __len__(self) -> int:
        return len(self.attention) + len(self.mlp)

    def validate(self, num_layers: int) -> SkipSet:
        """Raise a clear error if an index is outside ``[0, num_layers)``."""
        bad = sorted(i for i in self.attention | self.mlp if not 0 <= i < num_layers)
        if bad:
            raise InvalidInputError(
                f"skip set names layer(s) {bad}, but the model has {num_layers} layers "
                f"(0-based indices 0..{num_layers - 1})"
            )
        return self

    def skip_ratio(self, num_layers: int) -> float:
        """Fraction of the 2L sublayers that are skipped."""
        return len(self) / (2 * num_layers)

    def to_dict(self) -> dict[str, Any]:
        return {**self.meta, "attention": sorted(self.attention), "mlp": sorted(self.mlp)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def describe(self) -> str:
        return f"attn {sorted(self.attention)} mlp {sorted(self.mlp)}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SkipSet:
        if not isinstance(data, dict) or not ({"attention", "mlp"} & data.keys()):
            raise InvalidInputError('a skip set is a JSON object like {"attention": [3, 5], "mlp": [6]}')
        meta = {k: v for k, v in data.items() if k not in ("attention", "mlp")}
        try:
            attention = [int(i) for i in data.get("attention", [])]
            mlp = [int(i) for i in data.get("mlp", [])]
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"skip set layer lists must hold integers: {exc}") from None
        return cls.of(attention, mlp, **meta)

    @classmethod
    def parse(cls, text_or_path: str | Path) -> SkipSet:
        """Read a skip set from a JSON file path or a JSON literal."""
        text = str(text_or_path).strip()
        if not text.startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise InvalidInputError(f"skip set file not found: {path}")
            text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"skip set is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


NO_SKIP = SkipSet()
