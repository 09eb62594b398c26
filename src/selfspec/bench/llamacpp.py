"""The ``llamacpp`` peer: llama.cpp's own decoding of the same weights, as a yardstick of absolute speed.

llama.cpp is never a dependency: the peer runs only where a ``llama-server``
binary is found -- the method option ``bin=PATH`` (the binary or its folder),
``selfspec bench --llama-cpp PATH``, ``$SELFSPEC_LLAMA_CPP``, or ``PATH`` --
and is skipped with one line saying so otherwise.  The weights are the GGUF
file of the built-in model, the ``.gguf`` the model was loaded from, or the
option ``gguf=FILE`` (for instance an F32 export of the same checkpoint).

``spec=TYPE`` starts the server with ``--spec-type TYPE``: llama.cpp's own
draft-free speculation (``ngram-mod``, ``ngram-simple``, ...), the mark our
prompt lookup is compared with.

One server is started per (binary, file, threads, spec) and reused for every
prompt; each prompt is sent as token ids (our tokenizer's), greedy unless the
run samples, without prompt caching.  Times are the server's own ``timings``
(prompt and generation), so HTTP overhead is not billed to llama.cpp.  Its
outputs are not judged for losslessness: another engine (and, for a
quantised file, other weights) rounds differently; the report says n/a.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from ..core.sampling import SamplingParams
from ..decoding.loop import GenerationStats
from ..errors import ExternalToolError, InvalidInputError

ENV = "SELFSPEC_LLAMA_CPP"
_SERVERS: dict[tuple[str, str, int, str], _Server] = {}


def find_binary(option: str | None, tool: str = "llama-server") -> Path | None:
    """llama.cpp's ``tool`` from the option (the binary, a sibling tool or their folder), the environment or
    PATH (None when absent)."""
    for where in (option, os.environ.get(ENV)):
        if where:
            p = Path(where).expanduser()
            p = p / tool if p.is_dir() else (p if tool in p.name else p.with_name(tool))
            if p.is_file() and os.access(p, os.X_OK):
                return p
    found = shutil.which(tool)
    return Path(found) if found else None


def _exit_reason(returncode: int) -> str:
    """How a tool's process ended, in words: a signal by name, with the likely cause of SIGILL (a build for
    instructions this CPU or its hypervisor does not run, e.g. AMX tiles in a VM)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = (" (an instruction this CPU or its hypervisor does not run: rebuild llama.cpp for this machine, e.g. "
            "without AMX: -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')"
            if name == "SIGILL" else "")  # fmt: skip
    return f"was killed by {name}{hint}"


def llama_bench(gguf: Path, threads: int, *, binary: Path, prompt: int = 512, generate: int = 128,
                reps: int = 3) -> dict[str, float]:  # fmt: skip
    """llama.cpp's own speed on ``gguf`` with ``threads`` threads, from ``llama-bench -o json``: prompt tokens
    per second (pp``prompt``) and generated tokens per second (tg``generate``), each the mean of ``reps`` runs."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(generate),
           "-r", str(reps), "-o", "json"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ExternalToolError(f"{binary} could not run: {exc}") from None
    if proc.returncode != 0:
        raise ExternalToolError(f"{binary} {_exit_reason(proc.returncode)}: {proc.stderr.strip()[-300:]}")
    try:
        tests = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ExternalToolError(f"{binary} printed no JSON: {proc.stdout.strip()[:200]}") from None
    out: dict[str, float] = {}
    for t in tests:
        if int(t.get("n_gen", 0)) > 0 and int(t.get("n_prompt", 0)) == 0:
            out["decode_tokens_per_second"] = float(t["avg_ts"])
        elif int(t.get("n_prompt", 0)) > 0 and int(t.get("n_gen", 0)) == 0:
            out["prefill_tokens_per_second"] = float(t["avg_ts"])
    if "decode_tokens_per_second" not in out:
        raise RuntimeError("llama-bench reported no generation test")
    return out


def gguf_file(model, option: str | None) -> Path:
    """The GGUF file holding ``model``'s weights, or a clear error."""
    if option:
        path = Path(option).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"llamacpp: gguf file {path} does not exist")
        return path
    from ..model.models import BUILTINS, _builtin_gguf

    if model.name in BUILTINS:
        return _builtin_gguf(BUILTINS[model.name])
    if str(model.name).endswith(".gguf") and Path(model.name).is_file():
        return Path(model.name)
    raise InvalidInputError(f"llamacpp: model '{model.name}' has no GGUF file; give one with llamacpp:gguf=FILE")


def skip_reason(model, options: dict[str, Any]) -> str | None:
    """Why the peer cannot run here (None: it can); checked before any timing starts."""
    if find_binary(options.get("bin")) is None:
        return f"no llama-server found (give --llama-cpp PATH, ${ENV}, or put it on PATH)"
    gguf_file(model, options.get("gguf"))  # a bad file is the user's error: raise
    return None


class _Server:
    """A llama-server on a free loopback port (``parallel``: its slots, ``-np``; ``context``: for all of them)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int, spec: str = "",
                 parallel: int = 1) -> None:  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(context), "--host", "127.0.0.1",
               "--port", str(self.port), "-np", str(parallel)] + (["--spec-type", spec] if spec else [])  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-400:] if self.proc.stderr else ""
                raise ExternalToolError(f"{binary} {_exit_reason(self.proc.returncode)}: {err}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError("llama-server did not become ready within 120 s")

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@atexit.register
def _close_all() -> None:
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


def run(model, options: dict[str, Any], prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams):
    """(token ids, GenerationStats) of llama.cpp's decoding of ``prompt_ids``."""
    binary = find_binary(options.get("bin"))
    if binary is None:
        raise RuntimeError("llama-server not found")
    gguf = gguf_file(model, options.get("gguf"))
    threads = int(options.get("threads", torch.get_num_threads()))
    spec = str(options.get("spec", ""))
    key = (str(binary), str(gguf), threads, spec)
    if key not in _SERVERS:
        _SERVERS[key] = _Server(binary, gguf, threads, context=min(model.max_context, 8192), spec=spec)
    body: dict[str, Any] = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "cache_prompt": False,
                            "return_tokens": True, "stream": False}  # fmt: skip
    # the penalties (llama.cpp's repeat penalty reads its last 64 tokens, ours the whole history: not the same)
    body.update(repeat_penalty=sampling.repetition_penalty, presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty)  # fmt: skip
    if sampling.greedy:
        body.update(temperature=0.0, top_k=1)
    else:
        body.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    min_p=sampling.min_p, seed=-1 if sampling.seed is None else sampling.seed)  # fmt: skip
    out = _SERVERS[key].complete(body)
    ids = [int(t) for t in out.get("tokens", [])]
    eos = model.eos_token_ids
    stopped_eos = bool(out.get("stopped_eos"))
    if stopped_eos and eos and (not ids or ids[-1] not in eos):
        ids.append(min(eos))  # llama.cpp leaves the end-of-sequence token out; our decoder keeps it
    timings = out.get("timings", {})
    prefill = float(timings.get("prompt_ms", 0.0)) / 1000
    decode = float(timings.get("predicted_ms", 0.0)) / 1000
    stats = GenerationStats(method="llamacpp", prompt_tokens=len(prompt_ids), new_tokens=len(ids),
                            forwards=max(1, len(ids)), draft_forwards=0, drafted=0, accepted=0,
                            prefill_time=prefill, draft_time=0.0, verify_time=decode, total_time=prefill + decode,
                            stop_reason="eos" if stopped_eos else "length", skip_set=None)  # fmt: skip
    return ids, stats
