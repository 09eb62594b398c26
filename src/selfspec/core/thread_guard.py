"""Decoding that stays fast when another process takes a core: fewer pass threads while the machine is busy.

A pass of the fused stack splits each layer's work between its threads, with several barriers per layer.  On
a quiet 2-core machine two threads run a step in 0.6 of one thread's time; when another process holds a
core, a thread waiting at a barrier for one the scheduler has set aside stalls the whole pass.  Measured on
the 2-core development VM with two other busy processes (SmolLM2, one-token steps, 40 each, medians): 2
threads 91-757 ms (quartiles 11 ms to 2.1 s), 1 thread 7.8 ms.  The load-time tuner
(:mod:`selfspec.core.native_tuning`) cannot know what will run beside decoding later, so the guard watches
the passes themselves:

* every pass's time is normalised by the quickest pass of the same shape seen so far (rows, skip set), so
  drafts, verifications and plain steps can be compared;
* on the full thread count, the fallback (one thread) is tried for a window of ``WINDOW`` passes when a
  window's median is ``BUSY_RATIO`` times its passes' quickest, and every ``FULL_TRY_MS`` of pass time
  anyway (a pass can be slow from the start and steadily so: 2.2 s per step, seen here); the quicker
  window's count is kept;
* on the fallback, the full count is tried after ``FALLBACK_TRY_MS`` of pass time, twice as long after each
  try it loses (up to ``MAX_FALLBACK_TRY_MS``); a try is cut short after one pass ``ABORT_RATIO`` times
  slower than the window before it;
* on a quiet machine the full count stays: a try costs one window of one-thread passes per
  ``FULL_TRY_MS`` (~0.1% of the time);
* passes it does not watch (a prompt's prefill) run on the kept count, never on a try's
  (:func:`unwatched`): a 689-token Gemma 3 prefill that fell inside a try's window ran on one thread,
  419 ms against 250 (Spec-Bench run of 2026-11-27: 4 of 180 prompts' prefills, all of the drafting
  methods, whose many short passes make tries come round more often in a generation).

The thread count changes no result, only the speed (every thread's share is computed the same way).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

ENV = "SELFSPEC_THREAD_GUARD"  # "0": no guard (the load-time thread count holds whatever runs beside)
WINDOW = 8
BUSY_RATIO = 2.0
KEEP_MARGIN = 0.8  # a tried thread count is kept when its window's median is below this share of the other's
ABORT_RATIO = 3.0
FULL_TRY_MS = 10_000.0  # on the full count, the fallback is tried after this much pass time (and when busy)
FALLBACK_TRY_MS = 500.0  # on the fallback, the full count is tried after this much, doubled after each loss
MAX_FALLBACK_TRY_MS = 60_000.0
MAX_SHAPES = 4096  # SWIFT's search tries many skip sets: the table of quickest times stays bounded


class ThreadGuard:
    """Chooses between ``full`` and ``fallback`` pass threads from the passes' times (module docstring)."""

    def __init__(self, set_threads: Callable[[int], None], full: int, fallback: int = 1) -> None:
        self._set = set_threads
        self.full, self.fallback = full, fallback
        self.current = full
        self.switches = 0  # how often the kept thread count changed
        self.tries = 0
        self._quickest: dict[Hashable, float] = {}
        self._window: list[float] = []
        self._before: float | None = None  # median of the window before a try (None: not trying)
        self._since_try_ms = 0.0
        self._fallback_try_ms = FALLBACK_TRY_MS

    def observe(self, shape: Hashable, ms: float) -> None:
        """One pass of ``shape`` took ``ms`` on the current thread count."""
        if ms <= 0:
            return
        if len(self._quickest) >= MAX_SHAPES:
            self._quickest.clear()
        quickest = self._quickest.get(shape)
        if quickest is None or (ms < quickest and self._before is None):  # a try is judged by the old table
            self._quickest[shape] = quickest = ms
        ratio = ms / quickest
        self._window.append(ratio)
        self._since_try_ms += ms
        if self._before is not None and ratio > ABORT_RATIO * max(1.0, self._before):
            self._end_try(float("inf"))  # the try is plainly worse: do not sit through its window
            return
        if len(self._window) < WINDOW:
            return
        median = statistics.median(self._window)
        self._window.clear()
        if self._before is not None:
            self._end_try(median)
            return
        on_full = self.current == self.full
        due = self._since_try_ms >= (FULL_TRY_MS if on_full else self._fallback_try_ms)
        if due or (on_full and median > BUSY_RATIO):
            self.tries += 1
            self._before = median
            self._use(self.fallback if on_full else self.full)

    @property
    def kept(self) -> int:
        """The thread count in force outside a try (during one, the count it is being compared with)."""
        if self._before is None:
            return self.current
        return self.full if self.current == self.fallback else self.fallback

    def _end_try(self, median: float) -> None:
        tried, before = self.current, self._before
        self._before, self._since_try_ms = None, 0.0
        self._window.clear()
        if median < KEEP_MARGIN * before:
            self.switches += 1
            if tried == self.full:
                self._fallback_try_ms = FALLBACK_TRY_MS
            return
        self._use(self.fallback if tried == self.full else self.full)
        if tried == self.full:  # the full count lost again: try it less often
            self._fallback_try_ms = min(MAX_FALLBACK_TRY_MS, 2 * self._fallback_try_ms)

    def _use(self, threads: int) -> None:
        self.current = threads
        self._set(threads)


_GUARD: ThreadGuard | None = None


def install(set_threads: Callable[[int], None], full: int) -> ThreadGuard | None:
    """The process's guard over the native library's pass threads (the knob is process-wide), now watching
    ``full`` threads (the load-time choice); None when there is nothing to fall back from (one thread)."""
    global _GUARD
    if full <= 1 or os.environ.get(ENV) == "0":
        _GUARD = None
        return None
    if _GUARD is None or _GUARD.full != full:
        _GUARD = ThreadGuard(set_threads, full)
    return _GUARD


def observe(shape: Hashable, ms: float) -> None:
    """A pass of the fused stack took ``ms`` (no-op without a guard)."""
    if _GUARD is not None:
        _GUARD.observe(shape, ms)


def current() -> ThreadGuard | None:
    return _GUARD


@contextmanager
def unwatched() -> Iterator[None]:
    """Around a pass the guard does not time (a prompt's prefill): it runs on the kept thread count, not on a
    try's, which is set again after it."""
    guard = _GUARD
    if guard is None or guard.kept == guard.current:
        yield
        return
    guard._set(guard.kept)
    try:
        yield
    finally:
        guard._set(guard.current)
