"""Command-line options shared by several commands (``generate``, ``kernels``, ``search``, ``train-s3d``,
``bench``): one definition, so that a new loading option reaches every command that loads a model."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --kernels, --quantize: every command that loads a model (bench included)."""
    p.add_argument("--model", default="smollm2-135m", help="built-in name, HF directory, .gguf file or hub id")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--kernels", default="auto", choices=("auto", "torch"),
                   help="linear kernels: measured fastest on this machine (auto, default) or torch's own")
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "int8", "int4"),
                   help="weights: auto keeps a GGUF's quantised types (default), none dequantises to --dtype, "
                        "int8/int4 quantise the linear layers of any model (weight-only, CPU)")
