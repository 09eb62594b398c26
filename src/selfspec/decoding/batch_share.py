"""What one sequence pays of a batched pass: the pricing of drafts when concurrent requests decode together.

A server decoding several requests at once (:mod:`selfspec.decoding.batch`) verifies all their rounds in one
full-model pass, whose cost is set by the batch's total rows.  A draft that pays alone may not pay there:

- a row verified beside ``rows_beside`` others costs what the pass's curve adds at that point
  (``F(beside + T) - F(beside + T - 1)``), not what it adds to a pass of its own;
- a token is worth the time the batch takes per sequence (a round's time over the ``members`` sharing it),
  since the pass runs for the others whether this sequence drafts or not;
- a draft step of a layer-skip draft runs alone while the others wait: it costs its full time.

The batcher records, per decoding thread, the shape of the batch its last round ran in; a drafter's economy
(:class:`selfspec.cost.economy.Economy`) reads it.  Alone, or outside a server: one member, no rows beside, and
the prices are the one-sequence ones.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    members: int = 1  # sequences in the batch
    rows_beside: int = 0  # rows the other sequences verified in it


ALONE = Share()
_local = threading.local()


def current() -> Share:
    """The batch this thread's decoding last ran in (:data:`ALONE` outside a batch)."""
    return getattr(_local, "share", ALONE)


def record(share: Share) -> None:
    """Set by the batcher after each batched round of this thread's decoding."""
    _local.share = share


def batched() -> bool:
    """Whether this thread's decoding verifies its rounds in a batcher's passes (from its first round on: a
    draft's own verification by head alone, drafters/layerskip.py, does not happen there)."""
    return getattr(_local, "batched", False)


def join() -> None:
    """This thread's decoding joined a batcher (:meth:`~selfspec.decoding.batch.StepBatcher.member`)."""
    _local.batched = True


def reset() -> None:
    _local.share = ALONE
    _local.batched = False
