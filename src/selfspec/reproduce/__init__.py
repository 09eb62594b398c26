"""``selfspec reproduce NAME``: one command per paper's key result, ours printed next to the paper's.

    selfspec reproduce asd-table5          # ASD's ablation of its rules (Table 5), XSum
    selfspec reproduce swift-table8        # SWIFT's ablation (Table 8), XSum
    selfspec reproduce swift-figure7       # SWIFT vs Self-SD on a domain-shifting Spec-Bench stream (Figure 7)
    selfspec reproduce s3d-figure5         # S3D's speed model vs measurement over draft sizes and gamma (Figure 5)

    from selfspec.reproduce import TARGETS, ReproduceOptions, write_reproduction
    rep = TARGETS["asd-table5"].run(model, ReproduceOptions(limit=2, max_new_tokens=32, out_dir=out, command="..."))
    write_reproduction(rep, out)

Each target measures with the benchmark harness (:mod:`selfspec.bench`: the
fair runner, method spec strings), quotes the paper's figures exactly with
their table or figure number, and writes ``report.md``, ``result.json``,
``results.jsonl`` and, for figures, a PNG into ``--out`` (default
``reproductions/NAME/``).  Modules: :mod:`.common` (options, result record,
files), one module per target.  Every default run takes under 15 minutes on 2 CPU
cores with the default model (smollm2-135m).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..datasets import PromptItem
from ..errors import InvalidInputError
from ..model.models import Model
from . import asd_table5, s3d_figure5, swift_figure7, swift_table8
from .common import ReproduceOptions, Reproduction, print_reproduction, write_reproduction

RunFn = Callable[[Model, ReproduceOptions, Sequence[PromptItem] | None], Reproduction]


@dataclass(frozen=True)
class Target:
    name: str
    summary: str
    limit: int  # default --limit (per task for streams)
    max_new_tokens: int  # default --max-new-tokens
    minutes: float  # expected wall time of the default run on 2 CPU cores, the default model
    dataset: str  # checked before the model loads
    run: RunFn


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("asd-table5", "ASD Table 5: the ADMG rule variants (CS; CS + rule 2; rules 1 + 2; ADMG) on XSum",
               10, 128, 5, asd_table5.DATASET, asd_table5.run),
        Target("swift-table8", "SWIFT Table 8: without early stopping, dynamic verification, optimisation; XSum",
               6, 128, 6, swift_table8.DATASET, swift_table8.run),
        Target("swift-figure7", "SWIFT Figure 7: SWIFT vs Self-SD on a stream of five Spec-Bench tasks",
               4, 128, 6, swift_figure7.DATASET, swift_figure7.run),
        Target("s3d-figure5", "S3D Figure 5: eq. 10-12's predicted vs measured acceptance and speed; MT-Bench",
               3, 64, 9, s3d_figure5.DATASET, s3d_figure5.run),
    )
}  # fmt: skip


def get_target(name: str) -> Target:
    target = TARGETS.get(name)
    if target is None:
        raise InvalidInputError(f"unknown reproduction target '{name}'; choose one of {', '.join(TARGETS)}")
    return target


__all__ = ["TARGETS", "ReproduceOptions", "Reproduction", "Target", "get_target", "print_reproduction",
           "write_reproduction"]  # fmt: skip
