"""Command-line interface: ``selfspec generate | bench | search | train-s3d | models``."""

from .main import main

__all__ = ["main"]
