"""Tool calling for the chat endpoint: OpenAI's ``tools`` and ``tool_choice``, on top of structured output.

The tools reach the model through its chat template (``apply_chat_template(..., tools=...)``; Qwen2.5's, Llama
3.1's, Hermes' templates describe them and ask for ``{"name": ..., "arguments": {...}}`` objects, in
``<tool_call>`` tags or bare).  A template that knows no tools gets a system message that describes them and asks
for that form.  What the model writes back:

* ``tool_choice: "required"``: held by a grammar (decoding/grammar.py) to one or more call objects of the given
  tools (one per line; one only with ``parallel_tool_calls: false``), each ``arguments`` matching its tool's
  ``parameters`` schema;
* a named function: held to that function's call object;
* ``"auto"`` (the default with tools): free text, read afterwards for call objects of the given tools (in
  ``<tool_call>`` tags, or the whole answer being one), as vLLM's Hermes parser does; any other text is content
  (streamed as it comes, :class:`CallStream`);
* ``"none"``: plain text (the tools are still described, as OpenAI's API does).

Calls are answered as OpenAI's ``tool_calls`` (arguments as JSON text) with ``finish_reason: "tool_calls"``.
The grammar keeps every method lossless (its forced tokens are even drafted for free), so a tool call is the
same tokens whatever the method.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..decoding import grammar as grammars

FALLBACK_PROMPT = (
    "You can call these functions (JSON schemas of their parameters):\n{tools}\n\n"
    "To call one, answer only with a JSON object per call, one per line: "
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}. Otherwise answer in text.'
)
_TAG = "<tool_call>"
_CALL_STARTS = ("{", "[", "```json", "```\n", _TAG)  # how an answer that is calls begins (a code block of JSON)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


def _parameters(fn: FunctionSpec) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def _call_schema(fn: FunctionSpec) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": _parameters(fn)},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def call_grammar(tools: list[ToolSpec], choice: str | ToolChoice, parallel: bool) -> str | None:
    """The grammar a tool choice holds the answer to (None: free text, for "auto" and "none")."""
    if isinstance(choice, ToolChoice):
        chosen = [t.function for t in tools if t.function.name == choice.function.name]
        return grammars.json_schema(_call_schema(chosen[0]))
    if choice != "required":
        return None
    schema = {"anyOf": [_call_schema(t.function) for t in tools]} if len(tools) > 1 else _call_schema(tools[0].function)
    call = json.dumps(schema)
    return grammars.lark(f'start: call ("\\n" call)*\ncall: %json {call}' if parallel else f"start: %json {call}")


def template_messages(messages: list[dict[str, Any]], tools: list[ToolSpec], model: Any
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:  # fmt: skip
    """(messages, tools for the chat template): the template's own tool section where it has one, else a system
    message describing them (prepended to the first system message, or one of its own)."""
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if "tools" in (getattr(model.tokenizer, "chat_template", None) or ""):
        return messages, specs
    described = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(s["function"]) for s in specs))
    messages = [_plain(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": described + "\n\n" + (messages[0]["content"] or "")}, *messages[1:]], None
    return [{"role": "system", "content": described}, *messages], None


def parse_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an answer: call objects of the given tools in ``<tool_call>`` tags, or the whole
    answer such objects one after another (in a markdown code block or not); the rest of the text is the content
    (None when nothing is left)."""
    names = {t.function.name for t in tools}
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = [_as_call(t, names) for t in tagged]
        if all(c is not None for c in calls):
            return _TAGGED.sub("", text).strip() or None, calls  # type: ignore[return-value]
        return text, []
    fenced = _FENCED.fullmatch(text.strip())  # a markdown code block around the objects
    calls = _json_objects(fenced.group(1) if fenced else text, names)
    return (None, calls) if calls else (text, [])


class CallStream:
    """A streamed chat answer that may call tools: its text goes out as it comes while it cannot be a call, and
    what may be one is held and read at the end (:func:`parse_calls`).  An answer starting like call objects
    (``{``, ``[``, a JSON code block, ``<tool_call>``) is held whole; other text streams, up to a
    ``<tool_call>`` tag, from which the rest is held (as vLLM's Hermes parser streams)."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        self.tools, self.held, self.plain, self.tagged = tools, "", False, False

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held before) that can go out now."""
        self.held += text
        if self.tagged:
            return ""
        if not self.plain:
            head = self.held.lstrip()
            if not head or any(start.startswith(head[: len(start)]) for start in _CALL_STARTS):
                return ""  # may be a call: held
            self.plain = True
        at = self.held.find(_TAG)
        if at >= 0:
            out, self.held, self.tagged = self.held[:at], self.held[at:], True
            return out
        keep = next((k for k in range(min(len(_TAG) - 1, len(self.held)), 0, -1) if _TAG.startswith(self.held[-k:])),
                    0)  # fmt: skip
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(the held text still to go out as content, the calls read from it)."""
        if not self.held:
            return None, []
        return parse_calls(self.held, self.tools)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message of a tool conversation as a template without tools can show it: calls as their JSON text, a
    tool's result as a user message naming its call."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"Result of call {message.get('tool_call_id', '')}: {message['content']}"}
    if message.get("tool_calls"):
        calls = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                          for c in message["tool_calls"])  # fmt: skip
        return {"role": "assistant", "content": ((message.get("content") or "") + "\n" + calls).strip()}
    return message


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError:
            return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip


def _json_objects(text: str, names: set[str]) -> list[dict[str, Any]]:
    """Call objects written one after another (one, one per line, pretty-printed over lines); [] unless the whole
    text is such objects."""
    decoder, i, calls = json.JSONDecoder(), 0, []
    text = text.strip()
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        call = _as_call(obj, names)
        if call is None:
            return []
        calls.append(call)
        while i < len(text) and text[i].isspace():
            i += 1
    return calls
