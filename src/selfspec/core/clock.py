"""The clock that decoding decisions read: this machine's, or one simulated from a given cost profile.

Every choice that weighs time (whether a round drafts, how long a draft runs,
how wide a tree grows, when SWIFT searches, ASD's gate) reads two things: the
model's :class:`~selfspec.cost.costs.CostProfile` and the time rounds really
took.  Both are measured on the machine at hand, so the same prompt may be
drafted on one CPU and decoded plainly on another.  That is right for users
and wrong for a test or a replayable study, whose verdict must not depend on
the CPU it runs on.

:func:`simulated` switches both to a given profile: :func:`~selfspec.cost.costs.cost_profile`
returns it instead of measuring, and :func:`now` returns a virtual clock that
only the engine's passes (and head products) advance, by what the
profile says the pass costs.  Decisions then depend on the tokens alone, the
same on every machine.  Outputs never depend on the clock (the central
invariant); only which drafts are tried does.

    with clock.simulated(costs.read_bound_profile):   # or a fixed CostProfile
        out = selfspec.generate(model, prompt, "asd")

The test suite runs under :func:`selfspec.cost.costs.read_bound_profile` (``tests/conftest.py``);
tests of measurement itself opt out with ``@pytest.mark.real_clock``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ProfileSource = Any  # a CostProfile (selfspec.cost.costs), or a function making one from a model

_lock = threading.Lock()
_source: ProfileSource | None = None
_virtual_s = 0.0
_profiles: dict[int, tuple[weakref.ref, Any]] = {}  # id(engine) -> (the engine, its simulated profile)


def now() -> float:
    """Seconds: ``time.perf_counter()``, or the virtual clock under :func:`simulated`."""
    if _source is None:
        return time.perf_counter()
    return _virtual_s


BUSY_SPREAD = 1.5  # timings whose upper / lower quartile exceed this: something else ran while they were taken
BUSY_OTHERS = 0.25  # ... or other processes (or the hypervisor) took this many cores' worth of our CPUs meanwhile
WATCHED_CPUS = 4  # the CPUs we may run on are watched only where they are this few (on a large shared host the
# other cores' load says nothing about ours)


class OtherLoad:
    """How much of the CPUs this process may run on others took during a span (Linux: ``/proc/stat``, less this
    process's own CPU time, plus the time the hypervisor gave our vCPUs to other guests), in cores' worth:
    ``with OtherLoad() as load: ...`` then ``load.cores``.  Steady load from elsewhere slows every timing alike,
    which the quartile spread of repeated timings does not see (a test suite running beside a cost measurement
    made a 14 ms step read 22 ms and a two-token pass 1.7 of a one-token one).  0.0 where it cannot be told
    (not Linux, or more than ``WATCHED_CPUS`` CPUs to watch)."""

    def __init__(self) -> None:
        self.cores = 0.0
        self._start: tuple[float, float, float] | None = None

    def __enter__(self) -> OtherLoad:
        self._start = _cpu_snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        end = _cpu_snapshot()
        if self._start is not None and end is not None:
            (w0, busy0, own0), (w1, busy1, own1) = self._start, end
            if w1 > w0:
                self.cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (w1 - w0))

    @property
    def busy(self) -> bool:
        return self.cores > BUSY_OTHERS


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall seconds, busy seconds of the CPUs we may run on, this process's CPU seconds), or None."""
    try:
        cpus = os.sched_getaffinity(0)
        if len(cpus) > WATCHED_CPUS:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    v = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        t = os.times()
        return time.monotonic(), busy / hz, t.user + t.system
    except (OSError, AttributeError, ValueError, IndexError):
        return None


def quartile_spread(samples: list[float]) -> float:
    """Upper over lower quartile of repeated timings of one thing: ~1.0-1.2 on a quiet machine, and past
    :data:`BUSY_SPREAD` when other work took the cores during some of them."""
    if len(samples) < 2:
        return 1.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return q3 / q1 if q1 > 0 else float("inf")


def active() -> bool:
    return _source is not None


def given_profile(model: Any) -> Any:
    """The simulated profile of ``model`` (None: measure as usual)."""
    if _source is None:
        return None
    return _profile_for(model.engine, model)


def charge(engine: Any, tokens: int, *, skip: Any, precision: Any, draft: bool = False,
           last_only: bool = False, head: bool = True) -> None:  # fmt: skip
    """Advance the virtual clock by what a pass of ``engine`` over ``tokens`` rows costs (no-op when real);
    ``draft``: a draft pass (its head scores the draft vocabulary, even with nothing skipped); ``last_only``: its
    head computes the last row's logits alone (a prompt); ``head=False``: a one-row pass without its head (its
    head's rows' share of the full head's cost taken off: the draft vocabulary's for a draft)."""
    global _virtual_s
    if _source is None:
        return
    prof = _profile_for(engine, None)  # made from the engine if no one asked for it yet
    ms = prof.pass_ms(tokens, skip, precision, draft=draft, last_only=last_only)
    if not head:
        vocab, share = getattr(engine, "draft_vocab", None), 1.0
        if draft and vocab is not None:
            share = vocab.size / vocab.vocab_size
        ms = max(0.0, ms - prof.head(1) * share)
    with _lock:
        _virtual_s += ms / 1000.0


def charge_head(engine: Any, tokens: int) -> None:
    """Advance the virtual clock by the full LM head over ``tokens`` hidden states (a head-only verification's
    product, :meth:`~selfspec.model.engine.Engine.head_logits`); no-op when real."""
    global _virtual_s
    if _source is None:
        return
    ms = _profile_for(engine, None).head(tokens)
    with _lock:
        _virtual_s += ms / 1000.0


@contextmanager
def simulated(source: ProfileSource) -> Iterator[None]:
    """Decide with ``source``'s costs and a virtual clock inside the block (see the module docstring)."""
    global _source, _virtual_s
    old, old_profiles, old_s = _source, dict(_profiles), _virtual_s
    _source, _virtual_s = source, 0.0
    _profiles.clear()
    try:
        yield
    finally:  # an enclosing simulation (the test suite's, around a simulated benchmark) resumes where it was
        _source, _virtual_s = old, old_s
        _profiles.clear()
        _profiles.update(old_profiles)


def _profile_for(engine: Any, model: Any) -> Any:
    ref, prof = _profiles.get(id(engine), (None, None))
    if ref is None or ref() is not engine:  # new, or an id reused after its engine was collected
        src = _source
        assert src is not None
        prof = src(model if model is not None else engine) if callable(src) else src
        if prof.num_layers != engine.num_layers:
            raise ValueError(f"the given cost profile has {prof.num_layers} layers; the model has {engine.num_layers}")
        _profiles[id(engine)] = (weakref.ref(engine), prof)
    return prof
