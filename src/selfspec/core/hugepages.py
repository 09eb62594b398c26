"""The weights a decoding pass streams, held on 2 MB pages where the system gives them.

A one-token step reads every weight once, a few hundred MB in long runs.  On 4 KB pages that stream crosses a
page every 64 cache lines: each crossing is a TLB miss (a page walk), and the hardware prefetchers stop at page
boundaries.  Linux backs anonymous memory with 2 MB pages (transparent huge pages) only where the process asks
(``madvise``, the default setting of many distributions: Debian, Ubuntu, Fedora) or everywhere (``always``);
torch's buffers never ask, numpy's only for arrays of 4 MB or more, and a layer's weights are 0.1-4 MB each.
Measured on a 2-core AMD EPYC (Zen 4) VM with the setting ``madvise``, within one process (the same product
alternating between two copies of its weight): Qwen2.5-Coder 0.5B's 136 MB int8 head 4.85 -> 4.36 ms, and
3.26 -> 2.81 ms in a faster spell of the VM (10-16%).

:func:`empty` gives arrays carved from large private anonymous mappings (:data:`CHUNK` bytes of address space
each) advised ``MADV_HUGEPAGE`` before any page is touched, so every whole 2 MB of them the kernel can back with a
huge page is one; only touched pages are resident (a chunk's unused tail costs address space, not memory).  Space
is handed out in order and never reused: a chunk is unmapped when no array in it is left, so only lasting buffers
belong here (the interleaved weight copies the kernels read), not a load's temporaries.  Elsewhere (not Linux, no
``madvise`` in Python's mmap, ``SELFSPEC_HUGE_PAGES=0``, the system's setting ``never``) it is ``numpy.empty``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from contextvars import ContextVar
from pathlib import Path

import numpy as np

HUGE_PAGES_ENV = "SELFSPEC_HUGE_PAGES"
PAGE = 2 << 20
CHUNK = 64 << 20  # address space mapped at a time (more where one array needs it)
MIN_BYTES = 4096  # smaller arrays stay on the heap (a scale table of a small weight: read with its codes, so placed)
ALIGN = 64  # every array starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_TEMPORARY: ContextVar[bool] = ContextVar("selfspec_hugepages_temporary", default=False)
_lock = threading.Lock()
_chunk: dict = {"ref": None, "used": 0, "size": 0}  # the chunk being handed out (weakly: its arrays hold it)
_spans: dict[int, int] = {}  # start -> end of every chunk still mapped


def setting() -> str | None:
    """The system's transparent huge page setting (``always``, ``madvise`` or ``never``), None where unknown."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def enabled() -> bool:
    """Whether :func:`empty` places arrays on advised mappings here."""
    if os.environ.get(HUGE_PAGES_ENV, "1").strip() == "0":
        return False
    if not (hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")):
        return False
    return setting() in ("always", "madvise")


def _new_chunk(size: int) -> mmap.mmap:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # (a kernel without transparent huge pages) 4 KB pages, as the heap's
        pass
    start = np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data
    _spans[start] = start + size
    weakref.finalize(m, _spans.pop, start, None)
    return m


def placed(address: int) -> bool:
    """Whether ``address`` (an array's or tensor's data pointer) lies in memory :func:`empty` handed out."""
    return any(start <= address < end for start, end in list(_spans.items()))


def empty(shape, dtype, *, alone: bool = False) -> np.ndarray:
    """An uninitialised array for a lasting buffer: on 2 MB pages where :func:`enabled`, else ``numpy.empty``.
    ``alone``: in a mapping of its own, unmapped as soon as the array goes (a buffer replaced as it grows)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return np.empty(shape, dtype=dtype)
    if alone:
        m = _new_chunk(-(-nbytes // PAGE) * PAGE)
        return np.frombuffer(m, dtype=dtype, count=count).reshape(shape)
    with _lock:
        m, used = _chunk["ref"] and _chunk["ref"](), -(-_chunk["used"] // ALIGN) * ALIGN
        if m is None or used + nbytes > _chunk["size"]:
            size = max(CHUNK, -(-nbytes // PAGE) * PAGE)
            m, used = _new_chunk(size), 0
            _chunk.update(ref=weakref.ref(m), size=size)
        _chunk["used"] = used + nbytes
    return np.frombuffer(m, dtype=dtype, count=count, offset=used).reshape(shape)


def lasting(array: np.ndarray) -> np.ndarray:
    """``array``'s values in an array from :func:`empty` (the same array where it would stay on the heap)."""
    if array.nbytes < MIN_BYTES or not enabled():
        return np.ascontiguousarray(array)
    out = empty(array.shape, array.dtype)
    out[...] = array
    return out


@contextlib.contextmanager
def temporaries():
    """Inside: copies made for a moment (pieces of a larger copy), which stay on the heap."""
    token = _TEMPORARY.set(True)
    try:
        yield
    finally:
        _TEMPORARY.reset(token)


def temporary() -> bool:
    """Whether the copies made now are temporaries (see :func:`temporaries`)."""
    return _TEMPORARY.get()


def resident_mb() -> float | None:
    """MB of this process's anonymous memory on huge pages (Linux's ``AnonHugePages``), None where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
