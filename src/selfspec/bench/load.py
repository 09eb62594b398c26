"""``selfspec bench --clients N``: concurrent clients against ``selfspec serve``, and against llama.cpp's server.

    selfspec bench --model smollm2-135m --dataset spec-bench --clients 4 --requests 8 \\
        --methods vanilla,auto,llamacpp --max-new-tokens 64 --llama-cpp ~/llama.cpp/build/bin

What several users see.  For each method, fresh servers on loopback ports (the real CLI, over HTTP, streaming
chat completions, greedy) answer the same C x R requests (C clients, each sending its R Spec-Bench questions
one after another):

- ``1 client``: one client sends all C x R requests in turn to ``serve --parallel C``: the baseline;
- ``C clients``: the C clients at once against ``serve --parallel C`` (their rounds verified in one batch);
- ``C clients, --parallel 1``: the same load decoded one request at a time (the server before batching).

Reported per run: aggregate tokens/s (completion tokens of all requests over the wall time from the first
request to the last answer), time to first token (mean and median, queue wait included), and whether every
response equals its one-client response (it must: a request's output does not depend on what runs beside
it).  With ``llamacpp`` among the methods, ``llama-server -np C`` on the same GGUF file and thread count
answers the same load (one client, then C); its responses are not compared (another engine rounds otherwise).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..datasets import PromptItem
from ..errors import InvalidInputError


@dataclass
class Response:
    text: str
    tokens: int
    ttft_s: float  # from sending to the first text
    total_s: float


@dataclass
class LoadRun:
    """One load against one server: who answered, how fast, and the responses by request."""

    label: str
    clients: int
    parallel: int
    wall_s: float
    responses: dict[str, Response] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.responses.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft(self, how: str) -> float:
        times = [r.ttft_s for r in self.responses.values()]
        if not times:
            return float("nan")
        return statistics.fmean(times) if how == "mean" else statistics.median(times)

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "clients": self.clients, "parallel": self.parallel, "requests":
                len(self.responses), "errors": self.errors, "tokens": self.tokens, "wall_s": self.wall_s,
                "tokens_per_second": self.tokens_per_second, "ttft_mean_s": self.ttft("mean"),
                "ttft_median_s": self.ttft("median")}  # fmt: skip


def stream_request(base_url: str, item: PromptItem, max_tokens: int, model: str) -> Response:
    """One streamed, greedy completion (chat for a list of messages, text otherwise), timed from sending."""
    chat = isinstance(item.prompt, list)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    body.update({"messages": item.prompt} if chat else {"prompt": item.prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    first, pieces, tokens = None, [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    first = first if first is not None else time.perf_counter() - t0
                    pieces.append(text)
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", 0))
    total = time.perf_counter() - t0
    if tokens is None:
        raise RuntimeError(f"{base_url} sent no usage (completion tokens) in its stream")
    return Response("".join(pieces), tokens, total if first is None else first, total)


def run_load(label: str, base_url: str, work: list[list[PromptItem]], max_tokens: int, model: str,
             parallel: int) -> LoadRun:  # fmt: skip
    """Each list of ``work`` is one client's requests, sent one after another; the clients run at once."""
    run = LoadRun(label, len(work), parallel, 0.0)
    lock = threading.Lock()

    def client(items: list[PromptItem]) -> None:
        for item in items:
            try:
                got = stream_request(base_url, item, max_tokens, model)
            except Exception as exc:  # reported, not raised: the other clients go on
                with lock:
                    run.errors.append(f"{item.id}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                run.responses[item.id] = got

    threads = [threading.Thread(target=client, args=(items,)) for items in work]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - t0
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OurServer:
    """``selfspec serve`` in a child process on a free loopback port."""

    def __init__(self, model_args: list[str], method: str, parallel: int, queue_size: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "selfspec.cli", "serve", *model_args, "--method", method, "--port",
               str(self.port), "--parallel", str(parallel), "--queue-size", str(queue_size)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"selfspec serve exited: {self.proc.stderr.read()[-600:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("selfspec serve did not come up within 300 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def split_work(prompts: list[PromptItem], clients: int, requests: int) -> list[list[PromptItem]]:
    """Client k's requests: prompts k, k + C, k + 2C, ... (so that each client's mix spans the categories)."""
    need = clients * requests
    if len(prompts) < need:
        raise InvalidInputError(f"--clients {clients} x --requests {requests} needs {need} prompts; the dataset "
                                f"gave {len(prompts)} (raise --limit)")  # fmt: skip
    return [[prompts[k + j * clients] for j in range(requests)] for k in range(clients)]


def bench_method(method: str, model_args: list[str], work: list[list[PromptItem]], max_tokens: int,
                 model_name: str, progress) -> list[LoadRun]:  # fmt: skip
    """The three loads of one of our methods (module docstring), each on a fresh server."""
    C, everything = len(work), [item for items in work for item in items]
    runs = []
    for label, parallel, load in ((f"{method}, 1 client", C, [everything]), (f"{method}, {C} clients", C, work),
                                  (f"{method}, {C} clients, parallel 1", 1, work)):  # fmt: skip
        progress(f"{label}: starting serve --parallel {parallel}")
        server = OurServer(model_args, method, parallel, queue_size=max(8, len(everything)))
        try:
            stream_request(server.url, everything[0], max_tokens, model_name)  # warm-up, not counted
            runs.append(run_load(label, server.url, load, max_tokens, model_name, parallel))
        finally:
            server.close()
        progress(f"{label}: {runs[-1].tokens_per_second:.1f} tokens/s")
    return runs


def bench_llamacpp(binary: Path, gguf: Path, threads: int, context: int, work: list[list[PromptItem]],
                   max_tokens: int, progress) -> list[LoadRun]:  # fmt: skip
    """llama-server -np C on the same file: one client, then C at once."""
    from .llamacpp import _Server

    C, everything = len(work), [item for items in work for item in items]
    server = _Server(binary, gguf, threads, context=context * C, parallel=C)
    try:
        runs = []
        for label, load in ((f"llama.cpp -np {C}, 1 client", [everything]), (f"llama.cpp -np {C}, {C} clients", work)):
            progress(f"{label}")
            stream_request(f"http://127.0.0.1:{server.port}", everything[0], max_tokens, "gguf")  # warm-up
            runs.append(run_load(label, f"http://127.0.0.1:{server.port}", load, max_tokens, "gguf", C))
            progress(f"{label}: {runs[-1].tokens_per_second:.1f} tokens/s")
        return runs
    finally:
        server.close()


def compare(runs: list[LoadRun]) -> dict[str, Any]:
    """Per run: its summary, its aggregate tokens/s over its group's one-client run, and (ours) how many
    responses equal their one-client response."""
    out, base = [], None
    for run in runs:
        row = run.summary()
        if run.clients == 1:
            base = run
        if base is not None and base is not run:
            row["vs_one_client"] = run.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None
            if not run.label.startswith("llama.cpp"):
                same = [run.responses[k].text == base.responses[k].text for k in run.responses if k in base.responses]
                row["identical"] = f"{sum(same)}/{len(same)}"
        out.append(row)
    return {"runs": out}


def write(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "load.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], console) -> None:
    from rich.table import Table

    table = Table(title="concurrent clients (streamed, greedy)")
    for col in ("run", "requests", "tokens/s", "vs 1 client", "TTFT mean/median s", "identical"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        ratio = r.get("vs_one_client")
        table.add_row(r["label"], f"{r['requests']}" + (f" ({len(r['errors'])} failed)" if r["errors"] else ""),
                      f"{r['tokens_per_second']:.1f}", "" if ratio is None else f"{ratio:.2f}x",
                      f"{r['ttft_mean_s']:.2f} / {r['ttft_median_s']:.2f}", r.get("identical", ""))  # fmt: skip
    console.print(table)

