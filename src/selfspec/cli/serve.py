"""``selfspec serve``: the OpenAI-compatible server (see :mod:`selfspec.server`)."""

from __future__ import annotations

import argparse
import sys

from ..core.prefix_store import DEFAULT_MB
from ..errors import InvalidInputError
from .args import add_model_args, load_model


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (chat and text completions, streaming) with a playground page at /",
        description="Serve one model over OpenAI's HTTP API: POST /v1/chat/completions and /v1/completions "
        "(stream or not), GET /v1/models, /health, /metrics (Prometheus) and a chat playground at /. Requests are "
        "taken in arrival order from a bounded queue; up to --parallel of them decode together, their rounds "
        "verified in one batched pass (each request's output is the one it gets alone).",
    )
    add_model_args(p)
    p.add_argument("--method", default="auto", help="default method of requests (auto)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--state", help="JSON file holding what the methods learn (SWIFT's skip sets): loaded at start, "
                   "saved after each request and at shutdown")  # fmt: skip
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes")
    p.add_argument("--queue-size", type=int, default=8, help="requests waiting at most; more get 429 (8)")
    p.add_argument("--parallel", type=int, default=None,
                   help="requests decoded together (1..16; default: 4, 2 or 1, the most whose batched pass costs "
                   "at most 1.5x a one-row pass on this machine, from the measured costs)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=2048, help="most new tokens a request may ask for (2048)")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_MB,
                   help=f"memory bound of the prefix cache, in MB ({DEFAULT_MB}; 0: off): the keys and values of "
                   "recent requests, so that a request extending one (a chat's next turn) prefills only its new "
                   "tokens, with the same output")  # fmt: skip
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cost.costs import cost_profile
    from ..methods import METHODS
    from ..server.app import Limits, allowed_methods, create_app
    from ..server.worker import MAX_PARALLEL, Worker, default_parallel

    if args.method not in METHODS:
        raise InvalidInputError(f"unknown method '{args.method}'; choose one of {', '.join(METHODS)}")
    if not 1 <= args.port <= 65535:
        raise InvalidInputError(f"--port must be in 1..65535, got {args.port}")
    if args.queue_size < 1 or args.max_tokens < 1:
        raise InvalidInputError("--queue-size and --max-tokens must be at least 1")
    if args.prefix_cache_mb < 0:
        raise InvalidInputError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb:g}")
    if args.parallel is not None and not 1 <= args.parallel <= MAX_PARALLEL:
        raise InvalidInputError(f"--parallel must be in 1..{MAX_PARALLEL}, got {args.parallel}")
    model = load_model(args)
    parallel = args.parallel or default_parallel(cost_profile(model))
    worker = Worker(model, args.method, allowed=allowed_methods(args.method), queue_size=args.queue_size,
                    state_path=args.state, prefix_cache_mb=args.prefix_cache_mb, parallel=parallel)  # fmt: skip
    worker.start()
    app = create_app(worker, api_key=args.api_key, limits=Limits(max_tokens=args.max_tokens))
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"selfspec serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    chunks = f" (prompts read in the batch, {worker.batcher.prompt_chunk} rows a pass)" if worker.batcher else ""
    print(f"selfspec serve: {model.name}, method {args.method}, {parallel} parallel{chunks}, "
          f"{worker.prefix_cache_line()}, on http://{args.host}:{args.port}/ (playground at /, OpenAI API under /v1)",
          file=sys.stderr)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
