"""Choosing the kernels of :mod:`selfspec.core.kernels` for this machine and model, by measuring them.

Run ``selfspec kernels [--model M] [--force]`` for the report: per dtype and
row count, what one forward pass of the model over that many new tokens
costs with each candidate kernel computing every linear product, in ms and
in GB/s of weights read, the machine's measured read bandwidth, the
weight-read bound of one decoding step, and which kernel was chosen.

How: each candidate is timed inside whole forward passes on a warm cache (the
model layer hands in the pass as a timer; this module knows no engine), not
on the products alone -- back to back, a BLAS's threads stay awake that in a
real pass fall asleep between products.  Every candidate is timed at the row
counts of :data:`GRID` (the model's dtype: decoding, verification, prefill)
or :data:`DRAFT_GRID` (cheaper draft copies); the lowest time wins, torch's
own kernel unless another is at least :data:`MARGIN` faster.  The plan and
the report are cached as JSON under ``$SELFSPEC_CACHE/kernels``, keyed by the
CPU, core and thread count, torch and its BLAS build, the device and the
model's weight shapes; a damaged or stale file is reported in one line and
measured again.  Choosing takes seconds once per machine and model, at load
time, never inside a timed run.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..io import atomic_write_text, cache_dir
from . import native_thread
from .kernels import KERNELS, TORCH, KernelLinear, KernelPlan

PLAN_VERSION = 2
GRID = (1, 2, 4, 8, 16, 64)  # rows measured in the model's dtype (decoding, verification, prefill chunks)
DRAFT_GRID = (1, 2, 4, 8, 16, 32)  # rows measured for draft precisions (chains, trees, SWIFT's scoring pass)
DRAFT_DTYPES = (torch.float16, torch.bfloat16)
MARGIN = 0.05  # another kernel replaces torch's only when at least this much faster (timing noise)
REPS = 3

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class KernelReport:
    """What was measured and chosen; ``ms[dtype][kernel][rows]`` is one forward pass over ``rows`` new tokens."""

    key: str
    machine: dict[str, Any]
    device: str
    model_dtype: str
    weight_bytes: int  # the linear weights in the model's dtype (what one decoding step must read)
    bandwidth_gbs: float  # measured memory read bandwidth
    ms: dict[str, dict[str, dict[int, float]]]
    unavailable: dict[str, dict[str, str]]
    choices: dict[str, list[tuple[int, str]]]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def bound_ms(self) -> float:
        """The weight-read bound of one decoding step: its linear weights read once at the measured bandwidth."""
        return self.weight_bytes / (self.bandwidth_gbs * 1e6) if self.bandwidth_gbs > 0 else float("nan")

    def plan(self) -> KernelPlan:
        return KernelPlan({_DTYPES[name]: [tuple(b) for b in bounds] for name, bounds in self.choices.items()})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = PLAN_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelReport:
        d = dict(d)
        if d.pop("version", None) != PLAN_VERSION:
            raise ValueError(f"format version is not {PLAN_VERSION}")
        d["ms"] = {dt: {k: {int(r): float(v) for r, v in rows.items()} for k, rows in ks.items()}
                   for dt, ks in d["ms"].items()}  # fmt: skip
        d["choices"] = {dt: [(int(r), str(k)) for r, k in bounds] for dt, bounds in d["choices"].items()}
        for bounds in d["choices"].values():
            for _, name in bounds:
                if name not in KERNELS or KERNELS[name].own_pool:
                    raise ValueError(f"unknown kernel {name!r}")
        return cls(**d)


_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


# -- keys and the cache ----------------------------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    """What a measured plan depends on besides the model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    build = hashlib.sha1(torch.__config__.show().encode()).hexdigest()[:10]
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": native_thread.threads(), "torch": torch.__version__,
            "torch_build": build}  # fmt: skip


def plan_key(linears: list[KernelLinear], device: torch.device) -> str:
    shapes: dict[str, int] = {}
    for m in linears:
        k = f"{m.out_features}x{m.in_features}{'b' if m.bias is not None else ''}"
        shapes[k] = shapes.get(k, 0) + 1
    dtype = DTYPE_NAMES.get(linears[0].weight.dtype, str(linears[0].weight.dtype)) if linears else "none"
    text = json.dumps([machine_facts(), str(device), dtype, sorted(shapes.items())])
    return f"{device.type}-{dtype}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def _cache_dir() -> Path:
    return cache_dir("kernels")


_MEMORY: dict[str, KernelReport] = {}


def choose_plan(linears: list[KernelLinear], device: torch.device, timer: PassTimer | None = None, *,
                force: bool = False, cache: bool = True, quiet: bool = False) -> KernelReport:  # fmt: skip
    """The kernel report (with its plan) for these linear layers: from memory, the disk cache, or measured now."""
    if device.type != "cpu" or not linears or timer is None:
        return torch_only(linears, device, "kernels are chosen on CPU only; elsewhere torch's own run")
    key = plan_key(linears, device)
    if not force and key in _MEMORY:
        return _MEMORY[key]
    path = _cache_dir() / f"{key}.json"
    report = None
    if cache and not force and path.exists():
        try:
            report = KernelReport.from_dict(json.loads(path.read_text()))
            if report.key != key:
                raise ValueError("made for another machine or model")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"selfspec: kernel cache {path} is unusable ({str(exc)[:120]}); measuring again", file=sys.stderr)
            report = None
    if report is None:
        if not quiet:
            print("selfspec: measuring kernels for this machine and model (once, a few seconds)...", file=sys.stderr)
            busy = _busy()
            if busy:
                print(f"selfspec: {busy}; timings may be off: rerun `selfspec kernels --force` when it is idle",
                      file=sys.stderr)
        report = measure(linears, device, timer, key=key)
        if cache:
            atomic_write_text(path, json.dumps(report.to_dict(), indent=1) + "\n")
    _MEMORY[key] = report
    return report


def _busy() -> str:
    """A sentence when other processes keep the cores busy (kernel timings then mislead), else ''."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    cores = os.cpu_count() or 1
    return f"the machine is busy (load {load:.1f} on {cores} cores)" if load > cores - 0.5 else ""


def forget_cached_plans() -> None:
    """Delete every cached plan (memory and disk), so that the next load measures again."""
    _MEMORY.clear()
    for path in _cache_dir().glob("*.json"):
        path.unlink(missing_ok=True)


def torch_only(linears: list[KernelLinear], device: torch.device, note: str) -> KernelReport:
    dtype = linears[0].weight.dtype if linears else torch.float32
    return KernelReport(key="torch-only", machine=machine_facts(), device=str(device),
                        model_dtype=DTYPE_NAMES.get(dtype, str(dtype)), weight_bytes=_weight_bytes(linears),
                        bandwidth_gbs=0.0, ms={}, unavailable={}, choices={}, notes=[note])  # fmt: skip


def _weight_bytes(linears: list[KernelLinear]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


# -- measuring -----------------------------------------------------------------------------------------------------


PassTimer = Callable[[KernelPlan, int, torch.dtype], float]  # (plan, rows, dtype) -> ms of one full forward pass


@torch.inference_mode()
def measure(linears: list[KernelLinear], device: torch.device, timer: PassTimer, *, key: str = "") -> KernelReport:
    """Time every candidate kernel at every grid row count and choose per dtype (see the module docstring).

    ``timer`` runs one whole forward pass of the model over ``rows`` new tokens with the given plan (and, for
    a draft dtype, draft precision) and returns its ms: a kernel is judged inside a real pass, where the other
    operations between its products decide, for instance, whether a BLAS's threads are still awake (measured:
    MKL's 2-row products cost 16 ms per pass over the weights back to back, 36 ms inside real passes)."""
    t_start = time.perf_counter()
    model_dtype = linears[0].weight.dtype
    dtypes = [model_dtype] + [d for d in DRAFT_DTYPES if d != model_dtype and model_dtype == torch.float32]
    ms: dict[str, dict[str, dict[int, float]]] = {}
    unavailable: dict[str, dict[str, str]] = {}
    choices: dict[str, list[tuple[int, str]]] = {}
    for dtype in dtypes:
        name = DTYPE_NAMES[dtype]
        grid = GRID if dtype == model_dtype else DRAFT_GRID
        usable, unavailable[name] = [], {}
        for kernel in KERNELS.values():
            why = kernel.unavailable(device, dtype)
            if why is None:
                try:  # a build or CPU may lack it after all: try it once on a small product
                    w = kernel.prepare(linears[0].weight[:8], dtype)
                    kernel.run(torch.zeros(2, linears[0].in_features, dtype=dtype), w, None)
                    usable.append(kernel)
                except (RuntimeError, NotImplementedError) as exc:
                    why = f"failed: {str(exc).splitlines()[0][:120]}"
            if why is not None:
                unavailable[name][kernel.name] = why
        # kernels with a pool of their own last and apart: their spinning threads would slow whatever ran next
        ms[name] = _time_kernels([k for k in usable if not k.own_pool], dtype, grid, timer)
        ms[name].update(_time_kernels([k for k in usable if k.own_pool], dtype, grid[:1], timer))  # reference
        choices[name] = _choose(ms[name], grid)
    return KernelReport(key=key, machine=machine_facts(), device=str(device),
                        model_dtype=DTYPE_NAMES.get(model_dtype, str(model_dtype)),
                        weight_bytes=_weight_bytes(linears), bandwidth_gbs=read_bandwidth_gbs(), ms=ms,
                        unavailable=unavailable, choices=choices, seconds=time.perf_counter() - t_start)  # fmt: skip


def _time_kernels(kernels: list, dtype: torch.dtype, grid, timer: PassTimer) -> dict[str, dict[int, float]]:
    """ms of one forward pass per kernel and row count: the best of REPS passes, the kernels interleaved (in a
    shuffled order each round) so that drift of a shared machine hits them alike."""
    order = random.Random(0)
    plans = {k.name: KernelPlan({dtype: [(1 << 30, k.name)]}) for k in kernels}
    best: dict[str, dict[int, float]] = {k.name: {} for k in kernels}
    for rows in grid:
        for rep in range(REPS + 1):  # the first round warms up (first-call set-up, prepared copies made)
            for kernel in order.sample(kernels, len(kernels)):
                ms = timer(plans[kernel.name], rows, dtype)
                if rep:
                    best[kernel.name][rows] = min(ms, best[kernel.name].get(rows, float("inf")))
    return best


def _choose(ms: dict[str, dict[int, float]], grid) -> list[tuple[int, str]]:
    """Per grid point the fastest eligible kernel (torch's unless another beats it by MARGIN); a row count
    between grid points takes the nearer point's choice.  Consecutive equal choices are merged."""
    picks = []
    for rows in grid:
        best = TORCH.name if TORCH.name in ms else None
        for name, table in ms.items():
            if KERNELS[name].own_pool or name == best:
                continue
            if best is None or table[rows] < (1 - MARGIN) * ms[best][rows]:
                best = name
        picks.append(best or TORCH.name)
    bounds: list[tuple[int, str]] = []
    for i, (rows, name) in enumerate(zip(grid, picks, strict=True)):
        upper = (rows + grid[i + 1]) // 2 if i + 1 < len(grid) else 1 << 30
        if bounds and bounds[-1][1] == name:
            bounds[-1] = (upper, name)
        else:
            bounds.append((upper, name))
    return bounds


def read_bandwidth_gbs(megabytes: int = 256, reps: int = 5) -> float:
    """Memory read bandwidth: the best of ``reps`` sums over a buffer far larger than the caches."""
    buf = torch.ones(megabytes << 18)  # float32: megabytes MB
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


# -- the report ----------------------------------------------------------------------------------------------------


def format_report(report: KernelReport, step_ms: float | None = None) -> str:
    """A plain-text report (the README shows one)."""
    lines = [
        f"machine: {report.machine.get('cpu')}, {report.machine.get('cores')} cores, "
        f"{report.machine.get('threads')} torch threads, torch {report.machine.get('torch')}; device {report.device}",
    ]
    lines += report.notes
    if report.bandwidth_gbs:
        lines.append(
            f"memory read bandwidth {report.bandwidth_gbs:.1f} GB/s; linear weights {report.weight_bytes / 1e6:.0f} MB "
            f"({report.model_dtype}): weight-read bound of one decoding step {report.bound_ms:.1f} ms"
        )
    if step_ms is not None:
        lines.append(f"measured one-token decoding step: {step_ms:.1f} ms ({step_ms / report.bound_ms:.2f}x the bound)")
    for dtype, kernels in report.ms.items():
        grid = sorted({r for t in kernels.values() for r in t})
        chosen = dict(report.choices.get(dtype, []))
        lines.append("")
        role = "verification and vanilla decoding" if dtype == report.model_dtype else "draft passes only"
        lines.append(f"{dtype} ({role}): ms per forward pass over T new tokens (GB/s of weights); * = chosen")
        lines.append(f"  {'kernel':<10}" + "".join(f"{'T=' + str(r):>16}" for r in grid))
        for name, table in kernels.items():
            cells = []
            for r in grid:
                if r not in table:
                    cells.append("-")
                    continue
                mark = "*" if _chosen_at(chosen, r) == name else " "
                bytes_ = report.weight_bytes * (0.5 if dtype != report.model_dtype else 1.0)
                cells.append(f"{table[r]:7.1f} ({bytes_ / table[r] / 1e6:4.0f}){mark}")
            note = "  (own thread pool: not chosen)" if KERNELS[name].own_pool else ""
            lines.append(f"  {name:<10}" + "".join(f"{c:>16}" for c in cells) + note)
        for name, why in report.unavailable.get(dtype, {}).items():
            lines.append(f"  {name:<10} not available: {why}")
    if report.seconds:
        lines.append(f"\nmeasured in {report.seconds:.1f} s; cached under {_cache_dir()}")
    return "\n".join(lines)


def _chosen_at(bounds: dict[int, str], rows: int) -> str | None:
    for upper in sorted(bounds):
        if rows <= upper:
            return bounds[upper]
    return None
