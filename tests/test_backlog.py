"""The server's backlog: requests in arrival order, a started request's choices first in line, a bounded queue
of waiting requests, and what is left when the server stops."""

from __future__ import annotations

import threading

import pytest

from selfspec.core.sampling import SamplingParams
from selfspec.server.backlog import Backlog, Job, QueueFull


def _job(prompt, n=1, batch=False, seed=None) -> Job:
    return Job(prompt, "vanilla", SamplingParams(temperature=0.5, seed=seed), 8, [], lambda kind, payload: None,
               n=n, batch=batch)  # fmt: skip


def test_a_started_requests_choices_come_before_the_next_request():
    backlog = Backlog(max_jobs=2)
    first, second = _job(["a", "b"], n=2, batch=True, seed=7), _job("c")
    backlog.put(first)
    backlog.put(second)
    with pytest.raises(QueueFull):
        backlog.put(_job("d"))
    taken = [backlog.get() for _ in range(5)]
    assert [(t.job, t.prompt, t.index) for t in taken] == [(first, "a", 0), (first, "a", 1), (first, "b", 2),
                                                            (first, "b", 3), (second, "c", 0)]  # fmt: skip
    assert [t.sampling.seed for t in taken[:4]] == [7, 8, 7, 8], "choice i of a prompt samples with seed + i"
    assert [first.ended() for _ in range(4)] == [False, False, False, True]
    assert len(backlog) == 0


def test_the_queue_bounds_waiting_requests_not_choices():
    backlog = Backlog(max_jobs=1)
    backlog.put(_job("a", n=8))
    assert backlog.get().index == 0 and len(backlog) == 7
    backlog.put(_job("b"))  # the first request has started: its choices do not hold a place in the queue
    with pytest.raises(QueueFull):
        backlog.put(_job("c"))


def test_idle_slots_wake_for_a_requests_choices_and_close_returns_the_unfinished():
    backlog = Backlog(max_jobs=4)
    got, lock = [], threading.Lock()

    def slot():
        task = backlog.get()
        with lock:
            got.append(task)

    threads = [threading.Thread(target=slot) for _ in range(3)]
    for t in threads:
        t.start()
    job = _job("a", n=3)
    backlog.put(job)
    for t in threads:
        t.join(10)
    assert sorted(t.index for t in got) == [0, 1, 2], "three waiting slots took the three choices"
    started, waiting = _job("b", n=2), _job("c")
    backlog.put(started)
    backlog.put(waiting)
    backlog.get()
    assert backlog.close() == [waiting, started]
    assert backlog.get() is None
    with pytest.raises(QueueFull):
        backlog.put(_job("d"))
