"""The HTTP routes: OpenAI's chat and text completions (plain and SSE-streamed), models, health, metrics, and
the playground page; authentication, body and prompt limits, and OpenAI-style errors for every bad request."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers

from ..decoding.grammar import check as check_grammar
from ..decoding.limits import check_lengths, check_token_ids, is_token_ids
from ..errors import InvalidInputError
from ..methods import METHODS
from .backlog import Job, QueueFull, loop_emitter
from .logprobs import LogprobFormatter
from .schemas import (
    UNSUPPORTED_OPENAI_FIELDS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .tools import CallStream, parse_calls
from .worker import Worker


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1_000_000
    max_tokens: int = 2048  # most new tokens one request may ask for
    default_max_tokens: int = 256  # a chat request that names no limit
    retry_after_s: int = 2


def create_app(worker: Worker, *, api_key: str | None = None, limits: Limits = Limits()) -> FastAPI:
    """The application: routes, the authentication and size guard, OpenAI-style error handlers."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)  # SIGINT/SIGTERM: save the state

    app = FastAPI(title="selfspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    model_name = worker.model.name

    app.add_middleware(_Guard, worker=worker, api_key=api_key, limits=limits)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error(_from_validation(exc.errors()))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue": worker.queue_length, "method": worker.method,
                "methods": list(worker.allowed), "state_loaded": worker.state_loaded}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "selfspec"}]}

    _tokenizer_routes(app, worker, limits)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files(__package__).joinpath("playground.html").read_text())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = _parse(ChatRequest, await _json(request, limits))
        messages, tools = body.rendered(worker.model)
        return await _complete(worker, limits, request, body, [messages], chat=True, tools=tools)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(CompletionRequest, await _json(request, limits))
        return await _complete(worker, limits, request, body, body.prompts(), chat=False)

    return app


def _tokenizer_routes(app: FastAPI, worker: Worker, limits: Limits) -> None:
    """The tokenizer, as vLLM serves it (evaluation harnesses and clients that count tokens use these)."""
    model_name = worker.model.name

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {**worker.model.tokenizer_info(), "model_max_length": worker.model.max_context,
                "vocab_size": worker.model.adapter.vocab_size}  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = _parse(TokenizeRequest, await _json(request, limits))
        _check_model(body.model, model_name)
        model = worker.model
        try:
            if body.messages is not None:
                text = model.chat_text([m.as_dict() for m in body.messages],
                                       add_generation_prompt=body.add_generation_prompt)  # fmt: skip
                ids = model.tokenize(text, add_special_tokens=False)
            else:
                ids = model.tokenize(body.prompt or "", add_special_tokens=body.add_special_tokens)
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = _parse(DetokenizeRequest, await _json(request, limits))
        _check_model(body.model, model_name)
        try:
            if body.tokens:
                check_token_ids(worker.model, body.tokens)
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param="tokens") from None
        return {"prompt": worker.model.decode(body.tokens, skip_special=False)}


async def _complete(worker: Worker, limits: Limits, request: Request, body, prompts: list[Any], *, chat: bool,
                    tools: list[dict] | None = None):  # fmt: skip
    """Validate a completion request (its prompts: chat messages, text or token ids) against the model and the
    limits, queue it, answer or stream."""
    model_name = worker.model.name
    body.check_supported()
    _check_model(body.model, model_name)
    method = (body.selfspec.method if body.selfspec else None) or worker.method
    if method not in worker.allowed:
        raise ApiError(400, f"method '{method}' is not allowed here; allowed: {', '.join(worker.allowed)}",
                       param="selfspec.method")  # fmt: skip
    limit = body.limit() or limits.default_max_tokens
    if limit > limits.max_tokens:
        raise ApiError(400, f"max_tokens is {limit}; this server allows at most {limits.max_tokens}",
                       param="max_tokens")  # fmt: skip
    try:
        sampling = body.sampling()
        try:
            sampling.check_vocabulary(worker.model.adapter.vocab_size)
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param="logit_bias") from None
        if sampling.grammar is not None:
            try:
                # (off the event loop: the first grammar builds the tokenizer's index, about a second)
                await asyncio.to_thread(check_grammar, worker.model, sampling.grammar)
            except InvalidInputError as exc:
                raise ApiError(400, str(exc), param="response_format") from None
        every_ids = []
        suffix = getattr(body, "suffix", None)
        for prompt in prompts:
            if is_token_ids(prompt):
                check_token_ids(worker.model, prompt)
                ids = list(prompt)
            elif suffix:  # the text between the prompt and the suffix
                try:
                    ids = worker.model.fill_in_middle(prompt, suffix)
                except InvalidInputError as exc:  # a model without fill-in-the-middle tokens
                    raise ApiError(400, str(exc), param="suffix") from None
            else:
                ids = worker.model.encode(prompt, tools=tools)
            check_lengths(worker.model, len(ids), limit)
            every_ids.append(ids)
    except InvalidInputError as exc:
        raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    echo = getattr(body, "echo", False)
    per_prompt = body.candidates() if hasattr(body, "candidates") else body.n  # best_of: candidates, the n best kept
    ranked = per_prompt > body.n  # ranked by their tokens' mean log-probability: recorded even if not asked for
    logprobs = body.logprob_top() if not ranked else (body.logprob_top() or 0)
    job = Job(every_ids, method, sampling, limit, body.stops(), loop_emitter(loop, events), logprobs=logprobs,
              n=per_prompt, batch=True, echo=echo)  # fmt: skip
    try:
        worker.submit(job)
    except QueueFull:
        raise ApiError(429, "the server is busy (queue full); retry later", type="rate_limit_error",
                       headers={"Retry-After": str(limits.retry_after_s)}) from None  # fmt: skip
    reply = _Reply(job.id, model_name, chat, sum(map(len, every_ids)), len(prompts) * per_prompt, body.logprob_top(),
                   worker.logprob_formatter, calling=body.calling() if chat else None)  # fmt: skip
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(request, job, events, reply, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    return await _gather(request, job, events, reply, keep=body.n if ranked else None)


KNOWN_PATHS = {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize",
               "/detokenize", "/tokenizer_info"}  # fmt: skip
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")  # need the API key where one is set


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise ApiError(404, f"model '{name}' is not served here; this server serves '{served}'", param="model",
                       type="not_found_error")  # fmt: skip


@dataclass
class _Reply:
    """Builds the OpenAI response objects of one request (its ``n`` choices)."""

    id: str
    model: str
    chat: bool
    prompt_tokens: int
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no logprobs asked for
    formatter: LogprobFormatter | None = None
    calling: list | None = None  # the tools an answer may call (server/tools.py): its text is read for calls
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}  # fmt: skip

    def _logprobs(self, items: list) -> dict[str, Any] | None:
        if self.logprobs is None or self.formatter is None:
            return None
        return self.formatter.chat(items) if self.chat else self.formatter.completion(items, self.logprobs)

    def whole(self, choices: list[_Choice], stats, tokens: int | None = None) -> dict[str, Any]:
        """The response; ``tokens``: the completion tokens generated (``best_of``'s candidates all count)."""
        out = []
        for i, c in enumerate(choices):
            if self.chat:
                message, reason = self.message("".join(c.parts), c.reason)
                out.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": self._logprobs(c.items)})  # fmt: skip
            else:
                out.append({"index": i, "text": "".join(c.parts), "finish_reason": c.reason,
                            "logprobs": self._logprobs(c.items)})  # fmt: skip
        tokens = sum(c.tokens for c in choices) if tokens is None else tokens
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": self.usage(tokens),
                "selfspec": _stats(stats)}  # fmt: skip

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat answer's message and finish reason: with tools, its calls read out of the text."""
        if not self.calling:
            return {"role": "assistant", "content": text}, reason
        content, calls = parse_calls(text, self.calling)
        if not calls:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def chunk(self, text: str | None, reason: str | None = None, extra: dict | None = None,
              role: bool = False, index: int = 0, items: list | None = None,
              calls: list | None = None) -> dict[str, Any]:  # fmt: skip
        logprobs = self._logprobs(items) if items else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}  # fmt: skip
        if extra:
            out["selfspec"] = extra
        return out


@dataclass
class _Choice:
    """What one choice of a request has produced so far."""

    parts: list[str] = field(default_factory=list)
    items: list = field(default_factory=list)  # (offset, TokenLogprob), with the text they belong to
    reason: str | None = None
    tokens: int = 0


def _best(choices: list[_Choice], per_prompt: int, keep: int) -> list[_Choice]:
    """Of each prompt's candidates, the ``keep`` whose generated tokens have the highest mean log-probability
    (OpenAI's ``best_of``; an echoed prompt's figures, which come first, are not counted), best first."""
    def score(c: _Choice) -> float:
        generated = [e.logprob for _, e in c.items[max(0, len(c.items) - c.tokens) :] if e.logprob is not None]
        return sum(generated) / len(generated) if generated else float("-inf")

    out = []
    for p in range(0, len(choices), per_prompt):
        out += sorted(choices[p : p + per_prompt], key=score, reverse=True)[:keep]
    return out


def _stats(stats) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {"method": stats.method, "new_tokens": stats.new_tokens, "drafted": stats.drafted,
            "accepted": stats.accepted, "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_generated_length": round(stats.mean_generated_length, 4),
            "tokens_per_second": round(stats.tokens_per_second, 2), "stop_reason": stats.stop_reason}  # fmt: skip


async def _next(request: Request, job: Job, events: asyncio.Queue):
    """The job's next event; cancels the job when the client has gone away."""
    if not events.empty():  # already queued (several requests decoding): no timer for it
        return events.get_nowait()
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                return ("gone", None)


async def _gather(request: Request, job: Job, events: asyncio.Queue, reply: _Reply, keep: int | None = None):
    """The whole response; ``keep``: of each prompt's ``job.n`` candidates, the ``keep`` best (``best_of``)."""
    choices = [_Choice() for _ in range(reply.n)]
    first_stats = None
    try:
        while True:
            kind, payload = await _next(request, job, events)
            if kind == "piece":
                index, text, _, _, items = payload
                choices[index].parts.append(text)
                choices[index].items.extend(items)
            elif kind == "end":
                index, reason, stats, tokens = payload
                choices[index].reason, choices[index].tokens = reason, tokens
                first_stats = stats if index == 0 else first_stats
            elif kind == "done":
                generated = sum(c.tokens for c in choices)
                if keep is not None:
                    choices = _best(choices, job.n, keep)
                return JSONResponse(reply.whole(choices, first_stats, generated))
            elif kind == "error":
                status, message = payload
                raise ApiError(status, message, type="server_error" if status >= 500 else "invalid_request_error")
            else:  # gone
                return JSONResponse({}, status_code=499)
    finally:
        job.cancel.set()  # (a no-op once done)


async def _sse(request: Request, job: Job, events: asyncio.Queue, reply: _Reply, include_usage: bool
               ) -> AsyncIterator[str]:  # fmt: skip
    pending = None  # an event taken while merging pieces, handled next
    tokens_sent = 0
    held = [CallStream(reply.calling) for _ in range(reply.n)] if reply.calling else []  # with tools (tools.py)
    try:
        for index in range(reply.n):
            yield _event(reply.chunk("" if reply.chat else None, role=True, index=index))
        while True:
            kind, payload = pending if pending is not None else await _next(request, job, events)
            pending = None
            if kind == "piece":
                index, text, tokens, drafted, items = payload
                # pieces of one choice that queued up while the loop was busy (several requests decoding) go out
                # as one event: the same text, fewer events to write and parse
                while not events.empty():
                    kind2, payload2 = events.get_nowait()
                    if kind2 != "piece" or payload2[0] != index:
                        pending = (kind2, payload2)
                        break
                    text, tokens, drafted = text + payload2[1], tokens + payload2[2], drafted + payload2[3]
                    items = [*items, *payload2[4]]
                if reply.calling:  # text that may be calls is held until the answer is whole, then read
                    text = held[index].feed(text)
                if text or tokens or items:
                    yield _event(reply.chunk(text, extra={"tokens": tokens, "drafted": drafted}, index=index,
                                             items=items))  # fmt: skip
            elif kind == "end":
                index, reason, stats, tokens = payload
                tokens_sent += tokens
                if reply.calling:
                    content, calls = held[index].finish()
                    if content or calls:
                        yield _event(reply.chunk(content, index=index, calls=calls))
                    reason = "tool_calls" if calls else reason
                yield _event(reply.chunk(None, reason, extra=_stats(stats), index=index))
            elif kind == "done":
                if include_usage:
                    usage = reply.chunk(None)
                    usage["choices"], usage["usage"] = [], reply.usage(tokens_sent)
                    yield _event(usage)
                yield "data: [DONE]\n\n"
                return
            elif kind == "error":
                status, message = payload
                yield _event(ApiError(status, message).body())
                return
            else:
                return
    finally:
        job.cancel.set()  # the client went away (or the stream ended): stop at the next round


class _Guard:
    """The API key and body size checks, and the requests' count by path and status for /metrics.

    A plain ASGI middleware: starlette's ``@app.middleware("http")`` (``BaseHTTPMiddleware``) relays each event of
    a streamed answer through a memory stream and a task of its own, a quarter of the event loop's time under four
    streaming clients (py-spy of ``serve --parallel 4``), every token of every stream; here the events go straight
    through and only the response's status is read on the way."""

    def __init__(self, app, *, worker: Worker, api_key: str | None, limits: Limits) -> None:
        self.app, self.worker, self.api_key, self.limits = app, worker, api_key, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500  # unless the response starts (an exception escaping the app is a server error)

        async def sent(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refused = self._refusal(path, Headers(scope=scope))
            if refused is not None:
                await _error(refused)(scope, receive, sent)
            else:
                await self.app(scope, receive, sent)
        finally:
            self.worker.metrics.request(path if path in KNOWN_PATHS else "other", status)

    def _refusal(self, path: str, headers: Headers) -> ApiError | None:
        if path.startswith(PROTECTED) and self.api_key is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                type="authentication_error")  # fmt: skip
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.limits.max_body_bytes):
            return ApiError(413, f"request body larger than {self.limits.max_body_bytes} bytes")
        return None


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _json(request: Request, limits: Limits) -> Any:
    raw = await request.body()
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"request body larger than {limits.max_body_bytes} bytes")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _parse(model_cls, data: Any):
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc.errors()) from None


def _from_validation(errors: list[dict]) -> ApiError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        field = str(first.get("loc", ("",))[-1])
        msg = "not supported by this server" if field in UNSUPPORTED_OPENAI_FIELDS else "unknown field"
    return ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def allowed_methods(default: str) -> tuple[str, ...]:
    """Methods a request may choose: every method needing no trained adapter or skip-set file."""
    usable = tuple(m for m in METHODS if m not in ("s3d", "static", "selfsd"))
    return usable if default in usable else (*usable, default)
