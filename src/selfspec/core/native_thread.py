"""One thread runs the engine's passes when several threads decode (a server's slots, a batch's members).

The kernels and torch's CPU operators parallelise with OpenMP, through one libgomp, which keeps a team of worker
threads for each thread that has opened a parallel region.  While more threads are in teams than there are
cores, libgomp stops spinning at barriers and parks threads instead, and a pass of the fused stack, with several
barriers per layer, runs several times slower.  Measured on the 2-core development VM (SmolLM2, one-token steps,
thread guard off): 2.3-2.9 ms from the only thread with a team, 9.4-12.7 ms from a second thread while the first
thread's team lives (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` change nothing; freeing the first team with
``omp_pause_resource_all`` brings the second thread back to 2.3 ms).  A server decodes in one thread per slot, and
a batch's pass runs in whichever member thread completes it.

So, once :func:`enable` is called (by the server, and by a :class:`~selfspec.decoding.batch.StepBatcher`), every
engine pass (:func:`run`, wrapped around the engine's methods) is handed to one daemon thread and its caller
waits; a thread that hands passes over first frees its own team and keeps its other torch work on one thread
(its OpenMP thread count set to 1, which torch's parallel loops follow), so that the native thread's team is the
only one.  A hand-over costs tens of microseconds next to a pass of milliseconds.  Without :func:`enable`
(one thread decoding: the CLI, ``selfspec.generate``) calls run where they are made, as before.
"""

from __future__ import annotations

import contextvars
import ctypes
import queue
import threading
from typing import Any

_ENABLED = False
_QUEUE: queue.SimpleQueue | None = None
_IDENT: int | None = None
_START = threading.Lock()
_prepared = threading.local()


class _Job:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.done = threading.Lock()
        self.done.acquire()  # released by the native thread once the call has returned
        self.result: Any = None
        self.error: BaseException | None = None


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        try:
            job.result = job.fn()
        except BaseException as exc:  # handed to the caller
            job.error = exc
        finally:
            job.done.release()


def _libgomp():
    try:
        return ctypes.CDLL("libgomp.so.1")  # the one already loaded (torch's), found by its soname
    except OSError:
        return None


def _free_team() -> None:
    gomp = _libgomp()
    pause = getattr(gomp, "omp_pause_resource_all", None) if gomp is not None else None
    if pause is not None:
        pause(ctypes.c_int(1))  # omp_pause_soft: this thread's team goes; a later region makes a new one


def _leave_openmp() -> None:
    """This thread's torch work on one thread from now on, and its OpenMP team (if any) freed."""
    if getattr(_prepared, "done", False):
        return
    _prepared.done = True
    import torch

    _prepared.threads = torch.get_num_threads()  # (torch reads its count into this thread's settings once: now)
    gomp = _libgomp()
    if gomp is None:
        return
    gomp.omp_set_num_threads(ctypes.c_int(1))  # this thread's setting only; the native thread keeps its count
    _free_team()


def enable() -> None:
    """From now on engine passes run on the native thread (module docstring); the calling thread leaves OpenMP."""
    global _ENABLED, _QUEUE, _IDENT
    with _START:
        if _QUEUE is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(jobs,), name="selfspec-native", daemon=True)
            thread.start()
            _IDENT, _QUEUE = thread.ident, jobs
        _ENABLED = True
    _leave_openmp()


def disable() -> None:
    """Calls run where they are made again, and the calling thread's torch work gets its thread count back (tests
    and tools that enabled the native thread for a while; threads other than the caller keep one thread)."""
    global _ENABLED
    if _ENABLED and _QUEUE is not None:  # the native thread's team would slow the caller's (module docstring)
        run(_free_team)
    _ENABLED = False
    if getattr(_prepared, "done", False):
        import torch

        _prepared.done = False
        torch.set_num_threads(_prepared.threads)


def threads() -> int:
    """torch's thread count where the engine's passes run: the calling thread's count from before it left
    OpenMP (cost profiles and kernel plans are keyed by it), else its current one."""
    if getattr(_prepared, "done", False):
        return _prepared.threads
    import torch

    return torch.get_num_threads()


def enabled() -> bool:
    return _ENABLED


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: on the native thread once :func:`enable` was called (with the caller's context
    variables), else here."""
    if not _ENABLED or threading.get_ident() == _IDENT:
        return fn(*args, **kwargs)
    _leave_openmp()
    ctx = contextvars.copy_context()
    job = _Job(lambda: ctx.run(fn, *args, **kwargs))
    assert _QUEUE is not None
    _QUEUE.put(job)
    job.done.acquire()
    if job.error is not None:
        raise job.error
    return job.result
