"""S3D on tiny models: training runs, resumes and learns; decoding with the adapter is exactly vanilla's."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

import selfspec
from selfspec.decoding.loop import Decoder
from selfspec.drafters.s3d import S3DAdapter, S3DConfig
from selfspec.errors import InvalidInputError
from selfspec.methods import build_policies
from selfspec.train.s3d import train_s3d
from selfspec.train.s3d_speed import alpha_of_beta, conditional_acceptance, fit_u, improvement_factor, optimum, tau

PROMPT = "The quick brown fox jumps over the lazy dog; sliding windows must hold over long prompts too."
FAST = {"prompts": 3, "new_tokens": 24, "progress": False}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = tiny_model("llama")
    out = tmp_path_factory.mktemp("s3d")
    result = train_s3d(model, out, steps=40, config=S3DConfig(2, 4, gamma=3, rank=4), **FAST)
    return model, out, result


def test_training_writes_every_file_and_lowers_the_loss(trained):
    _, out, result = trained
    for name in ("adapter.pt", "config.json", "loss.png", "checkpoint.pt", "data.jsonl"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["skip_from"] == 2 and meta["steps"] == 40 and "self-distilled" in meta["data"]
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def test_training_resumes_from_its_checkpoint(trained, tmp_path):
    model, out, result = trained
    copy = tmp_path / "resume"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    more = train_s3d(model, copy, steps=45, **FAST)  # config comes from the checkpoint
    assert more.steps == 45 and len(more.losses) == 45
    assert more.losses[:40] == result.losses
    assert json.loads((copy / "config.json").read_text())["steps"] == 45


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_s3d_greedy_equals_vanilla(arch, tmp_path):
    model = tiny_model(arch)
    train_s3d(model, tmp_path, steps=10, config=S3DConfig(2, 4, gamma=4, rank=4), **FAST)
    base = selfspec.generate(model, PROMPT, "vanilla", max_new_tokens=40)
    for options in ({}, {"gamma": 2}, {"draft_dtype": "same"}):
        out = selfspec.generate(model, PROMPT, "s3d", max_new_tokens=40, adapter=str(tmp_path), **options)
        assert out.token_ids == base.token_ids, options
        s = out.stats
        assert s.drafted > 0 and s.draft_forwards < s.drafted, "several tokens per draft pass"


def test_the_trained_draft_beats_the_untrained_one(trained):
    """On a prompt it was trained on, the trained draft predicts the model's continuation better."""
    model, out, _ = trained
    row = json.loads((out / "data.jsonl").read_text().splitlines()[0])
    rates = []
    for adapter in (S3DAdapter(model, S3DConfig(2, 4, gamma=3, rank=4)), S3DAdapter.load(model, out)):
        skip_policy, drafter = build_policies("s3d", {"adapter": adapter, "draft_dtype": "same"})
        dec = Decoder(model, row["prompt_ids"], max_new_tokens=24, method="s3d", skip_policy=skip_policy,
                      draft_policy=drafter)  # fmt: skip
        assert [t for new in dec for t in new] == row["ids"]  # (lossless, as always)
        rates.append(dec.stats.accepted / dec.stats.drafted)
    assert rates[1] > rates[0], rates


def test_adapters_are_off_outside_draft_passes(trained):
    """After training and drafting, the full model's logits are still transformers' own."""
    model, out, _ = trained
    selfspec.generate(model, PROMPT, "s3d", max_new_tokens=20, adapter=str(out))
    ids = torch.tensor([model.encode(PROMPT)])
    with torch.inference_mode():
        ref = model.hf(ids).logits[0]
        cache = model.engine.new_cache(ids.shape[1])
        ours = model.engine.forward(cache, ids[0], 0)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_clear_errors(trained, tmp_path):
    model, out, _ = trained
    with pytest.raises(InvalidInputError, match="needs an adapter"):
        selfspec.generate(model, PROMPT, "s3d", max_new_tokens=5)
    with pytest.raises(InvalidInputError, match="not an S3D adapter"):
        selfspec.generate(model, PROMPT, "s3d", max_new_tokens=5, adapter=str(tmp_path))
    other = tiny_model("llama", seed=1, num_hidden_layers=3)
    with pytest.raises(InvalidInputError, match="trained for"):
        selfspec.generate(other, PROMPT, "s3d", max_new_tokens=5, adapter=str(out))
    for bad in (S3DConfig(0, 3), S3DConfig(2, 6), S3DConfig(3, 3)):
        with pytest.raises(InvalidInputError, match="skip range"):
            bad.check(model.num_layers)
    with pytest.raises(InvalidInputError, match="gamma"):
        selfspec.generate(model, PROMPT, "s3d", max_new_tokens=5, adapter=str(out), gamma=0)


def test_cli_trains_and_generates(tmp_path, capsys):
    """The command line end to end on a tiny model saved as a local directory."""
    model = tiny_model("llama")
    model_dir = tmp_path / "tiny"
    model.hf.save_pretrained(model_dir)
    model.tokenizer.save_pretrained(model_dir)
    from selfspec.cli import main

    adapter = tmp_path / "adapter"
    assert main(["train-s3d", "--model", str(model_dir), "--out", str(adapter), "--steps", "3", "--skip", "2-3",
                 "--prompts", "2", "--new-tokens", "12", "--no-progress"]) == 0  # fmt: skip
    assert main(["generate", "--model", str(model_dir), "--method", "s3d", "--adapter", str(adapter), "--raw",
                 "--prompt", PROMPT, "--max-new-tokens", "12", "--compare", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical"] is True
    assert main(["train-s3d", "--model", str(model_dir), "--out", str(adapter), "--skip", "oops"]) == 2


# -- the speed model (eq. 10-12) -------------------------------------------------------------------


def test_eq10_limits_and_fit():
    for u in (0.01, 0.5, 3.0):
        assert alpha_of_beta(1.0, u) == pytest.approx(1.0)
        assert alpha_of_beta(0.0, u) == pytest.approx(0.0)
    points = [(b, alpha_of_beta(b, 0.05)) for b in (0.3, 0.5, 0.7)]
    assert fit_u(points) == pytest.approx(0.05, rel=0.03)


def test_eq11_tau_and_eq12():
    assert tau([0.0, 0.0]) == pytest.approx(1.0)  # nothing accepted: the bonus token only
    assert tau([1.0, 1.0, 1.0]) == pytest.approx(4.0)  # everything: gamma + 1
    assert tau([0.5]) == pytest.approx(1 * 0.5 + 2 * 0.5)
    assert improvement_factor([1.0, 1.0, 1.0], beta=0.5, delta=0.5) == pytest.approx(2.0)
    assert conditional_acceptance([0, 1, 2, 2], 3) == [0.75, 2 / 3, 0.0]
    b, g, val = optimum(u=0.05, d=[1.0, 0.8, 0.6, 0.5], delta=0.1)
    assert 0.05 <= b <= 0.95 and g >= 1 and val > 1.0
