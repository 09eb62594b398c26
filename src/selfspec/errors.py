"""User-facing errors.

Every problem a user can cause (bad model name, empty prompt, invalid option,
unsupported architecture, prompt longer than the context) raises a subclass of
:class:`SelfspecError` with a one-line message.  The CLI prints that message
and exits with status 2 instead of showing a traceback.
"""

from __future__ import annotations


class SelfspecError(Exception):
    """Base class of all errors that are the user's to fix."""


class ModelNotFoundError(SelfspecError):
    """The model name is neither built in, nor a local path, nor reachable on the hub."""


class UnsupportedModelError(SelfspecError):
    """The model's architecture has no adapter."""


class InvalidInputError(SelfspecError):
    """A prompt or an option value is not acceptable."""


class ExternalToolError(SelfspecError):
    """An outside program the user pointed us at (llama.cpp's tools, for comparisons) failed to run."""
