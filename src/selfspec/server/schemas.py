"""Request bodies of the OpenAI endpoints we serve, validated strictly, and the errors they answer with.

Unknown fields are refused (a typo must not be silently ignored); fields of the
OpenAI schema that we do not implement (``functions``, audio)
are refused with a message saying so, unless they ask
for nothing: many clients send every field with its default (``"logprobs":
false``, ``"tools": []``, ``"response_format": {"type": "text"}``, null), and
those requests are answered as without them.  Our own
extensions ride in the body as the ``openai`` client's ``extra_body`` puts them:
``top_k``, ``min_p``, ``repetition_penalty`` and ``selfspec: {"method": ...,
"sampling_scheme": ...}``.  Structured output: OpenAI's ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``: Lark).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..core.sampling import SamplingParams
from ..decoding import grammar as grammars
from ..decoding.limits import is_token_ids
from ..decoding.logprobs import MAX_TOP
from ..errors import InvalidInputError
from .tools import ToolChoice, ToolSpec, call_grammar, template_messages

MAX_CHOICES = 8  # ``n``: choices of one prompt, decoded one after the other
MAX_BATCH = 64  # choices of one text completion request (prompts x n)


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending parameter."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI's responses give it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # text, or OpenAI's list of text parts (joined)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _content_where_needed(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (developer as system; calls' arguments as objects)."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class SelfspecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    sampling_scheme: Literal["coupled", "rejection"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # (the output always matches the schema: decoding is held to it)


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of a JSON schema, a regular expression, a list of choices, a grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark's syntax (llguidance's dialect)


# OpenAI fields we do not implement, each with the values that ask for nothing (a client sending its defaults)
UNSUPPORTED_OPENAI_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "service_tier": (None, "auto", "default"), "store": (None, False),
    "metadata": (None, {}),
}  # fmt: skip


def _asks_nothing(field: str, value: Any) -> bool:
    # (False == 0 in Python: a bool must match a bool, a number a number)
    return any(value == off and isinstance(value, bool) == isinstance(off, bool)
               for off in UNSUPPORTED_OPENAI_FIELDS[field])  # fmt: skip


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_fields_that_ask_nothing(cls, data: Any) -> Any:
        """An unsupported field at its "off" value (``"logprobs": false``, ``"tools": []``, null) is dropped; at
        any other value it stays, and validation refuses it as not supported."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (k in UNSUPPORTED_OPENAI_FIELDS and _asks_nothing(k, v))}
            for name in ("n", "presence_penalty", "frequency_penalty", "echo", "logprobs", "top_logprobs"):
                if data.get(name, 0) is None:  # null: the default
                    del data[name]
        return data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default is 1
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> bias, -100 to 100
    user: str | None = None
    selfspec: SelfspecOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def grammar(self) -> str | None:
        """The grammar the output is held to (decoding/grammar.py), from ``response_format`` or
        ``structured_outputs``; None for plain text."""
        fmt, so = self.response_format, self.structured_outputs
        asked = [] if fmt is None or fmt.type == "text" else ["response_format"]
        kinds = [] if so is None else [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
        if len(asked) + len(kinds) > 1:
            raise ApiError(400, "give one structure for the output: response_format or one field of "
                           "structured_outputs", param="structured_outputs" if len(kinds) > 1 else "response_format")
        try:
            if asked:
                if fmt.type == "json_object":
                    return grammars.json_schema(None)
                if fmt.json_schema is None:
                    raise ApiError(400, "response_format of type json_schema needs json_schema",
                                   param="response_format")  # fmt: skip
                return grammars.json_schema(fmt.json_schema.json_schema or {})
            if not kinds:
                return None
            kind = kinds[0]
            return grammars.of({"json_": "json_schema", "grammar": "lark"}.get(kind, kind), getattr(so, kind))
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param="response_format" if asked else "structured_outputs") from None

    def sampling(self) -> SamplingParams:
        scheme = (self.selfspec.sampling_scheme if self.selfspec else None) or "coupled"
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ApiError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias")
            bias[int(key)] = value
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.min_p,
                              self.repetition_penalty, scheme, self.presence_penalty,
                              self.frequency_penalty, bias, self.grammar())  # fmt: skip

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
        return stops

    def logprob_top(self) -> int | None:
        """Alternatives per token for ``logprobs`` (None: no logprobs asked for)."""
        raise NotImplementedError

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream=true", param="stream_options")


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)

    def logprob_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def prompt(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def calling(self) -> list[ToolSpec] | None:
        """The tools the answer may call (None: a plain answer, also with ``tool_choice: "none"``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tools

    def rendered(self, model: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools for the chat template) of this request (see server/tools.py)."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", param="tool_choice")
            return self.prompt(), None
        return template_messages(self.prompt(), self.tools, model)

    def grammar(self) -> str | None:
        structure = super().grammar()
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return structure
        choice = self.tool_choice
        if isinstance(choice, ToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ApiError(400, f"tool_choice names '{choice.function.name}', which is not among the tools",
                           param="tool_choice")  # fmt: skip
        if structure is not None:
            raise ApiError(400, "a tool choice and a response_format cannot both hold the answer", param="tool_choice")
        try:
            return call_grammar(self.tools, choice, self.parallel_tool_calls is not False)
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param="tools") from None


class CompletionRequest(_Common):
    # text, token ids, or a batch of either (OpenAI's forms; evaluation harnesses send batches of token ids)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)  # alternatives per token (OpenAI: at most 5)
    suffix: str | None = None  # the text after the completion: fill in the middle (code models trained for it)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # candidates per prompt; the n best are kept

    def candidates(self) -> int:
        """Choices decoded per prompt: ``best_of`` where given, else ``n``."""
        return self.best_of or self.n

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise ApiError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.candidates() > self.n and self.stream:
            raise ApiError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")

    def logprob_top(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each text or token ids (a single prompt: a list of one)."""
        p = self.prompt
        if isinstance(p, str) or is_token_ids(p):
            prompts: list = [p]
        else:
            prompts = list(p)
        if not prompts or any(not x or (isinstance(x, str) and not x.strip()) for x in prompts):
            raise ApiError(400, "prompt is empty", param="prompt")
        if self.suffix and (self.echo or any(not isinstance(x, str) for x in prompts)):
            raise ApiError(400, "suffix: fill in the middle takes text prompts, without echo", param="suffix")
        if len(prompts) * self.candidates() > MAX_BATCH:
            raise ApiError(400, f"prompt: {len(prompts)} prompts x {self.candidates()} choices; at most {MAX_BATCH} "
                           "choices "
                           "per request", param="prompt")  # fmt: skip
        return prompts

    def limit(self) -> int | None:
        return self.max_tokens



class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's form): a text or chat messages; the ids and their count."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True  # raw text: the tokens the tokenizer puts around a text (a BOS)
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text (special tokens kept: a faithful round trip)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
