"""Every bad input gives a clear one-line error, never a traceback from deep inside PyTorch."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

import selfspec
from selfspec.cli import main
from selfspec.errors import InvalidInputError, ModelNotFoundError, SelfspecError, UnsupportedModelError


@pytest.fixture(scope="module")
def small_ctx():
    return tiny_model("llama", max_position_embeddings=64)


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'.*smollm2-135m"):
        selfspec.load("no-such-model")


def test_hub_id_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="hub"):
        selfspec.load("some-org/some-model-that-is-not-cached")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        selfspec.load(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported: llama"):
        selfspec.load(str(tmp_path))


def test_unsupported_in_memory_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(UnsupportedModelError):
        selfspec.model_from_hf(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), None)


def test_corrupt_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\x01garbage" * 100)
    with pytest.raises(SelfspecError, match="corrupt or truncated|could not read GGUF file"):
        selfspec.load(str(bad))


@pytest.mark.parametrize("prompt", ["", "   \n ", [], [{"role": "user", "content": ""}], [{"content": "no role"}]])
def test_empty_or_malformed_prompt(small_ctx, prompt):
    with pytest.raises(InvalidInputError):
        selfspec.generate(small_ctx, prompt, "asd", max_new_tokens=4)


def test_prompt_longer_than_context(small_ctx):
    with pytest.raises(InvalidInputError, match="longer than the model's context of 64"):
        selfspec.generate(small_ctx, "x" * 100, "vanilla", max_new_tokens=4)


def test_prompt_plus_new_tokens_exceed_context(small_ctx):
    with pytest.raises(InvalidInputError, match="exceeds the model's context"):
        selfspec.generate(small_ctx, "x" * 40, "asd", max_new_tokens=40)


@pytest.mark.parametrize(
    "method, options, match",
    [
        ("nope", {}, "unknown method"),
        ("asd", {"alpha": 1.5}, "alpha"),
        ("asd", {"m": 0}, "m must be"),
        ("asd", {"bogus": 1}, "no option"),
        ("asd", {"max_draft": 0}, "max_draft"),
        ("asd", {"draft_length": -2}, "draft_length"),
        ("asd", {"alpha": "high"}, "bad option value"),
        ("static", {}, "needs a skip set"),
        ("static", {"skip_set": {"attention": [99]}}, "0-based"),
        ("vanilla", {"alpha": 0.9}, "no option"),
    ],
)
def test_invalid_method_options(small_ctx, method, options, match):
    with pytest.raises(InvalidInputError, match=match):
        selfspec.generate(small_ctx, "hello", method, max_new_tokens=4, **options)


def test_invalid_max_new_tokens(small_ctx):
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        selfspec.generate(small_ctx, "hello", "vanilla", max_new_tokens=0)


def test_chat_prompt_on_model_without_template(small_ctx):
    small_ctx.tokenizer.chat_template, saved = None, small_ctx.tokenizer.chat_template
    try:
        with pytest.raises(InvalidInputError, match="no chat template"):
            selfspec.generate(small_ctx, [{"role": "user", "content": "hi"}], "vanilla", max_new_tokens=2)
    finally:
        small_ctx.tokenizer.chat_template = saved


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model"),
        (["generate", "--method", "nope", "--prompt", "hi"], "unknown method"),
        (["generate", "--alpha", "7", "--prompt", "hi"], "alpha"),
        (["generate", "--method", "static", "--skip-set", "{oops", "--prompt", "hi"], "not valid JSON"),
        (["generate", "--max-new-tokens", "0", "--prompt", "hi"], "max-new-tokens"),
        (["generate", "--dtype", "float8", "--prompt", "hi"], "unknown dtype"),
        (["generate", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
        (["generate", "--logprobs", "21", "--prompt", "hi"], "between 0 and 20"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec: error:") and match in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_generate_json_reports_logprobs(capsys):
    assert main(["generate", "--prompt", "Hello there", "--max-new-tokens", "6", "--method", "pld", "--logprobs",
                 "2", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    entries = out["logprobs"]
    assert [e["token"] for e in entries] == out["token_ids"]
    assert all(e["logprob"] <= 0 and len(e["top"]) == 2 and e["top"][0][2] >= e["logprob"] for e in entries)


def test_cli_models_json(capsys):
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in listed} >= {"smollm2-135m", "gemma3-270m"}
    assert all(isinstance(m["installed"], bool) for m in listed)
