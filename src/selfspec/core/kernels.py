"""The kernel layer: the linear products of decoding, computed the fastest correct way on this machine.

Matrix products are nearly all of a decoding step (88% of a one-token pass on
our 2-core CPU), and the right way to compute a product with 1..16 rows (one
token, a draft chain, a verification tree) depends on the machine, the dtype
and the row count.  Measured on an AMD EPYC (Zen 5, 2 cores), one pass over
all 211 linear layers of SmolLM2-135M (538 MB fp32, weights streamed from
memory), ms::

    rows                       1     2     4     8    16    64
    torch F.linear (MKL)      32    50    47    43    55   113
    W @ x.T (MKL)             35    15    17    34    45   103
    oneDNN, packed weights    15    15    14    17    20    48
    OpenBLAS (numpy)          13    37    37    31    40    91

This module holds the candidates (:data:`KERNELS`), one :class:`KernelLinear`
per linear layer that computes with whichever kernel the :class:`KernelPlan`
names for its dtype and row count, and the scoped switches of draft passes
(:func:`draft_precision`, :func:`draft_adapters`).  Which kernel wins is
measured per machine and model by :mod:`selfspec.core.kernel_plan` (``selfspec
kernels`` prints the report).

Rules that keep it correct:

* The user's model is never modified: an adapter builds *shadow* copies of
  the decoder layers and the LM head (:func:`shadow`) whose linear layers are
  :class:`KernelLinear` sharing the original parameters.  ``model.generate``
  on the user's model stays stock transformers.
* Verification and vanilla decoding compute in the model's own dtype; only
  draft passes may use a cheaper copy (``draft_precision``), which the full
  model then verifies.
* Kernels with a thread pool of their own (OpenBLAS through numpy) are
  measured for the report but never chosen: two pools at full width on the
  same cores make each spin while the other works (measured: a T=1 OpenBLAS
  pass alternating with a T=4 MKL pass took 88 ms where the two alone took
  13 + 31).  Every chosen kernel runs on torch's own pool.
* Prepared weights (a packed or low-precision copy) are made on first use,
  refreshed when the weight changes in place, and only for the kernels the
  plan uses; :func:`prepared_bytes` reports what they cost.
* Under autograd (S3D's training) the plain ``F.linear`` path runs, so
  gradients flow exactly as in torch.
* CPU-only kernels never run on another device: on CUDA or MPS every product
  is ``F.linear``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The dtype draft passes compute their linear layers in (None: the model's own).  A context variable, set
# only for the duration of one forward call by :func:`draft_precision`, never left switched on.
_DRAFT_DTYPE: ContextVar[torch.dtype | None] = ContextVar("selfspec_draft_dtype", default=None)
# Low-rank adapters active only while drafting (S3D): module -> (A [r, in], B [out, r], scale); None: off.
_DRAFT_ADAPTERS: ContextVar[dict | None] = ContextVar("selfspec_draft_adapters", default=None)

PACK_ROWS = 16  # the row count oneDNN lays packed weights out for; measured as good as per-row packing for 1..64


@contextlib.contextmanager
def draft_precision(dtype: torch.dtype | None) -> Iterator[None]:
    """Linear layers of :class:`KernelLinear` compute in ``dtype`` within this block (None: unchanged)."""
    token = _DRAFT_DTYPE.set(dtype)
    try:
        yield
    finally:
        _DRAFT_DTYPE.reset(token)


@contextlib.contextmanager
def draft_adapters(adapters: dict | None) -> Iterator[None]:
    """Within this block, each :class:`KernelLinear` in ``adapters`` adds its low-rank update
    ``scale * B(A x)``; outside it the model is untouched (so verification stays the full model)."""
    token = _DRAFT_ADAPTERS.set(adapters)
    try:
        yield
    finally:
        _DRAFT_ADAPTERS.reset(token)


def active_draft_precision() -> torch.dtype | None:
    """The dtype draft passes compute in now (None outside :func:`draft_precision`)."""
    return _DRAFT_DTYPE.get()


def active_draft_adapters() -> dict | None:
    """The low-rank draft adapters switched on now (None outside :func:`draft_adapters`)."""
    return _DRAFT_ADAPTERS.get()


# -- the candidates ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """One way to compute ``x @ W.T + b`` for a 2-D ``x`` ``[rows, in]``."""

    name: str
    description: str
    own_pool: bool = False  # runs on a thread pool other than torch's (measured for the report, never chosen)

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this kernel cannot run for ``device``/``dtype`` (None: it can)."""
        return None

    def prepare(self, weight: torch.Tensor, dtype: torch.dtype) -> Any:
        """The weight in the form :meth:`run` takes (made once per weight version)."""
        return weight.detach() if weight.dtype == dtype else weight.detach().to(dtype)

    def run(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, prepared, bias)


class _Transposed(Kernel):
    def unavailable(self, device, dtype):
        return None if device.type == "cpu" else "CPU only"

    def run(self, x, prepared, bias):
        y = torch.mm(prepared, x.T).T  # [rows, out]: BLAS streams W once with a thin right-hand side
        # contiguous like every other kernel's output: a reduction over a strided last dimension (Qwen 3's q/k
        # norms) may sum in another order, so a transposed view would change bits downstream
        return y.contiguous() if bias is None else y + bias


class _OneDNN(Kernel):
    def unavailable(self, device, dtype):
        if device.type != "cpu":
            return "CPU only"
        if not torch.backends.mkldnn.is_available():
            return "torch built without oneDNN"
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "this CPU has no bfloat16 support in oneDNN"
        if dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return "this CPU has no float16 support in oneDNN (needs AVX512-FP16 or AVX-NE-CONVERT)"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"no oneDNN linear for {dtype}"
        return None

    def prepare(self, weight, dtype):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), PACK_ROWS)

    def run(self, x, prepared, bias):
        return torch.ops.mkldnn._linear_pointwise(x, prepared, bias, "none", [], "")


class _OpenBLAS(Kernel):
    def unavailable(self, device, dtype):
        if device.type != "cpu" or dtype != torch.float32:
            return "CPU float32 only"
        return None

    def prepare(self, weight, dtype):
        return weight.detach().numpy()

    def run(self, x, prepared, bias):
        y = torch.from_numpy(x.numpy() @ prepared.T)
        return y if bias is None else y + bias


TORCH = Kernel("torch", "torch's F.linear (MKL on x86 CPUs, cuBLAS on CUDA)")
KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        TORCH,
        _Transposed("transposed", "(W @ x.T).T through torch's BLAS: W streamed once with a thin right side"),
        _OneDNN("onednn", f"oneDNN through torch, weights packed once for {PACK_ROWS} rows"),
        _OpenBLAS("openblas", "numpy's OpenBLAS (reference only: its own thread pool)", own_pool=True),
    )
}


# -- the plan ----------------------------------------------------------------------------------------------------


class KernelPlan:
    """Which kernel computes a product of ``rows`` rows in ``dtype``: ``choices[dtype] = [(max_rows, name)]``
    in increasing ``max_rows``; rows past the last bound take the last kernel.  Dtypes not listed use torch's."""

    _LOOKUP = 257  # row counts up to this are looked up in a table; larger ones scan the bounds

    def __init__(self, choices: dict[torch.dtype, list[tuple[int, str]]] | None = None) -> None:
        self.choices = {dt: sorted(c) for dt, c in (choices or {}).items()}
        self._lookup: dict[torch.dtype, list[Kernel]] = {}
        for dt, bounds in self.choices.items():
            table: list[Kernel] = []
            for max_rows, name in bounds:
                table.extend([KERNELS[name]] * max(0, min(max_rows + 1, self._LOOKUP) - len(table)))
            self._lookup[dt] = table

    def kernel(self, dtype: torch.dtype, rows: int) -> Kernel:
        table = self._lookup.get(dtype)
        if not table:
            return TORCH
        if rows < len(table):
            return table[rows]
        bounds = self.choices[dtype]
        return KERNELS[next((name for max_rows, name in bounds if rows <= max_rows), bounds[-1][1])]

    def names(self) -> set[str]:
        return {name for bounds in self.choices.values() for _, name in bounds}

    def __repr__(self) -> str:
        return f"KernelPlan({self.choices})"


TORCH_ONLY = KernelPlan()


class KernelLinear(nn.Module):
    """A linear layer sharing an ``nn.Linear``'s parameters, computing with the plan's kernel."""

    def __init__(self, linear: nn.Linear, plan: KernelPlan) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: no copy, and in-place changes are seen
        self.bias = linear.bias
        self.plan = plan
        self._prepared: dict[tuple[str, torch.dtype], tuple[int, Any, torch.Tensor | None]] = {}

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
        dtype = low or self.weight.dtype
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            if dtype == self.weight.dtype:  # training passes: exactly torch's linear, gradients included
                return F.linear(x, self.weight, self.bias)
            return F.linear(x.to(dtype), self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype)).to(
                x.dtype
            )
        rows = x.numel() // x.shape[-1]
        kernel = self.plan.kernel(dtype, rows) if x.device.type == "cpu" else TORCH
        if kernel is TORCH and x.dtype == dtype == self.weight.dtype:
            # torch's own linear on the weight as it is: what prepared() would hand over, without the lookups
            # (a small model's step makes hundreds of these calls; their Python costs add up)
            y = F.linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        w, b = self.prepared(kernel, dtype)
        y = kernel.run(x.reshape(rows, x.shape[-1]).to(dtype), w, b)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def prepared(self, kernel: Kernel, dtype: torch.dtype) -> tuple[Any, torch.Tensor | None]:
        """The weight (and bias) in ``kernel``'s form and ``dtype``, made on first use and when the weight changed."""
        version = self.weight._version
        cached = self._prepared.get((kernel.name, dtype))
        if cached is None or cached[0] != version:
            bias = None if self.bias is None else self.bias.detach().to(dtype)
            cached = self._prepared[(kernel.name, dtype)] = (version, kernel.prepare(self.weight, dtype), bias)
        return cached[1], cached[2]

    def release(self, keep: set[tuple[str, torch.dtype]] | None = None, *, dtypes: set | None = None) -> None:
        """Drop prepared copies: all, or all but the (kernel, dtype) pairs in ``keep`` and the dtypes in
        ``dtypes``."""
        for key in list(self._prepared):
            if (keep is None or key not in keep) and (dtypes is None or key[1] not in dtypes):
                del self._prepared[key]

    def prepared_bytes(self) -> int:
        """Bytes held by prepared copies that are not the weight itself."""
        total = 0
        for _, w, b in self._prepared.values():
            if isinstance(w, torch.Tensor) and not w.is_mkldnn and w.data_ptr() == self.weight.data_ptr():
                continue
            shares_bias = b is None or (self.bias is not None and b.data_ptr() == self.bias.data_ptr())
            total += _nbytes(w) + (0 if shares_bias else _nbytes(b))
        return total

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        if t.is_mkldnn:  # opaque layout: count the logical elements
            return t.numel() * t.element_size()
        return t.untyped_storage().nbytes()
    return int(getattr(t, "nbytes", 0))


# -- shadow modules ------------------------------------------------------------------------------------------------


def shadow(module: nn.Module, plan: KernelPlan, *, config: Any = None) -> nn.Module:
    """A copy of ``module`` whose ``nn.Linear`` leaves are :class:`KernelLinear` and whose other submodules are
    shallow copies sharing their parameters and buffers; ``module`` itself is left untouched.  Submodules with
    a ``config`` attribute get ``config`` instead when it is given (the adapter's own copy)."""
    if isinstance(module, nn.Linear) and type(module) is nn.Linear:  # never quantised or LoRA subclasses
        return KernelLinear(module, plan)
    new = copy.copy(module)
    new.__dict__["_parameters"] = dict(module._parameters)
    new.__dict__["_buffers"] = dict(module._buffers)
    new.__dict__["_modules"] = {name: None if child is None else shadow(child, plan, config=config)
                                for name, child in module._modules.items()}  # fmt: skip
    if config is not None and "config" in new.__dict__:
        new.__dict__["config"] = config
    return new


def kernel_linears(module: nn.Module) -> list[KernelLinear]:
    return [m for m in module.modules() if isinstance(m, KernelLinear)]


def set_plan(modules: list[KernelLinear], plan: KernelPlan, *, release: bool = True) -> None:
    """Use ``plan`` from now on; prepared copies the new plan does not use are dropped (unless ``release`` is
    False: while plans are being timed against each other, so that no pass pays for re-preparing)."""
    for m in modules:
        m.plan = plan
        if not release:
            continue
        # the model dtype's copies stay; draft copies are made when a draft first runs (only what a method uses)
        keep = {(k, dt) for dt, bounds in plan.choices.items() for _, k in bounds if dt == m.weight.dtype}
        m.release(keep | {(TORCH.name, m.weight.dtype)})


def prepared_bytes(modules: list[KernelLinear]) -> int:
    """Extra memory of all prepared copies (packed and low-precision weights) of ``modules``."""
    return sum(m.prepared_bytes() for m in modules)
