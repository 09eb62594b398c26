"""The server's backlog: admitted requests (:class:`Job`) and the choices they are made of (:class:`Task`),
taken by the worker's slots in arrival order.

A request asks for ``n`` choices of each of its prompts.  It waits in a bounded queue of requests (a full
queue refuses a new one at once: the server answers 429); the slot that takes it starts its first choice and
leaves the others first in line, so idle slots take them at once and a request's choices decode together,
their rounds verified in the same batched passes.  The last of a request's choices to end tells its handler
that the request is done.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.sampling import SamplingParams


class QueueFull(Exception):
    pass


@dataclass(eq=False)  # one request is one object (a set of requests holds each once)
class Job:
    """One request: its prompts, method, sampling and limits; events go to its handler through ``emit``."""

    prompt: Any  # chat messages, raw text or token ids; a list of prompts with ``batch``
    method: str
    sampling: SamplingParams
    max_tokens: int
    stops: list[str]
    emit: Callable[[str, Any], None]  # (kind, payload), called from the worker's threads (events: server/app.py)
    logprobs: int | None = None  # each token's log-probability and this many alternatives; None: none
    n: int = 1  # choices per prompt
    batch: bool = False  # ``prompt`` is a list of prompts (text completions): choice p * n + i is prompt p's i-th
    echo: bool = False  # each choice starts with its prompt's text (and with ``logprobs``, its tokens' figures)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    _left: int = field(default=0, init=False, repr=False)  # choices not ended yet
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def tasks(self) -> list[Task]:
        """Its choices: choice ``p * n + i`` is prompt p's i-th, sampled with ``seed + i`` when seeded (choice 0
        of a prompt is what the request gives with ``n`` 1)."""
        prompts = list(self.prompt) if self.batch else [self.prompt]
        out = []
        for p, prompt in enumerate(prompts):
            for i in range(self.n):
                sampling = self.sampling
                if i and sampling.seed is not None:
                    sampling = replace(sampling, seed=sampling.seed + i)
                out.append(Task(self, prompt, p * self.n + i, sampling))
        self._left = len(out)
        return out

    def ended(self) -> bool:
        """One choice ended; whether it was the last."""
        with self._lock:
            self._left -= 1
            return self._left == 0


@dataclass
class Task:
    """One choice of a request."""

    job: Job
    prompt: Any
    index: int
    sampling: SamplingParams


def loop_emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[str, Any], None]:
    """An ``emit`` for :class:`Job` that hands events to an asyncio queue from another thread."""
    return lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload))


class Backlog:
    """Requests waiting (at most ``max_jobs``) and the choices of started ones, taken by :meth:`get`."""

    def __init__(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self._jobs: deque[Job] = deque()
        self._tasks: deque[Task] = deque()  # choices of started requests, first in line
        self._cond = threading.Condition()
        self._closed = False

    def put(self, job: Job) -> None:
        with self._cond:
            if self._closed or len(self._jobs) >= self.max_jobs:
                raise QueueFull
            self._jobs.append(job)
            self._cond.notify()

    def get(self) -> Task | None:
        """The next choice to decode (a started request's first); None once closed."""
        with self._cond:
            while not self._closed and not self._tasks and not self._jobs:
                self._cond.wait()
            if self._closed:
                return None
            if not self._tasks:
                self._tasks.extend(self._jobs.popleft().tasks())
                if len(self._tasks) > 1:
                    self._cond.notify_all()  # other idle slots: take the rest of this request's choices
            return self._tasks.popleft()

    def close(self) -> list[Job]:
        """Stop giving out choices; the requests not finished by then (waiting, or with choices waiting)."""
        with self._cond:
            self._closed = True
            left = list(self._jobs) + list(dict.fromkeys(t.job for t in self._tasks))
            self._jobs.clear()
            self._tasks.clear()
            self._cond.notify_all()
        return left

    def __len__(self) -> int:
        """Choices waiting: those of started requests and one per waiting request."""
        with self._cond:
            return len(self._jobs) + len(self._tasks)
