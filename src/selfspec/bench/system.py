"""The machine a benchmark ran on, and the peak-memory probe.

Peak memory is the process's resident-set high-water mark (Linux ``VmHWM``)
during one generation call.  Before each call the mark is reset to the current
RSS by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), so the value
read afterwards is the highest RSS reached *during that call*.  It is
process-wide: model weights, the KV cache, activations, the Python heap, and
memory the allocator kept from earlier calls.  ``delta`` is that peak minus the
RSS at the start of the call: the extra memory the call made resident (an
underestimate when the allocator reuses memory freed by an earlier call).
PyTorch CPU tensors are invisible to ``tracemalloc``, hence RSS.

Where the reset is impossible (macOS, restricted /proc) the probe falls back to
``resource.getrusage`` 's ``ru_maxrss``: the peak since the process started,
with no per-call delta.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import sys
from dataclasses import dataclass
from typing import Any

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class MemorySample:
    peak_mb: float
    delta_mb: float | None


class PeakMemory:
    """``start()`` before a call and ``stop()`` after it give that call's peak RSS."""

    def __init__(self) -> None:
        self.resettable = _status_kb("VmHWM") is not None and _reset_hwm()
        self.method = "VmHWM reset per call" if self.resettable else "ru_maxrss since process start"
        self._rss0: int | None = None

    def start(self) -> None:
        if self.resettable:
            _reset_hwm()
            self._rss0 = _status_kb("VmRSS")

    def stop(self) -> MemorySample:
        if self.resettable:
            hwm = _status_kb("VmHWM") or 0
            delta = None if self._rss0 is None else max(0, hwm - self._rss0) / 1024
            return MemorySample(hwm / 1024, delta)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return MemorySample(peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024, None)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
