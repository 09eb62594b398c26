"""The thread guard (core/thread_guard.py) on hand-written pass times: it leaves a quiet machine's thread count
alone, falls back to one thread when passes collapse (or are slow from the start), comes back when the machine
is quiet again, and tries the full count less often while it keeps losing.  No timing of this machine."""

from __future__ import annotations

from selfspec.core import thread_guard as tg


class Machine:
    """Pass times by thread count, as a scenario sets them; records what the guard set."""

    def __init__(self, ms: dict[int, float]) -> None:
        self.ms, self.threads, self.calls = dict(ms), 2, []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.calls.append(n)

    def run(self, guard: tg.ThreadGuard, passes: int, shape=("step", 1)) -> None:
        for _ in range(passes):
            guard.observe(shape, self.ms[self.threads])


def test_a_quiet_machine_keeps_its_threads():
    m = Machine({2: 3.0, 1: 5.0})
    guard = tg.ThreadGuard(m.set_threads, full=2)
    m.run(guard, 20_000)  # 60 s of passes: tries now and then, each lost
    assert m.threads == 2 and guard.switches == 0
    assert 0 < guard.tries <= 60_000 / tg.FULL_TRY_MS + 1, "a try per FULL_TRY_MS of passes, no more"


def test_a_collapse_falls_back_to_one_thread_and_comes_back_when_quiet():
    m = Machine({2: 3.0, 1: 5.0})
    guard = tg.ThreadGuard(m.set_threads, full=2)
    m.run(guard, 100)
    m.ms[2] = 300.0  # another process took a core: barrier waits stall every pass
    m.ms[1] = 6.0
    m.run(guard, 2 * tg.WINDOW)
    assert m.threads == 1 and guard.switches == 1, "one busy window is enough"
    m.run(guard, 5000)
    assert m.threads == 1, "the full count tried again, lost, and is dropped each time"
    lost_tries = m.calls.count(2)
    assert lost_tries < 12, "tries back grow rarer (doubling), each cut short after one slow pass"
    m.ms[2], m.ms[1] = 3.0, 5.0  # quiet again
    m.run(guard, 30_000)
    assert m.threads == 2, "back on both threads once they win"


def test_a_pass_slow_from_the_start_is_caught_too():
    m = Machine({2: 2200.0, 1: 8.0})  # steady (no spread to see): only a try finds the better count
    guard = tg.ThreadGuard(m.set_threads, full=2)
    m.run(guard, 2 * tg.WINDOW)
    assert m.threads == 1


def test_shapes_are_compared_with_their_own_quickest_pass():
    m = Machine({2: 3.0, 1: 5.0})
    guard = tg.ThreadGuard(m.set_threads, full=2)
    for _ in range(4000):  # plain steps and 8-row verifications interleaved: neither looks slow
        guard.observe(("step", 1), m.ms[m.threads])
        guard.observe(("verify", 8), 4 * m.ms[m.threads])
    assert m.threads == 2 and guard.switches == 0


def test_install_needs_more_than_one_thread(monkeypatch):
    assert tg.install(lambda n: None, 1) is None
    monkeypatch.setenv(tg.ENV, "0")
    assert tg.install(lambda n: None, 2) is None
    monkeypatch.delenv(tg.ENV)
    guard = tg.install(lambda n: None, 2)
    assert guard is not None and tg.current() is guard


def test_a_prompt_runs_on_the_kept_count_never_on_a_try(monkeypatch):
    """A pass the guard does not watch (a prefill) inside a try's window runs on the count in force before the
    try, and the try goes on after it; outside a try nothing is switched."""
    m = Machine({2: 3.0, 1: 5.0})
    guard = tg.ThreadGuard(m.set_threads, full=2)
    monkeypatch.setattr(tg, "_GUARD", guard)
    with tg.unwatched():
        assert m.threads == 2 and m.calls == []  # no try: left alone
    m.run(guard, int(tg.FULL_TRY_MS / 3.0) + tg.WINDOW)  # until a try of the fallback is under way
    while guard.kept == guard.current:
        m.run(guard, 1)
    assert m.threads == 1 and guard.kept == 2
    with tg.unwatched():
        assert m.threads == 2  # the prompt on the kept two threads
    assert m.threads == 1 and guard.current == 1  # the try resumes
    m.run(guard, tg.WINDOW)
    assert m.threads == 2 and guard.kept == 2 and guard.switches == 0  # and is lost as before
