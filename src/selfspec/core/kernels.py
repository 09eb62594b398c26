"""A faster linear layer for the few-token forwards of speculative decoding on CPU.

On our 2-core CPU, ``F.linear(x, W)`` with 2..16 rows of ``x`` costs up to 2x
a single-row call: the BLAS kernel behind ``x @ W.T`` handles small row counts
poorly.  Computing ``(W @ x.T).T`` instead lets BLAS stream ``W`` once with a
tiny right-hand side.  Measured over all 211 linear layers of SmolLM2-135M
(ms, median of 7, 2 threads)::

    rows          1    2    3    4    6    8   12   16
    F.linear     50   92  119   82   94   95  110  121
    W @ x.T      49   41   55   41   72   76   97   83

and for a whole forward pass (ms, median of 5)::

    tokens        1    2    4    6    8   12
    F.linear     77  128  142  143  146  163
    W @ x.T      76   96  101  143  135  171

:func:`install` swaps every ``nn.Linear`` of a model for :class:`SmallBatchLinear`,
sharing the weights; results agree with ``F.linear`` to float rounding.
Single rows (vanilla decoding, drafting) and long inputs (prefill) keep
``F.linear``, so vanilla decoding keeps transformers' exact numerics; GPUs keep
``F.linear`` throughout.  Re-measure with ``python -m selfspec.kernels``.

**Low-precision drafting.**  Inside :func:`draft_precision`, every
:class:`SmallBatchLinear` computes with a half-precision copy of its weight
(made once, kept beside the module, refreshed if the weight is changed in
place).  A draft pass is only a guess that the full model verifies, so its
numerics may differ; what matters is cost.  On our CPU an fp16 product with
one row costs a fifth of the fp32 one (73 vs 362 us for a 1536x576 weight),
and the matrix products are 80% of a pass: a draft pass with fp16 weights
costs about 30 ms instead of 78, and agrees with the fp32 model on nearly every
token (SmolLM2: acceptance 0.94-1.0).  :mod:`selfspec.costs` measures whether
this holds on the machine at hand before a method uses it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

# The dtype draft passes compute their linear layers in (None: the model's own).  A context variable, set
# only for the duration of one forward call by :func:`draft_precision`, never left switched on.
_DRAFT_DTYPE: ContextVar[torch.dtype | None] = ContextVar("selfspec_draft_dtype", default=None)
_LOW_PRECISION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {dtype: (version, w, b)}
# Low-rank adapters active only while drafting (S3D): module -> (A [r, in], B [out, r], scale); None: off.
_DRAFT_ADAPTERS: ContextVar[dict | None] = ContextVar("selfspec_draft_adapters", default=None)


@contextlib.contextmanager
def draft_precision(dtype: torch.dtype | None) -> Iterator[None]:
    """Linear layers of :class:`SmallBatchLinear` compute in ``dtype`` within this block (None: unchanged)."""
    token = _DRAFT_DTYPE.set(dtype)
    try:
        yield
    finally:
        _DRAFT_DTYPE.reset(token)


@contextlib.contextmanager
def draft_adapters(adapters: dict | None) -> Iterator[None]:
    """Within this block, each :class:`SmallBatchLinear` in ``adapters`` adds its low-rank update
    ``scale * B(A x)``; outside it the model is untouched (so verification stays the full model)."""
    token = _DRAFT_ADAPTERS.set(adapters)
    try:
        yield
    finally:
        _DRAFT_ADAPTERS.reset(token)


def _low_precision_weights(module: nn.Linear, dtype: torch.dtype):
    version = module.weight._version
    copies = _LOW_PRECISION.setdefault(module, {})
    cached = copies.get(dtype)
    if cached is None or cached[0] != version:
        w = module.weight.detach().to(dtype)
        b = module.bias.detach().to(dtype) if module.bias is not None else None
        cached = copies[dtype] = (version, w, b)
    return cached[1], cached[2]

MIN_ROWS, MAX_ROWS = 2, 16  # measured range where W @ x.T wins; elsewhere F.linear


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` computing few-row products as ``W @ x.T`` on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapters = _DRAFT_ADAPTERS.get()
        y = self._base(x)
        if adapters is not None:
            lora = adapters.get(self)
            if lora is not None:
                a, b, scale = lora
                y = y + scale * F.linear(F.linear(x.to(a.dtype), a), b).to(y.dtype)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        low = _DRAFT_DTYPE.get()
        if low is not None and low != self.weight.dtype:
            w, b = _low_precision_weights(self, low)
            return F.linear(x.to(low), w, b).to(x.dtype)
        rows = x.numel() // x.shape[-1]
        if not MIN_ROWS <= rows <= MAX_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def install(model: nn.Module) -> int:
    """Use :class:`SmallBatchLinear` for every plain ``nn.Linear`` of ``model``; returns how many."""
    return _swap(model, nn.Linear, SmallBatchLinear)


def uninstall(model: nn.Module) -> int:
    """Back to plain ``nn.Linear`` (e.g. to time transformers as users run it)."""
    return _swap(model, SmallBatchLinear, nn.Linear)


def _swap(model: nn.Module, old: type, new: type) -> int:
    n = 0
    for module in model.modules():
        if type(module) is old:  # exact type: never touch quantised or LoRA subclasses
            module.__class__ = new  # same parameters, same state dict; only forward changes
            n += 1
    return n


def _measure() -> None:  # pragma: no cover - a manual tool
    import statistics
    import time

    # TODO(arch): an upward import (core -> model) that closes a cycle; move this manual tool to bench/.
    from ..model.models import load

    model = load()
    weights = [m.weight.detach() for m in model.hf.modules() if isinstance(m, nn.Linear)]
    print(f"{len(weights)} linear layers; ms per pass over all of them (median of 5)")
    for rows in (1, 2, 3, 4, 6, 8, 12, 16):
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        times: dict[str, list[float]] = {"F.linear": [], "W @ x.T": []}
        with torch.inference_mode():
            for _ in range(5):
                for name in times:
                    t = time.perf_counter()
                    for w, x in zip(weights, xs, strict=True):
                        if name == "F.linear":
                            F.linear(x, w)
                        else:
                            torch.mm(w, x.T)
                    times[name].append(1000 * (time.perf_counter() - t))
        print(f"rows {rows:2d}: " + "  ".join(f"{k} {statistics.median(v):6.1f}" for k, v in times.items()))


if __name__ == "__main__":  # pragma: no cover
    _measure()
