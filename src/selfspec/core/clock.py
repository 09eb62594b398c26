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


def charge(engine: Any, tokens: int, *, skip: Any, precision: Any, draft: bool = False) -> None:
    """Advance the virtual clock by what a pass of ``engine`` over ``tokens`` rows costs (no-op when real);
    ``draft``: a draft pass (its head scores the draft vocabulary, even with nothing skipped)."""
    global _virtual_s
    if _source is None:
        return
    prof = _profile_for(engine, None)  # made from the engine if no one asked for it yet
    ms = prof.pass_ms(tokens, skip, precision, draft=draft)
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
    old, old_profiles = _source, dict(_profiles)
    _source, _virtual_s = source, 0.0
    _profiles.clear()
    try:
        yield
    finally:
        _source = old
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
