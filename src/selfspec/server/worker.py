"""The generation worker: one model, up to ``parallel`` generations at a time, from a bounded queue, in arrival
order.

A :class:`~selfspec.server.backlog.Job` is queued by a request handler and each of its choices decoded by one
of the worker's slots (a thread each; a request's choices on as many slots as are free,
:mod:`selfspec.server.backlog`); the pieces of text they produce are handed to the handler's event loop
as they are accepted (streamed, or gathered for a plain response).  With several slots, the generations
running at the same time verify their rounds in one batched pass (:mod:`selfspec.decoding.batch`): a
choice joins the batch when a slot takes it and leaves when it ends; its output is the one it gets alone.  A job
whose client went away is cancelled: its generations stop at the next round.  When
the queue is full, :meth:`Worker.submit` refuses at once (the server answers
429 with Retry-After) rather than building an unbounded backlog.

The keys and values of recent requests are kept in one
:class:`~selfspec.core.prefix_store.PrefixStore` shared by the methods' sessions (``prefix_cache_mb``; 0:
none): a request that extends an earlier one (a chat's next turn resends the conversation) prefills only its
new tokens, with the output a whole prefill gives.

Learned state (SWIFT's skip sets and optimiser, what the drafters learned)
lives in one :class:`~selfspec.Session` per method and slot for as long as the server
runs; with ``state_path``, the first slot's SWIFT state is loaded at start, saved after every
request (atomically, by the policy) and at shutdown (the other slots learn their own, not saved).  An
unreadable state file is set aside with a warning, and the server starts fresh.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..api import Session
from ..core import native_thread
from ..core.prefix_store import DEFAULT_MB, PrefixStore, inexact_reason
from ..cost.costs import CostProfile, cost_profile
from ..decoding.batch import StepBatcher
from ..decoding.limits import is_token_ids
from ..decoding.logprobs import TokenLogprob, prompt_logprobs
from ..errors import SelfspecError
from ..model.models import Model
from .backlog import Backlog, Job, Task
from .logprobs import LogprobFormatter
from .metrics import Metrics


def stateful(method: str, options: dict) -> bool:
    """Whether the method's learned state goes into the state file: SWIFT's search, also as auto's source."""
    return method == "swift" or (method == "auto" and options.get("layerskip") == "swift")


MAX_PARALLEL = 16
PARALLEL_COST = 1.5  # the default batch: as many sequences as a pass runs within this factor of a one-row pass


def default_parallel(profile: CostProfile) -> int:
    """Slots for this machine: the largest of 1, 2, 4 whose one-row-each batch costs at most PARALLEL_COST
    one-row passes (a pass bound by reading the weights runs a few rows for little more than one)."""
    one = profile.forward(1)
    return max(n for n in (1, 2, 4) if profile.forward(n) <= PARALLEL_COST * one)


# a prompt chunk may cost this factor of the cheapest per-row cost of the profile's passes.  Was 1.15 (SmolLM2: 24
# rows): in a batch of 4 SmolLM2 requests a 24-row chunk's rows cost 0.47 ms each and a 64-row one's 0.36 (the
# profile, timed after a 32-token context, said 0.42 and 0.38: a prompt's later chunks attend to more keys), and
# prompt passes were half the batch's time: aggregate 464 -> 502 tokens/s (in process, 4 x 8 requests)
CHUNK_SLACK = 1.02


def prompt_chunk(profile: CostProfile) -> int:
    """Prompt rows per batch pass when a request prefills beside others' decoding: the fewest rows (at least 8)
    whose per-row cost is within CHUNK_SLACK of the cheapest per-row cost the profile measured, so that the
    prompt is read nearly as fast as alone while the others get a token per chunk (SmolLM2 here: 48-64)."""
    grid = [t for t in sorted(profile.forward_ms) if 8 <= t <= 64]
    if not grid:
        return StepBatcher.PROMPT_CHUNK
    best = min(profile.forward(t) / t for t in grid)
    return min(t for t in grid if profile.forward(t) / t <= CHUNK_SLACK * best)


class StopScanner:
    """Cuts the text at the first stop string; holds back a tail that may be the start of one.

    Items fed with a piece (its tokens' log-probabilities) are given out with the text they belong to: an item
    once its token's text has begun to go out, and none whose token starts at or after a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.text, self.sent = stops, "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending: list[tuple[int, Any]] = []  # (the item's token's offset in the text, the item)

    def feed(self, piece: str, items: Sequence[tuple[int, Any]] = ()) -> tuple[str, bool]:
        """(text that can be sent now, whether a stop string was met); ``items``: (offset in ``piece``, item)."""
        self.pending.extend((len(self.text) + at, item) for at, item in items)
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if hits:
            out, self.sent = self.text[self.sent : min(hits)], min(hits)
            self.pending = [(at, item) for at, item in self.pending if at < self.sent]  # the rest is cut
            return out, True
        ready = len(self.text) - self.hold
        if ready <= self.sent:
            return "", False
        out, self.sent = self.text[self.sent : ready], ready
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out

    def ready(self, everything: bool = False) -> list[tuple[int, Any]]:
        """The items whose text has gone out (with ``everything``, all that are left), with their offsets."""
        if everything:
            out, self.pending = self.pending, []
            return out
        out = [(at, item) for at, item in self.pending if at < self.sent]
        self.pending = [(at, item) for at, item in self.pending if at >= self.sent]
        return out


class Worker:
    def __init__(self, model: Model, method: str, *, allowed: tuple[str, ...], queue_size: int = 8,
                 state_path: str | Path | None = None, options: dict[str, Any] | None = None,
                 prefix_cache_mb: float = DEFAULT_MB, parallel: int = 1, chunk: int | None = None) -> None:  # fmt: skip
        if not 1 <= parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel must be between 1 and {MAX_PARALLEL}, got {parallel}")
        native_thread.enable()  # slots decode in their own threads: the passes on one (core/native_thread.py)
        self.model, self.method, self.allowed = model, method, allowed
        self.parallel = parallel
        self.batcher = None
        if parallel > 1:  # prompts prefill in the batch in chunks of `chunk` rows (default: from the cost profile)
            chunk = prompt_chunk(cost_profile(model)) if chunk is None else chunk
            self.batcher = StepBatcher(model.engine, prompt_chunk=chunk)
        self.options = dict(options or {})
        self.state_path = Path(state_path) if state_path else None
        self.prefix_store = PrefixStore.of_mb(prefix_cache_mb)
        self.metrics = Metrics(self.prefix_store, self.batcher)
        # the tokens of replies that ask for logprobs
        self.logprob_formatter = LogprobFormatter(model.tokenizer, lambda token: model.decode([token]))
        self._backlog = Backlog(queue_size)
        self._sessions: list[dict[str, Session]] = [{} for _ in range(parallel)]  # per slot, by method
        self._busy = 0
        self._busy_lock = threading.Lock()
        self.state_loaded = False  # whether a saved state was loaded at start
        self._threads = [threading.Thread(target=self._run, args=(slot,), name=f"selfspec-slot-{slot}", daemon=True)
                         for slot in range(parallel)]  # fmt: skip
        if self.state_path is not None and self.state_path.is_file() and _state_unreadable(self.state_path):
            _set_aside(self.state_path, "is not JSON")

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Build the default method (its costs measured now, not in a request) and load its state; serve."""
        session = self.session(self.method)
        bind = getattr(session.skip_policy, "bind", None)
        if bind is not None and self.state_path is not None:
            existed = self.state_path.is_file()
            try:
                bind(self.model, session.draft_policy)  # loads the saved state now
                self.state_loaded = existed
            except SelfspecError as exc:
                _set_aside(self.state_path, f"cannot be used ({exc})")
                del self._sessions[0][self.method]
                self.session(self.method)
        for slot in range(1, self.parallel):
            self.session(self.method, slot)
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the running generations, refuse the rest, save the learned state."""
        for job in self._backlog.close():
            job.cancel.set()
            job.emit("error", (503, "the server is shutting down"))
        for thread in self._threads:
            thread.join(timeout)
        self.save_state()
        if self.state_path is not None:
            print(f"selfspec serve: state saved to {self.state_path}", file=sys.stderr)

    def save_state(self) -> None:
        for session in self._sessions[0].values():
            save = getattr(session.skip_policy, "save", None)
            if save is not None:
                try:
                    save()
                except (OSError, SelfspecError) as exc:
                    print(f"selfspec serve: could not save the state: {exc}", file=sys.stderr)

    def prefix_cache_line(self) -> str:
        """The prefix store as serve's start line shows it."""
        store = self.prefix_store
        if not store.enabled:
            return "prefix cache off"
        reason = inexact_reason(self.model.engine)
        size = f"{store.max_bytes / (1 << 20):g} MB"
        per_token = self.model.engine.kv_bytes_per_token()
        if per_token:
            size += f" (about {store.max_bytes / per_token / 1000:.0f}k tokens at {per_token / 1000:.1f} KB a token)"
        return f"prefix cache {size}" if reason is None else f"prefix cache unused ({reason})"

    # -- requests ------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        """Choices waiting or being decoded."""
        return len(self._backlog) + self._busy

    def session(self, method: str, slot: int = 0) -> Session:
        """The slot's session of ``method`` (made on first use; only slot 0's keeps a state file)."""
        sessions = self._sessions[slot]
        if method not in sessions:
            options = dict(self.options) if method == self.method else {}
            if stateful(method, options) and self.state_path is not None and slot == 0:
                options["state"] = str(self.state_path)
            sessions[method] = Session(self.model, method, prefix_cache=self.prefix_store, batcher=self.batcher,
                                       **options)  # fmt: skip
        return sessions[method]

    def submit(self, job: Job) -> None:
        """Queue a request; :class:`QueueFull` when ``queue_size`` requests wait already."""
        self._backlog.put(job)
        self.metrics.queue_length = self.queue_length

    def _busy_by(self, n: int) -> None:
        with self._busy_lock:
            self._busy += n
        self.metrics.queue_length = self.queue_length

    def _run(self, slot: int) -> None:
        while True:
            task = self._backlog.get()
            if task is None:
                return
            job = task.job
            self._busy_by(1)
            try:
                if not job.cancel.is_set():
                    self._choice(task, slot)
                    if job.ended():
                        job.emit("done", None)
            except SelfspecError as exc:
                job.cancel.set()  # the request's other choices stop too: it is answered with the error
                job.emit("error", (400, str(exc)))
            except Exception as exc:  # a bug must not kill the worker: answer 500 and go on
                job.cancel.set()
                job.emit("error", (500, f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                self._busy_by(-1)

    def _choice(self, task: Task, slot: int) -> None:
        """One choice of a request: its pieces of text (after its prompt's, with ``echo``), then its end."""
        job, index, prompt, sampling = task.job, task.index, task.prompt, task.sampling
        if index == 0:
            self.metrics.observe_wait(time.perf_counter() - job.queued_at)
        session = self.session(job.method, slot)
        scanner = StopScanner(job.stops)
        shift = self._echo(job, index, prompt) if job.echo else 0  # the completion's text starts after the prompt's
        pieces = session.pieces(prompt, max_new_tokens=job.max_tokens, sampling=sampling,
                                logprobs=job.logprobs)  # fmt: skip
        stopped, tokens = False, 0
        try:
            for piece in pieces:
                if not tokens and not index:  # the first token, from the request's arrival (queue wait included)
                    self.metrics.observe_first_token(time.perf_counter() - job.queued_at)
                items = [] if job.logprobs is None else _offsets(self.model, piece.text, piece.logprobs)
                text, stopped = scanner.feed(piece.text, items)
                tokens += piece.tokens
                job.emit("piece", (index, text, piece.tokens, piece.drafted, _shifted(scanner.ready(), shift)))
                if stopped or job.cancel.is_set():
                    break
        finally:
            pieces.close()  # stops the decoder at this round; the method saves what it learned
        if not stopped:
            tail, left = scanner.flush(), scanner.ready(everything=True)
            if tail or left:
                job.emit("piece", (index, tail, 0, 0, _shifted(left, shift)))
        # statistics exist for a generation that ran to its end (EOS or max_tokens), not one cut by a stop string
        result = session.last_result
        stats = result.stats if result is not None else None
        reason = "stop" if stopped or (stats is not None and stats.stop_reason == "eos") else "length"
        if stats is not None and not job.cancel.is_set():
            self.metrics.observe(stats)
        job.emit("end", (index, reason, stats, tokens))

    def _echo(self, job: Job, index: int, prompt: Any) -> int:
        """``echo``: the prompt's text as the choice's first piece, with its tokens' log-probabilities (the
        first token's None: nothing predicts it) when asked for; the length of that text."""
        ids = list(prompt) if is_token_ids(prompt) else self.model.encode(prompt)
        text = self.model.decode(ids)
        items = []
        if job.logprobs is not None:
            store = self.prefix_store if self.prefix_store.enabled else None  # the generation then reuses it
            items = _offsets(self.model, text, prompt_logprobs(self.model, ids, job.logprobs, store))
        job.emit("piece", (index, text, 0, 0, items))
        return len(text)


def _shifted(items: list[tuple[int, Any]], shift: int) -> list[tuple[int, Any]]:
    return [(at + shift, item) for at, item in items] if shift else items


def _offsets(model: Model, text: str, entries: Sequence[TokenLogprob]) -> list[tuple[int, TokenLogprob]]:
    """Tokens' log-probabilities with the offset of each token's text in ``text``, the text they spell (a
    special token, such as the end of sequence, adds none)."""
    out, at = [], 0
    for entry in entries:
        out.append((min(at, len(text)), entry))
        at += len(model.decode([entry.token]))
    return out


def _state_unreadable(path: Path) -> bool:
    try:
        return not isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):
        return True


def _set_aside(path: Path, why: str) -> None:
    """An unreadable state file: warn, move it aside (it may be someone's work), start fresh."""
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    path.replace(aside)
    print(f"selfspec serve: warning: the state file {path} {why}; moved it to {aside}, starting with a fresh "
          "state", file=sys.stderr)  # fmt: skip
