"""Giving the C heap's freed pages back to the system, where a load's temporaries would leave them resident.

glibc keeps memory that ``free`` returned inside its heap (and, once a large block has been freed, serves blocks
of up to 32 MB from the heap instead of fresh mappings), so the repacks that make a model's weights a few MB at a
time leave tens of MB resident after they are gone.  :func:`return_free_heap` is ``malloc_trim(0)``, which
releases those pages; on other C libraries (macOS, musl, Windows) it does nothing.  :class:`HeapTrimmer` calls it
after every so many bytes of work, for loops that make large temporaries one after another.
"""

from __future__ import annotations

import ctypes
import functools
import threading


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # (no such symbol; Windows cannot open the process itself)
        return None


def return_free_heap() -> None:
    """Release the heap's free pages to the system (glibc ``malloc_trim(0)``; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(ctypes.c_size_t(0))


class HeapTrimmer:
    """Counts bytes of temporaries made and freed; past ``budget`` of them, returns the free heap and starts
    again: ``trim = HeapTrimmer(64 << 20)``, then ``trim(nbytes)`` in the loop (or in the threads of one)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.since = budget, 0
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.since += nbytes
            due = self.since >= self.budget
            if due:
                self.since = 0
        if due:
            return_free_heap()
