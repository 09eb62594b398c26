"""`selfspec serve` end to end: the real server on a free loopback port, the official `openai` client, the
built-in model.  Greedy output equals `selfspec.generate` (and vanilla); seeded sampling reproduces vanilla
sampling; bad requests get OpenAI-style 4xx errors; a bounded load test; the state survives a restart; a corrupt
state file is set aside."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from openai import OpenAI, RateLimitError

import selfspec
from selfspec.core.prefix_store import inexact_reason

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name three colours."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Server:
    def __init__(self, *args: str, state: Path | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "selfspec.cli", "serve", "--model", MODEL, "--port", str(self.port), *args]
        if state is not None:
            cmd += ["--state", str(state)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()}")
            try:
                if get(f"{self.url}/health")["status"] == "ok":
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("the server did not come up")

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), **kw)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, self.proc.stderr.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--queue-size", "2", "--max-tokens", "512", "--parallel", "1",
                 state=tmp_path_factory.mktemp("state") / "s.json")  # fmt: skip
    yield srv
    srv.stop()


def test_the_guard_refuses_large_bodies_and_counts_every_request_by_path_and_status(server):
    """The size check answers before the body is read, OpenAI-style; /metrics counts each request under its
    route (unknown paths as "other") with the status its response started with, streamed answers included."""
    def count(endpoint: str, status: int) -> int:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        line = f'selfspec_requests_total{{endpoint="{endpoint}",status="{status}"}} '
        return sum(int(row[len(line) :]) for row in text.splitlines() if row.startswith(line))

    before = (count("/v1/chat/completions", 413), count("other", 404), count("/v1/chat/completions", 200))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # a body announced, never sent
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", "1000001")
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and "larger than" in json.loads(r.read())["error"]["message"]
    conn.close()
    code, _ = post(f"{server.url}/no/such/route", b"{}")
    assert code == 404
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True}
    req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.read().decode().rstrip().endswith("data: [DONE]")
    after = (count("/v1/chat/completions", 413), count("other", 404), count("/v1/chat/completions", 200))
    assert after == (before[0] + 1, before[1] + 1, before[2] + 1)


def test_chat_equals_generate_and_vanilla(server, smollm2):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    ours = selfspec.generate(smollm2, CHAT, "auto", max_new_tokens=40)
    vanilla = selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=40)
    assert ours.token_ids == vanilla.token_ids
    assert out.choices[0].message.content == vanilla.text
    assert out.usage.completion_tokens == len(vanilla.token_ids)
    assert out.usage.prompt_tokens == len(smollm2.encode(CHAT))
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.model_extra["selfspec"]["method"] == "auto"
    for method in ("pld", "swift"):  # a per-request method
        other = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                               extra_body={"selfspec": {"method": method}})  # fmt: skip
        assert other.choices[0].message.content == vanilla.text
        assert other.model_extra["selfspec"]["method"] == method


def test_openai_penalties_and_logit_bias_answer_as_generate(server, smollm2):
    client = server.client()
    kw = {"frequency_penalty": 0.8, "presence_penalty": 0.4}
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, **kw)
    want = selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=40, **kw)
    assert out.choices[0].message.content == want.text
    assert want.token_ids != selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=40).token_ids
    banned = {str(want.token_ids[0]): -100, str(want.token_ids[1]): -100}
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, logit_bias=banned)
    want = selfspec.generate(smollm2, CHAT, "pld", max_new_tokens=20, logit_bias={int(k): v for k, v in banned.items()})
    assert out.choices[0].message.content == want.text and want.token_ids[0] != int(next(iter(banned)))
    for bias, words in (({"x": 1}, "not a token id"), ({"99999999": 1}, "vocabulary"), ({"5": 200}, "-100 and 100")):
        code, reply = post(f"{server.url}/v1/chat/completions",
                           json.dumps({"messages": CHAT, "max_tokens": 4, "logit_bias": bias}).encode())  # fmt: skip
        assert code == 400 and words in reply["error"]["message"], reply


def test_streamed_chat_equals_the_plain_reply(server, smollm2):
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == plain.choices[0].finish_reason
    counted = sum(c.model_extra["selfspec"]["tokens"] for c in chunks if c.choices and not c.choices[0].finish_reason
                  and c.model_extra.get("selfspec") and "tokens" in c.model_extra["selfspec"])  # fmt: skip
    assert counted == plain.usage.completion_tokens


def test_text_completion_and_stop_strings(server, smollm2):
    client = server.client()
    prompt = "The capital of France is"
    vanilla = selfspec.generate(smollm2, prompt, "vanilla", max_new_tokens=24)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == vanilla.text
    stop = vanilla.text[5:8]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == vanilla.text[: vanilla.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert 0 < cut.usage.completion_tokens < out.usage.completion_tokens, "usage counts the tokens before the stop"


def test_seeded_sampling_is_vanilla_samplings_tokens(server, smollm2):
    client = server.client()
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 30, "temperature": 0.8, "top_p": 0.95, "seed": 7}
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw, extra_body={"selfspec": {"method": "swift"}}).choices[0].message.content
    vanilla = selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=30, temperature=0.8, top_p=0.95, seed=7)
    assert a == b == vanilla.text


@pytest.mark.parametrize(
    "body, status, words",
    [
        ("{not json", 400, "not valid JSON"),
        ({"messages": CHAT, "temperature": 3}, 400, "temperature"),
        ({"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 100000}, 400, "at most 512"),
        ({"messages": CHAT, "n": 9}, 400, "n"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"messages": CHAT, "top_logprobs": 2}, 400, "needs logprobs=true"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not among the tools"),
        ({"messages": CHAT, "tool_choice": "required"}, 400, "needs tools"),
        ({"messages": [{"role": "tool", "content": "42"}]}, 400, "tool_call_id"),
        ({"messages": CHAT, "functions": [{"name": "f"}]}, 400, "not supported"),
        ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "bogus"}}}}, 400, "does not compile"),
        ({"messages": CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, 400,
         "one structure"),
        ({"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "needs json_schema"),
        ({"messages": CHAT, "colour": "blue"}, 400, "unknown field"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x " * 20000}]}, 400, "context"),
        ({"messages": CHAT, "model": "gpt-9"}, 404, "not served here"),
        ({"messages": CHAT, "selfspec": {"method": "magic"}}, 400, "not allowed"),
        ({"messages": CHAT, "presence_penalty": 3.0}, 400, "presence_penalty"),
    ],
)
def test_bad_requests_get_openai_style_errors(server, body, status, words):
    data = body if isinstance(body, str) else json.dumps(body)
    code, reply = post(f"{server.url}/v1/chat/completions", data.encode())
    assert code == status, reply
    error = reply["error"]
    assert words in error["message"] and error["type"]


def test_a_client_sending_every_default_gets_the_plain_answer(server):
    """Clients that send each OpenAI field at its default (``"logprobs": false``, ``"tools": []``, nulls) are
    answered as without them; the same fields asking for something are refused (above)."""
    plain = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    defaults = {**plain, "logprobs": False, "top_logprobs": None, "n": 1, "presence_penalty": 0,
                "frequency_penalty": None, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                "logit_bias": {}, "stream": False, "user": "u", "store": False, "metadata": None}  # fmt: skip
    answers = []
    for body in (plain, defaults):
        code, reply = post(f"{server.url}/v1/chat/completions", json.dumps(body).encode())
        assert code == 200, reply
        answers.append(reply["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] and answers[0]
    code, reply = post(f"{server.url}/v1/completions",
                       json.dumps({"prompt": "Hello", "max_tokens": 4, "logprobs": None, "echo": False,
                                   "best_of": 1, "suffix": None}).encode())  # fmt: skip
    assert code == 200, reply
    assert reply["choices"][0]["logprobs"] is None
    code, reply = post(f"{server.url}/v1/completions", json.dumps({"prompt": "Hello", "logprobs": 0}).encode())
    assert code == 200, reply
    logprobs = reply["choices"][0]["logprobs"]  # 0 asks for the chosen tokens' own
    assert logprobs["tokens"] and len(logprobs["token_logprobs"]) == len(logprobs["tokens"])
    assert logprobs["top_logprobs"] is None


def test_structured_output_is_generates_and_parses(server, smollm2):
    """OpenAI's response_format (a JSON schema, any JSON object) and vLLM's structured_outputs (a choice): the
    answer is selfspec.generate's under the same grammar, plain and streamed, and it parses."""
    from selfspec.decoding import grammar

    client = server.client()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    ask = [{"role": "user", "content": "Name the capital of France as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0, response_format=fmt)
    want = selfspec.generate(smollm2, ask, "vanilla", max_new_tokens=40, grammar=grammar.json_schema(schema))
    assert out.choices[0].message.content == want.text and set(json.loads(want.text)) == {"city"}
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    anything = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})  # fmt: skip
    reply = anything.choices[0].message.content
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply), dict)
    else:
        assert reply.lstrip().startswith("{")
    code, reply = post(f"{server.url}/v1/completions", json.dumps({
        "prompt": "Is the sky blue? Answer:", "max_tokens": 4, "temperature": 0,
        "structured_outputs": {"choice": [" yes", " no"]}}).encode())  # fmt: skip
    assert code == 200 and reply["choices"][0]["text"] in (" yes", " no"), reply


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"], "additionalProperties": False}}}]  # fmt: skip


def test_tool_calls_are_held_to_the_tools_and_are_generates_answer(server, smollm2):
    """tool_choice "required" and a named function: the answer is held to call objects of the tools (server/tools.py)
    and is exactly selfspec.generate's under the same grammar; streamed alike; a tool's result is taken back."""
    from selfspec.server.tools import ToolChoice, ToolSpec, call_grammar, parse_calls, template_messages

    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    specs = [ToolSpec.model_validate(t) for t in TOOLS]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice=choice,
                                             max_tokens=60, temperature=0, parallel_tool_calls=False)  # fmt: skip
        reply = out.choices[0]
        assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
        call = reply.message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city"}
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        messages, tools = template_messages(ask, specs, smollm2)
        named = choice if isinstance(choice, str) else ToolChoice.model_validate(choice)
        want = selfspec.generate(smollm2, messages, "vanilla", max_new_tokens=60,
                                 grammar=call_grammar(specs, named, parallel=False))  # fmt: skip
        content, calls = parse_calls(want.text, specs)
        assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (call.function.name, call.function.arguments)]
        stream = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice=choice,
                                                max_tokens=60, temperature=0, parallel_tool_calls=False,
                                                stream=True)  # fmt: skip
        streamed, reasons = [], []
        for chunk in stream:
            for c in chunk.choices:
                streamed += [(t.function.name, t.function.arguments) for t in (c.delta.tool_calls or [])]
                reasons.append(c.finish_reason)
        assert streamed == [(call.function.name, call.function.arguments)] and "tool_calls" in reasons
    turn = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]  # fmt: skip
    out = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=16,
                                         temperature=0)  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content


def test_with_tools_a_plain_answer_still_streams(server, smollm2):
    """tool_choice "auto": an answer that does not begin like a call streams piece by piece, and equals the
    plain reply; a call would be held and read at the end (CallStream, below)."""
    client = server.client()
    ask = [{"role": "user", "content": "Tell me a short story about a cat."}]
    plain = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=40, temperature=0)
    text = plain.choices[0].message.content
    assert text and not plain.choices[0].message.tool_calls and not text.lstrip().startswith(("{", "[", "`", "<"))
    stream = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=40, temperature=0,
                                            stream=True)  # fmt: skip
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text and len(pieces) > 3


def test_a_streamed_answer_is_held_only_where_it_may_be_a_call():
    from selfspec.server.tools import CallStream, ToolSpec

    specs = [ToolSpec.model_validate(t) for t in TOOLS]
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

    def streamed(text):
        cs = CallStream(specs)
        sent = "".join(cs.feed(text[i : i + 3]) for i in range(0, len(text), 3))
        content, calls = cs.finish()
        return sent, content, [json.loads(c["function"]["arguments"]) for c in calls]

    paris = [{"city": "Paris"}]
    assert streamed("It is sunny.") == ("It is sunny.", None, [])
    assert streamed("a <b>bold</b> claim < 3") == ("a <b>bold</b> claim < 3", None, [])
    assert streamed("```python\nprint(1)\n```")[0] == "```python\nprint(1)\n```"
    for held in (one, f"```json\n{one}\n```", f"<tool_call>{one}</tool_call>", f"  \n{one}"):
        assert streamed(held) == ("", None, paris), held
    assert streamed(f"Let me check.<tool_call>{one}</tool_call>") == ("Let me check.", None, paris)
    assert streamed('{"not": "a call"}') == ("", '{"not": "a call"}', [])  # held, then sent as content


def test_tool_calls_are_read_from_the_forms_models_write():
    from selfspec.server.tools import ToolSpec, parse_calls

    specs = [ToolSpec.model_validate(t) for t in TOOLS]
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (one, f"<tool_call>\n{one}\n</tool_call>", f"```json\n{one}\n```", f"{one}\n{one}"):
        content, calls = parse_calls(text, specs)
        assert content is None and calls and all(json.loads(c["function"]["arguments"]) == {"city": "Paris"}
                                                 for c in calls), text  # fmt: skip
    content, calls = parse_calls(f"Let me check.<tool_call>{one}</tool_call>", specs)
    assert content == "Let me check." and len(calls) == 1
    for text in ("It is sunny.", '{"name": "launch_rockets", "arguments": {}}', f"{one} and more",
                 '<tool_call>{"name": "get_weather", "arguments": 3}</tool_call>'):  # fmt: skip
        assert parse_calls(text, specs) == (text, []), text


def test_chat_logprobs_are_the_models_own_and_spell_the_answer(server, smollm2):
    """``logprobs`` / ``top_logprobs``: per token of the answer, the figures `selfspec.generate` reports (vanilla's
    own, tests/test_logprobs.py), whatever method the server runs; the tokens' bytes spell the answer."""
    client = server.client()
    vanilla = selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=30, logprobs=3)
    for method in ("auto", "pld"):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, logprobs=True,
                                             top_logprobs=3, extra_body={"selfspec": {"method": method}})  # fmt: skip
        choice = out.choices[0]
        assert choice.message.content == vanilla.text
        content = choice.logprobs.content
        want = vanilla.logprobs  # every token, an end of sequence too (its text and bytes empty)
        assert [c.logprob for c in content] == [e.logprob for e in want]
        assert [[t.logprob for t in c.top_logprobs] for c in content] == [[lp for _, lp in e.top] for e in want]
        assert bytes(b for c in content for b in c.bytes).decode() == vanilla.text
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None, "none unless asked for"


def test_completion_logprobs_stop_with_the_text_and_stream_alike(server, smollm2):
    """Legacy completions' form: tokens, token_logprobs, top_logprobs, text_offset; a stop string cuts the
    tokens with the text; streamed chunks carry the same entries as the plain reply."""
    client = server.client()
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    text = full.choices[0].text
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    tops = lp.top_logprobs
    assert all(len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6 for i, top in enumerate(tops))
    stop = text[6:9]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2, stop=[stop])
    kept = cut.choices[0].logprobs
    assert cut.choices[0].text == text[: text.index(stop)]
    assert all(at < len(cut.choices[0].text) for at in kept.text_offset), "no token after the stop string"
    assert kept.token_logprobs == lp.token_logprobs[: len(kept.token_logprobs)] and kept.tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
                                            stream=True))  # fmt: skip
    streamed = [x for c in chunks for x in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs


def test_echo_scores_a_batch_of_token_id_prompts_as_evaluation_harnesses_ask(server, smollm2):
    """lm-evaluation-harness's loglikelihood request (``local-completions``): a batch of token-id prompts,
    ``echo``, ``logprobs`` 1, ``max_tokens`` 1; a continuation's log-likelihood is the sum of its tokens'
    ``token_logprobs``, equal to one teacher-forced pass of our engine; a bad batch gets a 400."""
    context = smollm2.encode("The capital of France is")
    answers = [smollm2.tokenizer(a, add_special_tokens=False)["input_ids"] for a in (" Paris", " the city of Rome")]
    batch = [context + a for a in answers]
    hits = _metrics(server)["selfspec_prefix_cache_hits_total"]
    code, reply = post(f"{server.url}/v1/completions", json.dumps(
        {"model": MODEL, "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
         "echo": True}).encode())  # fmt: skip
    assert code == 200, reply
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    engine = smollm2.engine
    for ids, answer, choice in zip(batch, answers, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert choice["text"].startswith(smollm2.decode(ids))
        with torch.inference_mode():
            logits = engine.forward(engine.new_cache(len(ids) + 1), torch.tensor(ids), 0)
        table = torch.log_softmax(logits.float(), -1)
        want = sum(float(table[len(context) - 1 + j, t]) for j, t in enumerate(answer))
        assert sum(lp["token_logprobs"][len(context) : -1]) == pytest.approx(want, abs=1e-3)
        greedy = all(v == max(top.values()) for v, top in zip(lp["token_logprobs"][len(context) : -1],
                                                              lp["top_logprobs"][len(context) : -1], strict=True))
        assert greedy == (answer == answers[0]), "' Paris' is the model's own continuation, the other is not"
    assert reply["usage"]["prompt_tokens"] == sum(map(len, batch))
    if inexact_reason(engine) is None:  # the scoring pass's keys and values served each generation's prefill
        assert _metrics(server)["selfspec_prefix_cache_hits_total"] >= hits + len(batch)
    for bad, words in (([[1, 2, 10**9]], "vocabulary"), ([], "empty"), ([context] * 65, "at most 64")):
        code, reply = post(f"{server.url}/v1/completions", json.dumps({"prompt": bad, "max_tokens": 1}).encode())
        assert code == 400 and words in reply["error"]["message"], reply


def test_the_tokenizer_endpoints_agree_with_the_model(server, smollm2):
    """vLLM's /tokenizer_info, /tokenize, /detokenize (what lm-evaluation-harness's remote tokenizer reads)."""
    info = get(f"{server.url}/tokenizer_info")
    assert info["eos_token"] == smollm2.tokenizer.eos_token and info["chat_template"]
    assert info["model_max_length"] == smollm2.max_context
    code, reply = post(f"{server.url}/tokenize", json.dumps({"messages": CHAT}).encode())
    assert code == 200 and reply["tokens"] == smollm2.encode(CHAT) and reply["count"] == len(reply["tokens"])
    code, reply = post(f"{server.url}/tokenize", json.dumps({"prompt": "Hello world", "add_special_tokens": False}
                                                            ).encode())  # fmt: skip
    ids = reply["tokens"]
    assert code == 200 and smollm2.decode(ids) == "Hello world"
    code, reply = post(f"{server.url}/detokenize", json.dumps({"tokens": smollm2.encode(CHAT)}).encode())
    assert code == 200 and reply["prompt"] == smollm2.chat_text(CHAT), "special tokens kept: a faithful round trip"
    for path, body, words in (("/tokenize", {}, "either prompt or messages"),
                              ("/detokenize", {"tokens": [5, 10**8]}, "vocabulary"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "not served here")):  # fmt: skip
        code, reply = post(f"{server.url}{path}", json.dumps(body).encode())
        assert code in (400, 404) and words in reply["error"]["message"], reply


def test_a_suffix_needs_a_model_with_fill_in_the_middle_tokens(server, smollm2):
    """``suffix`` (fill in the middle): SmolLM2 has no such tokens, so a clear 400; token-id prompts or echo with
    a suffix are refused; an empty suffix asks for nothing (tests/test_extra_models.py fills on Qwen2.5-Coder)."""
    for body, words in (({"prompt": "def f(x):", "suffix": "\n    return y"}, "no fill-in-the-middle tokens"),
                        ({"prompt": [[1, 2, 3]], "suffix": "x"}, "text prompts"),
                        ({"prompt": "a", "suffix": "x", "echo": True}, "without echo")):  # fmt: skip
        code, reply = post(f"{server.url}/v1/completions", json.dumps({**body, "max_tokens": 4}).encode())
        assert code == 400 and words in reply["error"]["message"], reply
    code, reply = post(f"{server.url}/v1/completions", json.dumps({"prompt": "Hello", "suffix": "", "max_tokens": 4,
                                                                   "temperature": 0}).encode())  # fmt: skip
    assert code == 200 and reply["choices"][0]["text"] == selfspec.generate(smollm2, "Hello", "vanilla",
                                                                            max_new_tokens=4).text  # fmt: skip


def test_n_choices_are_the_seeds_one_after_another(server, smollm2):
    """``n``: choice i of a seeded request samples with seed + i (choice 0 is the request's answer with n=1);
    greedy, every choice is the same answer; streamed, the chunks of each index spell its choice."""
    client = server.client()
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "temperature": 0.9, "seed": 5}
    out = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        want = selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=20, temperature=0.9, seed=5 + c.index)
        assert c.message.content == want.text
    assert out.usage.completion_tokens == sum(
        len(selfspec.generate(smollm2, CHAT, "vanilla", max_new_tokens=20, temperature=0.9, seed=5 + i).token_ids)
        for i in range(3))  # fmt: skip
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    chunks = list(client.chat.completions.create(**kw, n=2, stream=True))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == out.choices[i].message.content
        assert sum(1 for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].finish_reason) == 1


def test_best_of_keeps_the_candidates_with_the_highest_mean_log_probability(server, smollm2):
    """best_of candidates are the seeds seed..seed+best_of-1 (as n's choices); the n kept are those whose tokens
    have the highest mean log-probability under the model, best first; not streamed."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 21, "best_of": 4, "n": 2}
    code, reply = post(f"{server.url}/v1/completions", json.dumps(body).encode())
    assert code == 200, reply
    scored, generated = [], 0
    for i in range(4):
        r = selfspec.generate(smollm2, "Once upon a time", "vanilla", max_new_tokens=12, temperature=1.0,
                              seed=21 + i, logprobs=0)  # fmt: skip
        scored.append((sum(e.logprob for e in r.logprobs) / len(r.logprobs), r.text))
        generated += len(r.token_ids)
    want = [text for _, text in sorted(scored, reverse=True)[:2]]
    assert [c["text"] for c in reply["choices"]] == want and [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["choices"][0]["logprobs"] is None  # not asked for: used for the ranking only
    assert reply["usage"]["completion_tokens"] == generated  # every candidate's tokens count
    assert len({text for _, text in scored}) > 2  # the candidates differ: the ranking chose
    for bad, words in (({"best_of": 1, "n": 2}, "at least n"), ({"best_of": 3, "stream": True}, "cannot be streamed"),
                       ({"best_of": 9}, "best_of")):  # fmt: skip
        code, reply = post(f"{server.url}/v1/completions", json.dumps({"prompt": "Hi", **bad}).encode())
        assert code == 400 and words in reply["error"]["message"], reply


def _stream_and_hang_up(url: str, max_tokens: int) -> None:
    """Streams a long chat answer and closes the connection after a few chunks."""
    body = json.dumps({"messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        for _ in range(6):
            r.readline()


def test_a_client_that_leaves_mid_stream_stops_its_generation(server):
    _stream_and_hang_up(server.url, 500)
    deadline = time.time() + 20
    while get(f"{server.url}/health")["queue"] and time.time() < deadline:
        time.sleep(0.2)
    assert get(f"{server.url}/health")["queue"] == 0, "the generation stopped"


def test_load_every_request_answered_or_refused_never_mixed(server, smollm2):
    prompts = [f"Write the number {i} in words." for i in range(8)]
    expected = {p: selfspec.generate(smollm2, p, "vanilla", max_new_tokens=12).text for p in prompts}
    client = server.client(max_retries=0)
    results: list[tuple[str, str]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        p = prompts[i % len(prompts)]
        try:
            out = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
            got = ("ok", out.choices[0].text)
        except RateLimitError as exc:
            got = ("refused", str(exc.response.headers.get("retry-after")))
        with lock:
            results.append((p, got))

    threads = [threading.Thread(target=lambda k=k: [one(k * 5 + j) for j in range(5)]) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 40, "no request lost"
    answered = [(p, text) for p, (kind, text) in results if kind == "ok"]
    refused = [r for _, (kind, r) in results if kind == "refused"]
    assert answered and all(text == expected[p] for p, text in answered), "no tokens mixed between requests"
    assert refused and all(r == "2" for r in refused), "a full queue refuses with 429 and Retry-After"
    assert get(f"{server.url}/health")["status"] == "ok"
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'status="429"' in metrics and "selfspec_tokens_per_second" in metrics


def test_state_survives_a_restart_and_a_corrupt_state_is_set_aside(tmp_path):
    state = tmp_path / "state.json"
    srv = Server("--api-key", "k3y", state=state)
    try:
        with pytest.raises(Exception, match="401"):
            srv.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        code, reply = post(f"{srv.url}/tokenize", json.dumps({"prompt": "hi"}).encode())
        assert code == 401, "the tokenizer's endpoints need the key too"
        client = srv.client(api_key="k3y")
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, temperature=0,
                                       extra_body={"selfspec": {"method": "swift"}})  # fmt: skip
        assert not get(f"{srv.url}/health")["state_loaded"]
    finally:
        code, err = srv.stop()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it so that the parent sees how it ended
    assert code in (0, -signal.SIGTERM) and "Traceback" not in err
    assert f"state saved to {state}" in err
    saved = json.loads(state.read_text())
    assert saved and all("best" in entry for entry in saved.values())
    srv = Server("--method", "swift", state=state)
    try:
        assert get(f"{srv.url}/health")["state_loaded"]
    finally:
        srv.stop()
    state.write_text("{ this is not json")
    srv = Server(state=state)
    try:
        assert get(f"{srv.url}/health")["status"] == "ok"
    finally:
        _, err = srv.stop()
    assert "unreadable" in err or "not JSON" in err
    assert list(tmp_path.glob("state.json.corrupt-*")), "the corrupt file was kept aside, not overwritten"


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_playground_in_a_headless_browser(server, smollm2):
    """A prompt typed into the page, streamed text appears, the statistics update; a screenshot for docs/."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    browser_path = _browser()
    if browser_path is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's chromium when it can)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.querySelectorAll('#method option').length > 0")
            page.fill("#prompt", "List three fruits.")
            page.fill("#max_tokens", "40")
            page.click("#send")
            page.wait_for_function("document.getElementById('stats').textContent.includes('acceptance')",
                                   timeout=60_000)  # fmt: skip
            text = page.inner_text("#out")
            stats = page.inner_text("#stats")
            shot = Path(__file__).parent.parent / "docs" / "playground.png"
            if os.environ.get("SELFSPEC_SCREENSHOT"):
                page.screenshot(path=str(shot))
        finally:
            browser.close()
    expected = selfspec.generate(smollm2, [{"role": "user", "content": "List three fruits."}], "vanilla",
                                 max_new_tokens=40).text  # fmt: skip
    assert text.strip() == expected.strip(), "the streamed text is the model's greedy reply"
    assert "tokens/s" in stats and "acceptance" in stats


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}  # fmt: skip


def test_a_second_turn_reuses_the_first_and_answers_as_a_fresh_prefill(server, smollm2):
    """The chat resends the conversation: its first turn's prompt and answer come from the prefix cache, and the
    answer is the one a whole prefill gives; /metrics counts the hit, the reused tokens, time to first token."""
    from selfspec.core.prefix_store import inexact_reason

    if inexact_reason(smollm2.engine) is not None:
        pytest.skip(f"this machine's default path refuses reuse: {inexact_reason(smollm2.engine)}")
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    before = _metrics(server)
    turn2 = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Now say it in one short sentence."}]  # fmt: skip
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=40, temperature=0)
    assert second.choices[0].message.content == selfspec.generate(smollm2, turn2, "vanilla", max_new_tokens=40).text
    after = _metrics(server)
    assert after["selfspec_prefix_cache_hits_total"] >= before["selfspec_prefix_cache_hits_total"] + 1
    reused = after["selfspec_prefix_cache_reused_tokens_total"] - before["selfspec_prefix_cache_reused_tokens_total"]
    assert reused >= len(smollm2.encode(CHAT))
    ttft = "selfspec_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after["selfspec_queue_wait_seconds_count"] >= before["selfspec_queue_wait_seconds_count"] + 1
    assert 0 < after["selfspec_prefix_cache_bytes"] <= after["selfspec_prefix_cache_max_bytes"]


def test_concurrent_requests_decode_together_and_answer_as_alone(smollm2):
    """serve --parallel 3: requests of mixed methods, lengths and sampling at once, one client leaving
    mid-stream; every answer is the one the request gets alone, and rounds of several requests shared passes."""
    srv = Server("--parallel", "3", "--queue-size", "8", "--max-tokens", "512")
    try:
        prompts = ["Name three colours.", "Write a haiku about the sea.", "What is 12 times 7?",
                   "List the planets of the solar system."]  # fmt: skip
        jobs = [(prompts[0], "vanilla", 40, {}), (prompts[1], "pld", 56, {}), (prompts[2], "asd", 24, {}),
                (prompts[3], "auto", 48, {"temperature": 0.8, "top_p": 0.95, "seed": 5}),
                (prompts[1], "swift", 32, {})]  # fmt: skip
        results = [selfspec.generate(smollm2, [{"role": "user", "content": p}], "vanilla", max_new_tokens=n,
                                     logprobs=2, **kw) for p, _, n, kw in jobs]  # fmt: skip
        alone = [r.text for r in results]
        client = srv.client(max_retries=0)
        got: dict[int, str] = {}
        figures: dict[int, list[float]] = {}

        def one(i: int) -> None:
            p, method, n, kw = jobs[i]
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=n,
                                                 temperature=kw.get("temperature", 0), top_p=kw.get("top_p", 1.0),
                                                 seed=kw.get("seed"), extra_body={"selfspec": {"method": method}},
                                                 logprobs=True, top_logprobs=2)  # fmt: skip
            got[i] = out.choices[0].message.content
            figures[i] = [t.logprob for c in out.choices[0].logprobs.content for t in (c, *c.top_logprobs)]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
        threads.append(threading.Thread(target=_stream_and_hang_up, args=(srv.url, 400)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert got == dict(enumerate(alone)), "each request's answer is its answer alone"
        assert any(r.stats.stop_reason == "eos" for r in results), "an answer's end of sequence is reported too"
        for i, r in enumerate(results):  # and its tokens' log-probabilities (float32 rounding at most)
            want = [x for e in r.logprobs for x in (e.logprob, *(lp for _, lp in e.top))]
            assert figures[i] == pytest.approx(want, abs=1e-4)
        deadline = time.time() + 30
        while get(f"{srv.url}/health")["queue"] and time.time() < deadline:
            time.sleep(0.2)
        assert get(f"{srv.url}/health")["queue"] == 0, "the client that left stopped its generation"
        m = _metrics(srv)
        assert m["selfspec_batch_members"] == 0
        assert m["selfspec_batch_sequences_total"] > m["selfspec_batch_passes_total"] > 0, "requests shared passes"
        # one request's n choices take the free slots and decode together, each the one it gets alone
        kw = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 21}
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0.9, top_p=0.95,
                                             seed=21, n=3)  # fmt: skip
        for c in out.choices:
            assert c.message.content == selfspec.generate(smollm2, CHAT, "vanilla", **{**kw, "seed": 21 + c.index}).text
        after = _metrics(srv)
        sequences = after["selfspec_batch_sequences_total"] - m["selfspec_batch_sequences_total"]
        passes = after["selfspec_batch_passes_total"] - m["selfspec_batch_passes_total"]
        assert sequences > passes > 0, "the choices shared passes"
    finally:
        srv.stop()
