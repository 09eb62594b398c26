"""Files the package writes and reads back: atomic writes, versioned JSON, safe tensor loads.

Every state, cache and checkpoint goes through :func:`atomic_write` (a
temporary file in the same directory, then ``os.replace``): a crash mid-write
leaves the old file or none, never half of one.  Readers say which file is
wrong and what to do when it is corrupt or of another format.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .errors import InvalidInputError


def cache_dir(*parts: str) -> Path:
    """A folder of the package's cache: ``$SELFSPEC_CACHE`` (default ``~/.cache/selfspec``) / ``parts``."""
    return Path(os.environ.get("SELFSPEC_CACHE", Path.home() / ".cache" / "selfspec"), *parts)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(f)`` on a temporary file next to ``path``, then move it onto ``path`` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # same directory: os.replace is atomic only within one file system; a unique name: no two writers collide
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_dir(path: str | Path, fill: Callable[[Path], Any]) -> Path:
    """Call ``fill(folder)`` on a fresh folder next to ``path``, then move it onto ``path`` (a crash leaves the
    old folder, or none, never a half-written one under ``path``)."""
    import shutil

    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fill(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.replace(path)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def read_json(path: str | Path, *, what: str) -> Any:
    """Parse ``path`` as JSON; a corrupt file is an :class:`InvalidInputError` naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"{what} {path} is unreadable ({exc}); delete it or pass another") from None


def check_version(data: Any, path: str | Path, *, what: str, version: int, key: str = "version") -> None:
    """A versioned file must be a JSON object with ``key`` == ``version``."""
    found = data.get(key) if isinstance(data, dict) else None
    if found != version:
        raise InvalidInputError(
            f"{what} {path} has format version {found!r}, this selfspec reads version {version}; "
            "delete it or pass another"
        )


def load_tensors(path: str | Path, *, what: str) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and plain containers only; no code runs)."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file; all mean the same here
        raise InvalidInputError(f"{what} {path} cannot be loaded ({type(exc).__name__}: {exc})") from None
