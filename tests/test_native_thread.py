"""core/native_thread.py: engine passes handed to one thread once several threads decode."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from selfspec.core import native_thread

pytestmark = pytest.mark.threads  # runs on every thread, as a user's run does (make test: first, in one process)

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_native_thread", default="unset")


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    return out[0]


def test_calls_run_where_they_are_made_until_enabled():
    assert not native_thread.enabled()
    assert native_thread.run(threading.get_ident) == threading.get_ident()


def test_once_enabled_every_thread_hands_its_calls_to_one_thread():
    threads = torch.get_num_threads()
    native_thread.enable()
    here = native_thread.run(threading.get_ident)
    assert here != threading.get_ident()
    assert _in_thread(lambda: native_thread.run(threading.get_ident)) == here, "one native thread for all callers"
    assert native_thread.run(lambda: native_thread.run(threading.get_ident)) == here, "a nested call runs in place"
    token = VAR.set("caller's")
    try:
        assert native_thread.run(VAR.get) == "caller's", "the caller's context variables travel with the call"
    finally:
        VAR.reset(token)
    with pytest.raises(ZeroDivisionError):
        native_thread.run(lambda: 1 / 0)
    assert torch.get_num_threads() == 1, "the caller's own torch work leaves OpenMP to the native thread"
    native_thread.disable()
    assert torch.get_num_threads() == threads and native_thread.run(threading.get_ident) == threading.get_ident()


def test_a_model_decodes_alike_through_the_native_thread(smollm2):
    import selfspec

    alone = selfspec.generate(smollm2, "The capital of France is", "pld", max_new_tokens=24).token_ids
    native_thread.enable()
    assert _in_thread(lambda: selfspec.generate(smollm2, "The capital of France is", "pld",
                                                max_new_tokens=24).token_ids) == alone  # fmt: skip


def test_costs_are_keyed_by_the_thread_count_of_the_passes():
    threads = torch.get_num_threads()
    native_thread.enable()
    assert torch.get_num_threads() == 1 and native_thread.threads() == threads, "not by the caller's own count"


def test_disable_frees_the_native_threads_team(monkeypatch):
    """disable() frees the native thread's OpenMP team, on that thread: while two teams live the caller's
    parallel regions park at barriers (a SmolLM2 step took 10.8 ms instead of 2.3 here)."""
    freed = []
    native_thread.enable()
    native = native_thread.run(threading.get_ident)
    monkeypatch.setattr(native_thread, "_free_team", lambda: freed.append(threading.get_ident()))
    native_thread.disable()
    assert freed == [native] and not native_thread.enabled()
