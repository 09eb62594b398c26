"""Kernel variants chosen by timing on the machine at hand (core/native_tuning.py): the choice follows the
timer, is cached, keeps the default within noise, and no variant changes a single logit."""

from __future__ import annotations

import pytest
import torch
from test_fused import quantised_tiny

from selfspec.core import native_thread, native_tuning, quant
from selfspec.core.native_tuning import tune

pytestmark = pytest.mark.threads  # runs on every thread, as a user's run does (make test: first, in one process)


def _fake_timer(ms_of: dict[int, float], state: dict):
    def apply(value: int) -> None:
        state["value"] = value

    def time_pass() -> float:
        state["calls"] = state.get("calls", 0) + 1
        return ms_of[state["value"]] / 1000

    return apply, time_pass


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Choices of these tests are cached in a folder of their own (the session's native/ is the user's)."""
    monkeypatch.setattr(native_tuning, "cache_dir", lambda *parts: tmp_path)


def test_the_fastest_candidate_wins_and_is_cached():
    state: dict = {}
    apply, time_pass = _fake_timer({0: 5.0, 1024: 3.0, 4096: 4.0, 16384: 4.1}, state)
    first = tune("t", (0, 1024, 4096, 16384), 4096, apply, time_pass, key="k1")
    assert first.choice == 1024 and state["value"] == 1024 and not first.cached
    assert first.ms[0] == pytest.approx(5.0)
    calls = state["calls"]
    state["value"] = None
    again = tune("t", (0, 1024, 4096, 16384), 4096, apply, time_pass, key="k1")
    assert again.cached and again.choice == 1024 and state["value"] == 1024  # applied from the cache
    assert state["calls"] == calls  # nothing timed
    assert tune("t", (0, 1024, 4096, 16384), 4096, apply, time_pass, key="k1", force=True).cached is False
    native_tuning.forget()  # selfspec kernels --force: every cached choice dropped, the next load times again
    assert tune("t", (0, 1024, 4096, 16384), 4096, apply, time_pass, key="k1").cached is False


def test_the_default_stays_within_noise():
    state: dict = {}
    apply, time_pass = _fake_timer({0: 4.0, 4096: 4.05}, state)  # 1% apart: under KEEP_DEFAULT
    assert tune("t", (0, 4096), 4096, apply, time_pass, key="k2").choice == 4096


@pytest.mark.skipif(not quant.int8_kernels_available(), reason="needs native int8 kernels")
@pytest.mark.parametrize("knob, values", [("int8_prefetch", native_tuning.PREFETCH_CANDIDATES),
                                          ("int8_prefetch_hint", native_tuning.HINT_CANDIDATES + (2, -1)),
                                          ("pass_threads", (1, 2, 3)),
                                          ("int8_split", native_tuning.SPLIT_CANDIDATES + (1, -1))])  # fmt: skip
def test_no_variant_changes_a_logit(knob, values):
    """Whatever a knob is set to, a prompt and a 7-token verification give the same logits bit for bit."""
    model = quantised_tiny("llama")
    engine, lib = model.engine, quant.native()
    setter, getter = getattr(lib, f"selfspec_set_{knob}"), getattr(lib, f"selfspec_{knob}")
    ids = torch.arange(3, 40) % model.adapter.vocab_size
    old, distance = getter(), lib.selfspec_int8_prefetch()
    lib.selfspec_set_int8_prefetch(4096)  # the hint acts only where the products prefetch at all
    out = []
    try:
        with quant.activations("int8"):
            for value in values:
                setter(value)
                # an unknown hint is taken as non-temporal (0)
                assert getter() == (value if knob != "int8_prefetch_hint" or value in (0, 1, 3) else 0)
                cache = engine.new_cache(64)
                engine.forward(cache, ids[:30], 0)
                cache.commit(30)
                out.append(engine.forward(cache, ids[30:], 30))
    finally:
        setter(old)
        lib.selfspec_set_int8_prefetch(distance)
    assert all(torch.equal(out[0], o) for o in out[1:])


def test_a_loaded_model_reports_its_tuned_variants(smollm2):
    """The default model on the fused int8 stack is tuned at load: one result per knob, its choice among the
    candidates, every candidate timed."""
    if not (smollm2.engine.fused and quant.int8_activations()):
        pytest.skip("no fused int8 stack here")
    # tuned again (cached: no timing) under this thread count: the session's model may have been loaded by a test
    # that ran it on one thread, where there is no thread count to tune
    tuned = native_tuning.tune_model(smollm2)
    if quant.int8_kernels_prefetch():  # the vector products' prefetch: its caches, then its distance
        hint, result = tuned.pop(0), tuned.pop(0)
        assert hint.knob == "int8_prefetch_hint" and hint.choice in native_tuning.HINT_CANDIDATES
        assert set(hint.ms) == set(native_tuning.HINT_CANDIDATES)
        assert quant.native().selfspec_int8_prefetch_hint() == hint.choice
        assert "int8_prefetch_hint = " in hint.describe() and "(non-temporal):" in hint.describe()
        assert result.knob == "int8_prefetch" and result.choice in native_tuning.PREFETCH_CANDIDATES
        assert set(result.ms) == set(native_tuning.PREFETCH_CANDIDATES) and all(ms > 0 for ms in result.ms.values())
        assert "int8_prefetch =" in result.describe()
    several = native_thread.threads() > 1
    assert len(tuned) == (0 if not several else 2 if tuned[0].choice > 1 else 1)
    if several:
        threads = tuned[0]
        assert threads.knob == "pass_threads" and threads.choice in threads.ms and 1 in threads.ms
    if len(tuned) == 2:  # the chosen threads' way of sharing a product
        split = tuned[1]
        assert split.knob == "int8_split" and set(split.ms) == set(native_tuning.SPLIT_CANDIDATES)
        assert split.choice in native_tuning.SPLIT_CANDIDATES and "int8_split =" in split.describe()


def test_steady_load_from_elsewhere_keeps_the_default_too(monkeypatch):
    """Timings that do not swing but were taken while other processes held our CPUs (clock.OtherLoad) decide
    nothing short of a clear win either: the default holds and nothing is cached."""
    from selfspec.core import clock

    class Loaded(clock.OtherLoad):
        def __exit__(self, *exc):
            self.cores = 1.0

    monkeypatch.setattr(clock, "OtherLoad", Loaded)
    state: dict = {}

    def apply(value: int) -> None:
        state["value"] = value

    def time_pass() -> float:
        return (0.8 if state["value"] == 0 else 1.0) / 1000  # 1.25x: under BUSY_MARGIN

    first = tune("t", (0, 4096), 4096, apply, time_pass, key="k4")
    assert first.busy and first.choice == 4096
    assert not tune("t", (0, 4096), 4096, apply, time_pass, key="k4").cached


def _swinging_timer(state: dict, swings: list[float]):
    """A candidate 0 twice as fast as any other, every pass slowed by the next of ``swings`` (repeated): the
    timings of a machine where something else runs now and then."""
    factors = iter(swings * 1000)

    def apply(value: int) -> None:
        state["value"] = value

    def time_pass() -> float:
        return (0.5 if state["value"] == 0 else 1.0) * next(factors) / 1000

    return apply, time_pass


def test_a_busy_machine_keeps_the_default_and_caches_nothing():
    """Timings that swing (another process ran) decide nothing: the default holds and the next call times again."""
    state: dict = {}
    apply, time_pass = _swinging_timer(state, [1.0, 9.0])  # the median pass disagrees with the fastest
    first = tune("t", (0, 4096), 4096, apply, time_pass, key="k3")
    assert first.busy and first.choice == 4096 and state["value"] == 4096
    assert "busy" in first.describe()
    assert not tune("t", (0, 4096), 4096, apply, time_pass, key="k3").cached


def test_a_busy_machine_still_takes_a_clear_win_but_caches_it_not():
    """A candidate 2x faster in its fastest and median passes alike wins through the load's swings (Intel server
    parts: no software prefetch, 2.1x, seen while a compiler held both cores), uncached; a knob whose best value
    depends on the load (the thread count) keeps its default there."""
    state: dict = {}
    apply, time_pass = _swinging_timer(state, [1.0, 3.0, 1.2])  # fastest and median agree: 2x
    first = tune("t", (0, 4096), 4096, apply, time_pass, key="k5")
    assert first.busy and first.choice == 0 and state["value"] == 0
    assert "clear though the machine was busy" in first.describe() and "not cached" in first.describe()
    assert not tune("t", (0, 4096), 4096, apply, time_pass, key="k5").cached
    held = tune("t", (0, 4096), 4096, apply, time_pass, key="k6", decide_when_busy=False)
    assert held.busy and held.choice == 4096 and state["value"] == 4096
