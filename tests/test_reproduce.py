"""``selfspec reproduce``: every target end to end on a tiny random model, its files, and bad input."""

from __future__ import annotations

import json
import math

import pytest
from conftest import tiny_model

import selfspec
from selfspec import InvalidInputError
from selfspec.cli import reproduce as reproduce_cli
from selfspec.datasets import PromptItem
from selfspec.policies.swift import uniform_skip_set
from selfspec.reproduce import TARGETS, ReproduceOptions, common, s3d_figure5, write_reproduction

PROSE = [
    PromptItem("a", "summarization", "The quick brown fox jumps over the lazy dog and runs far away."),
    PromptItem("b", "summarization", "Once upon a time, in a land of sliding windows, a cache grew long."),
    PromptItem("c", "qa", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"),
]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3, max_position_embeddings=4096)


def _opts(tmp_path, **kw) -> ReproduceOptions:
    base = dict(limit=2, max_new_tokens=10, out_dir=tmp_path / "out", command="selfspec reproduce test",
                warmup=0, progress=False)  # fmt: skip
    return ReproduceOptions(**{**base, **kw})


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _run(name, model, tmp_path, prompts=PROSE[:2], **kw):
    opts = _opts(tmp_path, **kw)
    rep = TARGETS[name].run(model, opts, prompts)
    paths = write_reproduction(rep, opts.out_dir)
    report = paths["report"].read_text()
    data = json.loads(paths["json"].read_text())
    assert data["target"] == name and data["setup"]["model"] == "tiny-llama"
    assert data["setup"]["command"] == "selfspec reproduce test" and data["setup"]["machine"]["cores"]
    assert "Command: `selfspec reproduce test`" in report and "Machine:" in report
    assert paths["records"].read_text().count("\n") == len(rep.bench.records)
    for row in rep.paper.rows:  # the paper's figures, exactly as quoted, in the report
        assert f"| {' | '.join(c.replace('|', chr(92) + '|') for c in row)} |" in report
    return rep, paths, report, data


def test_asd_table5(model, tmp_path):
    rep, _, report, data = _run("asd-table5", model, tmp_path)
    assert "1.307×" in report and "1.443×" in report and "Llama-2-13B" in report and "CNN/DM" in report
    for variant in ("cs", "cs+r2", "r1+r2", "admg"):
        assert f"| {variant} |" in report
        assert _finite(data["data"][variant]["speedup"]) and data["data"][variant]["prompts"] == 2
        assert data["data"][variant]["lossless"] is True
        assert data["data"][f"auto-{variant}"]["lossless"] is True
        assert data["setup"]["specs"][f"auto-{variant}"]["options"]["variant"] == variant
    assert [r[1] for r in rep.ours.rows] == ["cs", "cs+r2", "r1+r2", "admg", "all"]
    assert "order" in data["data"]["order"]["chosen"] and data["data"]["order"]["chosen"] in report


def test_asd_table5_reads_the_papers_order_from_the_numbers():
    from selfspec.reproduce.asd_table5 import order_note

    holds = order_note({"cs": 1.0, "cs+r2": 1.1, "r1+r2": 0.9, "admg": 1.1}, "Chosen")
    assert "order holds" in holds and "1.10x" in holds
    broken = order_note({"cs": 1.2, "cs+r2": 1.0, "r1+r2": 1.3, "admg": 1.1}, "Chosen")
    assert "does not hold" in broken and "cs (1.20x)" in broken and "r1+r2 (1.30x)" in broken
    assert "cs+r2" not in broken
    assert "cannot be read" in order_note({"cs": 1.0, "cs+r2": None, "r1+r2": 1.0, "admg": 1.0}, "Chosen")


def test_swift_table8(model, tmp_path):
    rep, _, report, data = _run("swift-table8", model, tmp_path)
    assert "| w/o early-stopping | 11.16 | 0.43 | 0.896× |" in report
    assert "| w/o optimization | 2.15 | 0.90 | 1.224× |" in report
    labels = ["swift", "no-early-stop", "no-dynamic-ver", "no-optimisation"]
    assert [r[1] for r in rep.ours.rows] == labels
    for label in labels:
        d = data["data"][label]
        assert _finite(d["speedup"]) and _finite(d["M"]) and d["lossless"] is True
    assert data["setup"]["specs"]["no-optimisation"]["options"]["max_steps"] == 0
    no_stop = [r for r in rep.bench.by_method("no-early-stop")]
    assert all(r.stats["drafted"] >= r.stats["forwards"] - 1 for r in no_stop)  # drafts every round


def test_swift_figure7_stream_and_plot(model, tmp_path):
    rep, paths, report, data = _run("swift-figure7", model, tmp_path, prompts=PROSE)
    assert "| Summarization | CNN/DM | 1.28x | 1.56x |" in report and "92% to 68%" in report
    assert [r[1] for r in rep.ours.rows] == ["summarization", "qa"]
    assert set(data["data"]["tasks"]) == {"summarization", "qa"}
    # the tiny model has no searched skip set: SWIFT's best set after the first task is Self-SD's
    assert (tmp_path / "out" / "selfsd-skipset.json").is_file()
    assert "first task" in data["data"]["selfsd_skip_set_source"]
    stream = data["data"]["per_prompt"]
    assert [p["task"] for p in stream] == ["summarization", "summarization", "qa"]
    assert all(_finite(p["swift"]["speedup"]) and _finite(p["self-sd"]["speedup"]) for p in stream)
    assert paths["plot"].read_bytes()[:8] == PNG


def test_s3d_figure5_trains_fits_and_plots(model, tmp_path, monkeypatch):
    monkeypatch.setattr(s3d_figure5, "TRAIN_TEXTS", 2)
    monkeypatch.setattr(s3d_figure5, "TRAIN_NEW_TOKENS", 12)
    rep, paths, report, data = _run("s3d-figure5", model, tmp_path, prompts=PROSE[:1], train_steps=2, limit=1)
    assert "β → 0.5" in report and "optimal γ is 4" in report
    configs = s3d_figure5.skip_configs(model.num_layers)
    assert len(data["data"]["adapters"]) == len(configs) >= 2
    assert len(rep.ours.rows) == len(configs) * len(s3d_figure5.GAMMAS)
    fit = data["data"]["fit"]
    assert _finite(fit["U"]) and _finite(fit["delta"]) and 1 <= fit["optimum_eq12"]["gamma"] <= 5
    for m in data["data"]["measurements"]:
        assert 0 < m["beta"] < 1 and _finite(m["speedup"]) and m["speedup"] > 0
    assert paths["plot"].read_bytes()[:8] == PNG
    # the trained adapters can be passed back with --adapter: nothing is trained again
    again = TARGETS["s3d-figure5"].run(model, _opts(tmp_path, adapters=tuple(data["data"]["adapters"]), limit=1),
                                       PROSE[:1])  # fmt: skip
    assert len(again.ours.rows) == len(rep.ours.rows)


def test_swift_max_steps_zero_keeps_the_uniform_starting_set(model):
    session = selfspec.Session(model, "swift", max_steps=0, draft_dtype="same", context_window=4)
    session.generate(PROSE[0].prompt, max_new_tokens=24)
    state = session.skip_policy.state
    assert state.steps == 0 and state.best_set == uniform_skip_set(model.num_layers)
    with pytest.raises(InvalidInputError, match="max_steps must be >= 0"):
        selfspec.Session(model, "swift", max_steps=-1)


# -- the command line -----------------------------------------------------------------------


def _main(argv):
    from selfspec.cli import main

    return main(argv)


def test_cli_end_to_end(model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(reproduce_cli, "load_model", lambda args: model)
    monkeypatch.setattr(common, "load_prompts", lambda *a, **kw: PROSE[:1])
    out = tmp_path / "t5"
    code = _main(["reproduce", "asd-table5", "--limit", "1", "--max-new-tokens", "6", "--warmup", "0",
                  "--no-progress", "--out", str(out)])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "1.443×" in err and "admg" in err
    assert f"selfspec reproduce asd-table5 --model smollm2-135m --limit 1 --max-new-tokens 6 --out {out}" in err
    assert {p.name for p in out.iterdir()} == {"report.md", "result.json", "results.jsonl"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope"], "unknown reproduction target 'nope'; choose one of asd-table5, swift-table8"),
        (["asd-table5", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["swift-table8", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
        (["asd-table5", "--adapter", "x"], "--adapter applies to s3d-figure5 only"),
    ],
)
def test_cli_bad_input_is_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(reproduce_cli, "load_model", lambda args: pytest.fail("the model must not load"))
    assert _main(["reproduce", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_bad_adapter_is_one_line(model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(reproduce_cli, "load_model", lambda args: model)
    assert _main(["reproduce", "s3d-figure5", "--adapter", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "is not an S3D adapter directory" in err and "Traceback" not in err
