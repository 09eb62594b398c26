"""Variants of the native kernels, chosen by timing whole passes on the machine they run on.

A kernel's best form depends on the CPU: how far ahead the int8 products
prefetch their weight stream is worth a third of a step on one CPU (Zen 5:
none read the 262k-row head at 2/3 of the speed of 2-16 KB ahead), and the
same non-temporal prefetch halves it on another (an Intel Xeon, whose L2
streamer never sees the lines it fetches past L2).  So no constant is
right everywhere: each tunable knob is timed inside whole one-token passes of
the model being loaded (what decoding repeats), the candidates interleaved so
that a spell of load hits all alike, each priced by its fastest pass, and the
fastest kept unless the default is within ``KEEP_DEFAULT`` of it.  Timings
whose spread shows a busy machine choose only a candidate that beats the
default by ``BUSY_MARGIN`` in both its fastest and its median pass (the
prefetch's caches on an Intel Xeon: 2x, clear under any load), else the
default holds; either way nothing is cached and the next load times again.
The choice is cached per native library (its key holds the CPU model and
flags, compiler and sources) and model size class, and ``selfspec kernels``
reports it with every candidate's time.

Knobs (the native library's setters):

* ``int8_prefetch_hint``: which caches that prefetch fills (0 non-temporal,
  1 the outer ones, 3 all), ``selfspec_set_int8_prefetch_hint``, timed first
  at the default distance: on an Intel Xeon (Sapphire Rapids) VM non-temporal
  prefetches halve the products' speed (lines fetched past L2 train no L2
  streamer: Qwen2.5-Coder 0.5B one-token pass 36.6 ms against 18.2 with none)
  where the outer caches' beat none by 8%, and a 5-row pass by 14%; on Zen 4/5
  non-temporal ones are what was tuned;
* ``int8_prefetch``: bytes ahead of the int8 products' software prefetch
  (0 = none), ``selfspec_set_int8_prefetch``, under the chosen hint (the x86
  vector builds: ARM's and the portable loops have no software prefetch);
* ``pass_threads``: threads of a decoding pass (1, half, or all the threads
  torch may use), ``selfspec_set_pass_threads``: where the two vCPUs of a VM
  are hyperthreads of one core, or another process holds one, a second thread
  adds barrier waits (a pass has several per layer) and no bandwidth;
* ``int8_split``: how a product's 16-row blocks are shared between those
  threads, ``selfspec_set_int8_split``: 0 in equal consecutive shares (one long
  weight stream a thread: what DRAM and the prefetchers serve best; Zen 5 VM,
  1.5B Q4_K_M pass 21.2 ms), ``-n`` guided (long shares first, the last blocks
  to whichever thread is free, n at least: 25.5 against static's 25.6 ms in
  another run), ``n`` dynamic, n blocks at a time (16: 22.9 and 27.6 ms, the
  streams cut short); the shares that adapt are for CPUs whose threads do not
  run evenly (efficiency cores beside performance ones, a vCPU preempted
  often), where equal shares leave one thread waiting at every barrier.

Both are process-wide (the last loaded model's choice holds) and change no
result, only its speed (each thread's share is computed the same way).  What
runs beside decoding later can change the best thread count: the thread guard
(:mod:`selfspec.core.thread_guard`) watches the passes and falls back to one
thread while the machine is busy.

``selfspec kernels --force`` tunes again and prints the table.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..io import atomic_write_text, cache_dir
from . import clock, native_thread, thread_guard

PREFETCH_CANDIDATES = (0, 1024, 4096, 16384)
PREFETCH_DEFAULT = 4096
HINT_CANDIDATES = (0, 1, 3)  # __builtin_prefetch's locality: non-temporal, outer caches, every level
HINT_DEFAULT = 0
SPLIT_CANDIDATES = (0, -4, 16)  # static halves, guided (4 blocks at least), dynamic (16 blocks a time)
SPLIT_DEFAULT = 0
LABELS = {  # what a knob's values mean, for the report
    "int8_prefetch_hint": {0: "non-temporal", 1: "outer caches", 3: "every cache"},
    "int8_split": {0: "halves", -4: "guided", 16: "dynamic"},
}
KEEP_DEFAULT = 0.03  # the default stays unless a candidate is more than this share faster
BUSY_MARGIN = 1.5  # on a busy machine a candidate still wins when this much faster by its fastest and median pass
REPS = 9


@dataclass(frozen=True)
class TuneResult:
    knob: str
    choice: int
    default: int
    ms: dict[int, float]  # candidate -> median ms of one timed pass
    key: str
    cached: bool = False
    busy: bool = False  # timed on a busy machine: nothing cached, the default kept unless clearly beaten

    def label(self, value: int) -> str:
        """A value with its meaning where the knob's values are codes (``1 (outer caches)``)."""
        meaning = LABELS.get(self.knob, {}).get(value)
        return f"{value} ({meaning})" if meaning else f"{value}"

    def describe(self) -> str:
        label = self.label
        times = ", ".join(f"{label(v)}: {ms:.2f} ms" for v, ms in sorted(self.ms.items()))
        why = "default kept" if self.choice == self.default else f"{self.ms[self.default] / self.ms[self.choice]:.2f}x"
        if self.busy:
            why = ("default kept: the machine was busy while timing" if self.choice == self.default else
                   f"{why}, clear though the machine was busy while timing: not cached")
        return f"{self.knob} = {label(self.choice)} ({why}; one-token pass with each: {times})"


def tune(knob: str, candidates: tuple[int, ...], default: int, apply: Callable[[int], None],
         time_pass: Callable[[], float], *, key: str, force: bool = False,
         decide_when_busy: bool = True) -> TuneResult:  # fmt: skip
    """Choose ``knob`` among ``candidates`` by timing ``time_pass`` (seconds of one pass) under each, applied
    with ``apply``; from the cache under ``key`` unless ``force``.  The choice is applied before returning.
    ``decide_when_busy=False``: on a busy machine the default holds however clear a win (for a knob whose best
    value depends on the load itself, as the thread count does)."""
    path = cache_dir("native") / f"tuning-{knob}-{key}.json"
    if not force and path.is_file():
        try:
            d = json.loads(path.read_text())
            result = TuneResult(knob, int(d["choice"]), default, {int(k): float(v) for k, v in d["ms"].items()},
                                key, cached=True)  # fmt: skip
            if result.choice in candidates:
                apply(result.choice)
                return result
        except (ValueError, KeyError, TypeError):
            pass  # damaged: time again
    times: dict[int, list[float]] = {c: [] for c in candidates}
    apply(default)
    time_pass()  # warm
    with clock.OtherLoad() as load:  # steady load from elsewhere, which the spread does not show
        for rep in range(REPS):
            order = candidates if rep % 2 == 0 else tuple(reversed(candidates))  # no candidate always first
            for c in order:
                apply(c)
                times[c].append(1000 * time_pass())
    ms = {c: min(ts) for c, ts in times.items()}  # the pass undisturbed: other work only ever adds time
    busy = max(clock.quartile_spread(ts) for ts in times.values()) > clock.BUSY_SPREAD or load.busy
    best = min(ms, key=ms.__getitem__)
    if not busy:
        wins = ms[best] < (1 - KEEP_DEFAULT) * ms[default]
    else:  # a win larger than the load's swing: the fastest and the median passes agree on it
        median = {c: statistics.median(ts) for c, ts in times.items()}
        wins = decide_when_busy and max(ms[best] / ms[default], median[best] / median[default]) < 1 / BUSY_MARGIN
    choice = best if wins else default
    apply(choice)
    result = TuneResult(knob, choice, default, ms, key, busy=busy)
    if not busy:  # a choice made while something else ran is not kept: the next load times again
        atomic_write_text(path, json.dumps({"choice": choice, "ms": {str(k): v for k, v in ms.items()}}) + "\n")
    return result


def forget() -> None:
    """Delete every cached choice, so that the next load times the variants again (``selfspec kernels --force``)."""
    for path in cache_dir("native").glob("tuning-*.json"):
        path.unlink(missing_ok=True)


def tune_model(model, *, force: bool = False) -> list[TuneResult]:
    """Tune every knob that applies to ``model`` (its passes on the native fused stack with int8 products);
    [] when none does."""

    from . import quant

    engine = model.engine
    if not getattr(engine, "fused", False) or not quant.int8_activations():
        return []
    lib = quant.native()
    size_class = int(math.log2(max(1, quant.quantized_bytes(model.hf, read=True)) / 1e6) + 0.5)  # MB, powers of 2
    key = f"{quant.library_path().stem}-w{size_class}"
    timer = _one_token_pass(model)
    results = []
    if quant.int8_kernels_prefetch():  # the x86 vector products prefetch; ARM's and the portable loops do not
        lib.selfspec_set_int8_prefetch(PREFETCH_DEFAULT)  # the hint timed at the default distance
        results.append(tune("int8_prefetch_hint", HINT_CANDIDATES, HINT_DEFAULT, lib.selfspec_set_int8_prefetch_hint,
                            timer, key=key, force=force))  # fmt: skip
        results.append(tune("int8_prefetch", PREFETCH_CANDIDATES, PREFETCH_DEFAULT, lib.selfspec_set_int8_prefetch,
                            timer, key=key, force=force))  # fmt: skip
    threads = native_thread.threads()  # the user's --threads / OMP_NUM_THREADS: the most a pass may use
    lib.selfspec_set_pass_threads(threads)
    if threads > 1:
        candidates = tuple(sorted({1, max(1, threads // 2), threads}))
        results.append(tune("pass_threads", candidates, threads, lib.selfspec_set_pass_threads, timer,
                            key=f"{key}-t{threads}", force=force, decide_when_busy=False))  # fmt: skip
    chosen = results[-1].choice if threads > 1 else 1
    lib.selfspec_set_int8_split(SPLIT_DEFAULT)
    if chosen > 1:  # how the chosen threads share a product
        results.append(tune("int8_split", SPLIT_CANDIDATES, SPLIT_DEFAULT, lib.selfspec_set_int8_split, timer,
                            key=f"{key}-t{chosen}", force=force))  # fmt: skip
    thread_guard.install(lib.selfspec_set_pass_threads, chosen)
    return results


def _one_token_pass(model) -> Callable[[], float]:
    """A timer of one-token passes after a 32-token context (the step decoding repeats)."""
    import torch

    engine, context = model.engine, 32
    cache = engine.new_cache(context + 1)
    vocab = model.adapter.vocab_size
    with torch.inference_mode():
        engine.forward(cache, torch.arange(context, device=engine.device) % vocab, 0)
    cache.commit(context)
    ids = torch.tensor([7 % vocab], device=engine.device)

    def run() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            engine.forward(cache, ids, context, last_only=True)
            return time.perf_counter() - t0

    return run


def as_dicts(results: list[TuneResult]) -> list[dict]:
    return [asdict(r) for r in results]
