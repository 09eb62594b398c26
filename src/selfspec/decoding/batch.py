"""Concurrent decodings verified together: the batch stage of a server with several slots.

Each request decodes in its own thread with the ordinary loop (:class:`selfspec.decoding.loop.Decoder`); its
drafts run alone, one pass at a time on the shared engine.  Its verification passes, and its prompt's prefill
in chunks of ``prompt_chunk`` rows where prompt rows are computed as one-token rows, instead go through a
:class:`StepBatcher`: the pass waits until every decoding registered with the batcher has its own pass ready
(or has left), and one of them then runs all of them in one
:meth:`~selfspec.model.engine.Engine.forward_batch`: the weights are read once for every row, and a new
request's prompt no longer stops the others' decoding while it is read.  A request joins
between rounds (its first verification meets the others' next one) and leaves when it ends or its client
goes away, so the batch is continuous.

Outputs do not depend on the company: ``forward_batch`` gives each sequence's rows bit for bit what a pass of
its own gives, so greedy and seeded sampling produce per request the tokens it gets alone.  After each round
the batch's shape is recorded for the thread (:mod:`selfspec.decoding.batch_share`), where the drafters'
economies price the next draft by it.

Run it as a server does: ``selfspec serve --parallel 4`` (see :mod:`selfspec.server.worker`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..core import native_thread
from ..model.engine import BatchItem, Engine
from . import batch_share


@dataclass
class _Request:
    item: BatchItem
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    share: batch_share.Share = field(default_factory=batch_share.Share)


@dataclass
class BatchStats:
    """What the batcher did: passes run, sequences and rows they held (for /metrics)."""

    passes: int = 0
    sequences: int = 0
    rows: int = 0

    @property
    def mean_sequences(self) -> float:
        return self.sequences / self.passes if self.passes else 0.0


class StepBatcher:
    """Verification passes of the decodings registered with :meth:`member`, run together (module docstring)."""

    PROMPT_CHUNK = 32  # prompt rows per pass when a member prefills in the batch (the server sets it per model)

    def __init__(self, engine: Engine, *, prompt_chunk: int = PROMPT_CHUNK) -> None:
        native_thread.enable()  # members decode in their own threads: the passes on one (core/native_thread.py)
        self.engine = engine
        self.prompt_chunk = prompt_chunk  # a prompt's rows per batch pass (loop.prefill's chunks)
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._members = 0
        self._pending: list[_Request] = []
        self._running = False

    @property
    def members(self) -> int:
        return self._members

    @contextmanager
    def member(self) -> Iterator[None]:
        """The calling thread's decoding takes part in the batches while inside this block."""
        with self._cond:
            self._members += 1
        batch_share.join()
        try:
            yield
        finally:
            batch_share.reset()
            with self._cond:
                self._members -= 1
                self._cond.notify_all()  # the others may all be waiting for this one

    @contextmanager
    def away(self) -> Iterator[None]:
        """A member's work that runs no pass (copying a prefix into or out of the store): the batches go on
        without it meanwhile, rather than waiting for its next pass (a SmolLM2 request's copies took 30-60 ms
        under load, which every other member sat out)."""
        with self._cond:
            self._members -= 1
            self._cond.notify_all()  # the others may be waiting only for this one
        try:
            yield
        finally:
            with self._cond:
                self._members += 1

    def forward(self, item: BatchItem) -> torch.Tensor:
        """The logits of ``item``'s full-model pass, computed in the next batch (see the module docstring)."""
        req = _Request(item)
        with self._cond:
            if self._members <= 0:
                raise RuntimeError("StepBatcher.forward outside a member() block")
            # no one to wake: the member that completes the batch runs the pass itself, and the waiting ones
            # hear of it when it ends (or of a member leaving); waking them all at each arrival cost every round
            # three futile wake-ups per member, each taking the GIL between passes
            self._pending.append(req)
            while req.logits is None and req.error is None:
                if not self._running and len(self._pending) >= self._members:
                    self._run_locked()
                else:
                    self._cond.wait()
        batch_share.record(req.share)
        if req.error is not None:
            raise req.error
        return req.logits

    def _run_locked(self) -> None:
        """Runs every pending request in one pass; called with the condition held, released during the pass."""
        batch, self._pending, self._running = self._pending, [], True
        rows = [r.item.input_ids.shape[0] for r in batch]
        self._cond.release()
        try:
            outs = self.engine.forward_batch([r.item for r in batch])
            for r, n, logits in zip(batch, rows, outs, strict=True):
                r.share = batch_share.Share(len(batch), sum(rows) - n)
                r.logits = logits
        except BaseException as exc:  # every waiting decoding hears of it, not only this thread
            for r in batch:
                r.error = exc
        finally:
            self._cond.acquire()
            self._running = False
            self.stats.passes += 1
            self.stats.sequences += len(batch)
            self.stats.rows += sum(rows)
            self._cond.notify_all()
