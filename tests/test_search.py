"""Draft & Verify's offline skip-set search on a tiny model: end to end, resumable, and its file used losslessly."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

import selfspec
from selfspec import InvalidInputError, SkipSet
from selfspec.datasets import PromptItem
from selfspec.search import offline as search_mod
from selfspec.search.offline import param_names, search_skip_set, seed_skip_sets, to_params, to_skip_set

PROMPTS = [
    PromptItem("a", "prose", "The quick brown fox jumps over the lazy dog and runs far away."),
    PromptItem("b", "code", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"),
]
CALIB = {"dataset": "unit", "offset": 0, "limit": 2}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=5)


def _search(model, out, iterations, **kw):
    kw.setdefault("init_points", 2)
    return search_skip_set(
        model, PROMPTS, iterations=iterations, out=out, calibration_info=CALIB, max_new_tokens=8, **kw
    )


def test_encoding_round_trip():
    skip = SkipSet.of([1, 4], [2])
    params = to_params(skip, 6)
    assert len(params) == 12 == len(param_names(6))
    assert to_skip_set(params, 6) == skip
    assert param_names(12)[:2] == ["attn00", "attn01"] and param_names(12)[12] == "mlp00"


def test_seeds_never_skip_first_or_last_layer():
    seeds = seed_skip_sets(8, None)
    assert set(seeds) == {"swift-uniform", "attention-every-other"}
    assert seeds["swift-uniform"] == SkipSet.of([1, 3, 5], [1, 3, 5])
    for s in seeds.values():
        assert not ({0, 7} & (s.attention | s.mlp))


def test_cosine_seeds_skip_the_sublayers_that_change_the_least():
    from selfspec.model.engine import SublayerCosine

    attention = (0.99, 0.5, 0.97, 0.98, 0.6, 0.7, 0.96, 0.999)  # layers 0 and 7 are never skipped
    mlp = (0.1, 0.2, 0.3, 0.995, 0.4, 0.5, 0.6, 0.7)
    seeds = seed_skip_sets(8, SublayerCosine(attention, mlp))
    assert seeds["cosine-top-attention-L/8"] == SkipSet.of([3], [])
    assert seeds["cosine-top-attention-L/4"] == SkipSet.of([3, 2], [])
    assert seeds["cosine-top-attention-L/2"] == SkipSet.of([3, 2, 6, 5], [])
    assert seeds["cosine-top-sublayers-L/4"] == SkipSet.of([3], [3])
    assert len(set(seeds.values())) == len(seeds)  # duplicates are probed once


def test_search_end_to_end_writes_a_file_that_static_uses_losslessly(model, tmp_path, monkeypatch):
    calls = []
    real = search_mod.Calibration.measure

    def counting(self, method, **options):
        calls.append(options.get("skip_set"))
        return real(self, method, **options)

    monkeypatch.setattr(search_mod.Calibration, "measure", counting)
    out = tmp_path / "skips.json"
    result = _search(model, out, iterations=12)
    state = result.state
    assert len(state.observations) == 12 and result.new_observations == 12 and result.stop_reason == "iterations"
    sources = [o.source for o in state.observations]
    n_seeds = sum(s.startswith("seed:") for s in sources)
    assert 4 <= n_seeds <= 7
    assert sources[:4] == ["seed:swift-uniform", "seed:attention-every-other", "seed:asd-admg",
                           "seed:cosine-top-attention-L/8"]  # fmt: skip
    assert sources[n_seeds : n_seeds + 2] == ["random", "random"] and set(sources[n_seeds + 2 :]) == {"bo"}
    # vanilla once, then each distinct non-empty skip set exactly once
    distinct = {(tuple(o.attention), tuple(o.mlp)) for o in state.observations if o.attention or o.mlp}
    assert calls[0] is None and len(calls) == 1 + len(distinct)
    assert sum(o.measured for o in state.observations) == len(distinct)

    best = state.best
    assert best.speedup == max(o.speedup for o in state.observations)
    data = json.loads(out.read_text())
    assert data["attention"] == best.attention and data["mlp"] == best.mlp
    assert data["model"] == model.name and data["calibration"] == {**CALIB, "prompts": 2, "max_new_tokens": 8}
    assert data["objective"]["speedup_vs_vanilla_decode"] == round(best.speedup, 4) and "date" in data

    for method in ("static", "selfsd"):
        base = selfspec.generate(model, PROMPTS[0].prompt, "vanilla", max_new_tokens=24)
        spec = selfspec.generate(model, PROMPTS[0].prompt, method, max_new_tokens=24, skip_set=str(out))
        assert spec.token_ids == base.token_ids
        assert spec.stats.skip_set["attention"] == best.attention


def test_search_resumes_from_its_state(model, tmp_path):
    out = tmp_path / "s.json"
    first = _search(model, out, iterations=4)
    state_file = tmp_path / "s.json.state.json"
    assert state_file.is_file()
    saved = json.loads(state_file.read_text())
    assert len(saved["observations"]) == 4
    second = _search(model, out, iterations=7)
    assert second.new_observations == 3 and len(second.state.observations) == 7
    assert second.state.vanilla_tokens_per_second == first.state.vanilla_tokens_per_second  # not re-measured
    assert [o.params for o in second.state.observations[:4]] == [o.params for o in first.state.observations]
    assert [o.source for o in second.state.observations].count("seed:swift-uniform") == 1
    assert _search(model, out, iterations=7).new_observations == 0  # already done


def test_state_of_another_search_is_refused(model, tmp_path):
    out = tmp_path / "s.json"
    _search(model, out, iterations=1)
    with pytest.raises(InvalidInputError, match="belongs to another search"):
        search_skip_set(model, PROMPTS, iterations=2, out=out, calibration_info={**CALIB, "offset": 5},
                        max_new_tokens=8)  # fmt: skip


def test_corrupt_state_is_a_clear_error(model, tmp_path):
    out = tmp_path / "s.json"
    (tmp_path / "s.json.state.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="unreadable"):
        _search(model, out, iterations=2)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"iterations": 0}, "iterations must be >= 1"),
        ({"iterations": 2, "time_budget": 0}, "time budget must be > 0"),
        ({"iterations": 2, "time_budget": 1e-9}, "no observation"),
        ({"iterations": 2, "draft_options": {"alpha": 1}}, "unknown draft option"),
    ],
)
def test_bad_search_arguments(model, tmp_path, kw, message):
    with pytest.raises(InvalidInputError, match=message):
        _search(model, tmp_path / "x.json", **kw)


def test_cli_search(model, tmp_path, monkeypatch, capsys):
    import selfspec.model.models
    from selfspec.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt}) + "\n" for p in PROMPTS))
    monkeypatch.setattr(selfspec.model.models, "load", lambda *a, **k: model)
    out = tmp_path / "cli.json"
    argv = ["search", "--dataset", str(data), "--limit", "2", "--max-new-tokens", "6", "--iterations", "4",
            "--init-points", "1", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "best skip set" in capsys.readouterr().err
    assert SkipSet.parse(str(out)).meta["calibration"]["dataset"] == str(data)
    assert main([*argv[:-3], "--iterations", "0", "--out", str(out)]) == 2
    assert main(["search", "--out", str(out), "--dataset", "nope"]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
