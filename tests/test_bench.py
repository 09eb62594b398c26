"""The benchmark harness on a tiny model: specs, fair runs, summaries, files, the CLI, and lossy detection."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

from selfspec import InvalidInputError
from selfspec.bench import parse_methods, parse_spec, run_benchmark, summarize, write_outputs
from selfspec.bench import runner as bench_runner
from selfspec.bench.summary import expected_speedup
from selfspec.cli import bench as bench_cli
from selfspec.core.skipset import SkipSet
from selfspec.datasets import PromptItem

PROMPTS = [
    PromptItem("a", "prose", "The quick brown fox jumps over the lazy dog and runs far away."),
    PromptItem("b", "prose", "Once upon a time, in a land of sliding windows, a cache grew long."),
    PromptItem("c", "code", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"),
]
METHODS = "asd:preset=paper@asd,asd:alpha=0.5:draft_length=3@asd-wide,hf,hf-lookup:tokens=4,hf-early-exit:3"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def run(model):
    return run_benchmark(model, PROMPTS, METHODS, max_new_tokens=24, warmup=1)


# -- method specs ---------------------------------------------------------------------------


def test_parse_spec_options_positional_and_label(tmp_path):
    m = parse_spec("asd:alpha=0.99:m=4@strict")
    assert (m.name, m.options, m.label) == ("asd", {"alpha": 0.99, "m": 4}, "strict")
    assert parse_spec("hf-early-exit:8").options == {"layer": 8}
    assert parse_spec("hf-lookup").label == "hf-lookup"
    path = tmp_path / "7.json"
    SkipSet(attention=frozenset({1}), mlp=frozenset()).save(path)
    s = parse_spec(f"static:{path}")
    assert s.options == {"skip_set": str(path)}  # a file name stays text


def test_parse_methods_adds_the_baseline_first():
    labels = [m.label for m in parse_methods("asd,hf")]
    assert labels == ["vanilla", "asd", "hf"]
    assert [m.label for m in parse_methods("hf,vanilla")] == ["hf", "vanilla"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown method 'nope'"),
        ("asd:beta=1", "no option(s) beta"),
        ("asd:0.9", "key=value"),
        ("asd::m=3", "empty option"),
        ("asd:m=3:m=4", "given twice"),
        ("asd:alpha=x", "bad option value"),
        ("hf-lookup:tokens=0", "positive integer"),
        ("hf:layer=3", "no option(s) layer"),
        ("asd@", "empty label"),
        ("asd,asd", "appears twice"),
        ("", "names no method"),
    ],
)
def test_bad_specs_fail_before_any_model_loads(spec, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_methods(spec)


def test_early_exit_layer_is_checked_against_the_model(model):
    with pytest.raises(InvalidInputError, match="layer must be in 1..5"):
        run_benchmark(model, PROMPTS[:1], "hf-early-exit:6", max_new_tokens=4)


# -- the run ---------------------------------------------------------------------------------


def test_every_method_runs_every_prompt_interleaved(run):
    labels = ["vanilla", "asd", "asd-wide", "hf", "hf-lookup:tokens=4", "hf-early-exit:layer=3"]
    assert [m.label for m in run.methods] == labels
    assert [(r.index, r.method) for r in run.records] == [(i, m) for i in range(3) for m in labels]
    assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok]


def test_all_methods_are_lossless_and_match_transformers(run):
    for i in range(len(PROMPTS)):
        row = {r.method: r for r in run.records if r.index == i}
        vanilla = row["vanilla"].token_ids
        assert len(vanilla) > 0
        for rec in row.values():
            assert rec.token_ids == vanilla, rec.method
            assert rec.identical_to_vanilla is True


def test_peer_statistics_come_from_hooks(run):
    for rec in run.by_method("hf"):
        s = rec.stats
        assert s["forwards"] == s["new_tokens"] and s["drafted"] == 0  # plain generate: one forward per token
    for rec in run.by_method("hf-early-exit:layer=3"):
        s = rec.stats
        assert s["draft_forwards"] > 0 and s["drafted"] > 0
        assert s["forwards"] < s["new_tokens"] + 1
        assert s["skip_set"]["early_exit"] == 3 and s["skip_set"]["mlp"] == [3, 4, 5]
        assert 0 <= s["accepted"] <= s["drafted"]


def test_summary_definitions(run):
    summary = summarize(run)
    assert summary.lossy == () and summary.failed == ()
    v = summary.method("vanilla")
    assert v.speedup == pytest.approx(1.0) and v.M == pytest.approx(1.0) and v.acceptance_rate is None
    a = summary.method("asd-wide")
    recs = run.by_method("asd-wide")
    assert a.new_tokens == sum(r.stats["new_tokens"] for r in recs)
    assert a.M == pytest.approx(a.new_tokens / sum(r.stats["forwards"] for r in recs))
    assert a.acceptance_rate == pytest.approx(a.accepted / a.drafted)
    base_time = sum(r.time for r in run.by_method("vanilla"))
    assert a.speedup == pytest.approx(base_time / sum(r.time for r in recs))
    hf_time = sum(r.time for r in run.by_method("hf"))
    assert a.speedup_vs_hf == pytest.approx(hf_time / sum(r.time for r in recs))
    assert a.expected_speedup == pytest.approx(expected_speedup(a.M, a.acceptance_rate, a.c))
    assert sum(a.time_shares.values()) == pytest.approx(1.0)
    assert a.lossless is True and a.status == "ok"
    assert a.skip_frequency is not None and len(a.skip_frequency["mlp"]) == run.num_layers
    assert a.peak_rss_mb is not None and a.peak_rss_mb > 0
    assert set(summary.by_task) == {"prose", "code"}  # two tasks: per-task rows too
    assert summary.cosine is not None and len(summary.cosine["attention"]) == run.num_layers


def test_a_draft_pass_costs_only_the_rounds_that_ran_passes(run):
    """c is the drafting time of rounds with draft passes per pass: a hybrid's n-gram rounds (drafting time,
    no passes) must not inflate it (they once made `auto` show c = 13)."""
    import copy

    summary = summarize(run)
    a = summary.method("asd-wide")
    assert a.c is not None and 0 < a.c < 5
    hybrid = copy.deepcopy(run)
    for r in hybrid.by_method("asd-wide"):  # add n-gram rounds: drafting time without any pass
        r.stats["draft_time"] += 10.0
    b = summarize(hybrid).method("asd-wide")
    assert b.c == pytest.approx(a.c)
    assert all(r.stats["draft_pass_time"] <= r.stats["draft_time"] for r in run.by_method("asd-wide"))


def test_expected_speedup_eq6():
    assert expected_speedup(1.0, 0.5, 0.3) == pytest.approx(1.0)  # nothing gained: one token per forward
    assert expected_speedup(3.0, 1.0, 0.0) == pytest.approx(3.0)  # free drafts, all accepted: M
    assert expected_speedup(3.0, 0.8, 0.5) == pytest.approx(2.4 / 1.8)


def test_outputs_are_written(run, tmp_path):
    summary = summarize(run, stream=True, window=2)
    paths = write_outputs(run, summary, tmp_path / "out")
    assert {p.name for p in paths.values()} == {
        "results.jsonl",
        "summary.json",
        "report.md",
        "speedup.png",
        "layers.png",
        "stream.png",
    }
    lines = paths["results"].read_text().splitlines()
    assert len(lines) == len(run.records)
    assert json.loads(lines[0])["method"] == "vanilla"
    data = json.loads(paths["summary"].read_text())
    assert data["lossless"] is True and [m["label"] for m in data["methods"]][0] == "vanilla"
    assert set(data["stream"]["rolling"]) == {"asd", "asd-wide", "hf-lookup:tokens=4", "hf-early-exit:layer=3"}
    report = paths["report"].read_text()
    assert "| asd-wide |" in report and "LOSSY" not in report
    for png in ("speedup", "layers", "stream"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- lossy methods are caught ---------------------------------------------------------------


def _corrupt(monkeypatch, label: str) -> None:
    """Make ``label`` emit one wrong token per prompt, as a buggy acceptance rule would."""
    real_call = bench_runner._Runner.call

    def call(self, method, session, prompt, index, grammar=None):
        tokens, text, stats = real_call(self, method, session, prompt, index, grammar)
        if method.label == label and tokens:
            k = len(tokens) // 2
            tokens = tokens[:k] + ((tokens[k] + 1) % self.model.hf.config.vocab_size,) + tokens[k + 1 :]
        return tokens, text, stats

    monkeypatch.setattr(bench_runner._Runner, "call", call)


def test_a_lossy_method_is_flagged(model, monkeypatch, tmp_path):
    _corrupt(monkeypatch, "broken")
    result = run_benchmark(model, PROMPTS[:2], "asd@broken,asd", max_new_tokens=16, warmup=0)
    summary = summarize(result)
    assert summary.lossy == ("broken",)
    broken = summary.method("broken")
    assert broken.lossless is False and broken.status == "LOSSY" and broken.lossy_prompts == (0, 1)
    assert summary.method("asd").lossless is True
    paths = write_outputs(result, summary, tmp_path)
    assert "**WARNING: LOSSY** -- broken" in paths["report"].read_text()
    assert "**LOSSY** (2/2 prompts differ)" in paths["report"].read_text()
    assert json.loads(paths["summary"].read_text())["lossless"] is False


def test_coupled_sampling_runs_are_judged_lossless_rejection_runs_are_not(model):
    """Coupled sampling (the default): with prompt i's seed every method emits vanilla sampling's tokens, so
    the lossless column is judged; a rejection-sampling column and the peers sample on their own (n/a)."""
    from selfspec.core.sampling import SamplingParams

    sampling = SamplingParams(0.9, top_k=20, seed=3)
    methods = "asd,asd:sampling_scheme=rejection@asd-rs,hf"
    runs = [run_benchmark(model, PROMPTS[:2], methods, max_new_tokens=12, warmup=0, sampling=sampling)
            for _ in range(2)]  # fmt: skip
    def seeded(run):  # the rejection column reproduces only while asd's gate, which reads the clock, agrees
        return [r.token_ids for r in run.records if r.method != "asd-rs"]

    assert seeded(runs[0]) == seeded(runs[1])
    verdicts = {(r.method, r.identical_to_vanilla) for r in runs[0].records}
    assert verdicts == {("vanilla", True), ("asd", True), ("asd-rs", None), ("hf", None)}
    summary = summarize(runs[0])
    assert summary.lossy == () and summary.method("asd").lossless is True
    assert summary.method("asd-rs").lossless is None
    assert summary.config["sampling"]["temperature"] == 0.9
    greedy = run_benchmark(model, PROMPTS[:2], "asd", max_new_tokens=12, warmup=0)
    assert [r.token_ids for r in greedy.records] != [r.token_ids for r in runs[0].records]
    with pytest.raises(InvalidInputError, match="sampling_scheme"):
        run_benchmark(model, PROMPTS[:1], "asd:sampling_scheme=fancy", max_new_tokens=4, warmup=0, sampling=sampling)


def test_greedy_with_a_repetition_penalty_is_judged_against_transformers_too(model):
    """Greedy choices take the repetition penalty (ours and transformers' greedy search alike): every column,
    the hf peer's included, is judged and identical; the report says greedy with the penalty."""
    from selfspec.bench.report import sampling_text
    from selfspec.core.sampling import SamplingParams

    penalised = run_benchmark(model, PROMPTS[:2], "asd:preset=paper@asd,pld,hf", max_new_tokens=16, warmup=0,
                              sampling=SamplingParams(repetition_penalty=1.3))  # fmt: skip
    assert {(r.method, r.identical_to_vanilla) for r in penalised.records} == {
        ("vanilla", True), ("asd", True), ("pld", True), ("hf", True)}  # fmt: skip
    plain = run_benchmark(model, PROMPTS[:2], "pld", max_new_tokens=16, warmup=0)
    assert [r.token_ids for r in plain.records] != [r.token_ids for r in penalised.records if r.method in
                                                    ("vanilla", "pld")]  # fmt: skip
    assert sampling_text(summarize(penalised).config) == "greedy (repetition penalty 1.3)"
    openai = run_benchmark(model, PROMPTS[:1], "hf", max_new_tokens=4, warmup=0,
                           sampling=SamplingParams(frequency_penalty=0.5))  # fmt: skip
    failed = next(r for r in openai.records if r.method == "hf")
    assert not failed.ok and "no presence or frequency penalty" in failed.error


def test_a_failing_method_is_recorded_and_the_run_goes_on(model, monkeypatch):
    real_call = bench_runner._Runner.call

    def call(self, method, session, prompt, index, grammar=None):
        if method.label == "hf-lookup":
            raise RuntimeError("peer exploded")
        return real_call(self, method, session, prompt, index, grammar)

    monkeypatch.setattr(bench_runner._Runner, "call", call)
    result = run_benchmark(model, PROMPTS[:2], "hf-lookup,asd", max_new_tokens=8, warmup=0)
    summary = summarize(result)
    row = summary.method("hf-lookup")
    assert row.prompts == 0 and row.errors == 2 and "peer exploded" in row.error and row.status == "ERROR"
    assert summary.method("asd").prompts == 2


# -- the command line -----------------------------------------------------------------------


@pytest.fixture
def cli_on_tiny(model, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_cli, "load_model", lambda args: model)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt}) + "\n" for p in PROMPTS[:2]))
    return data


def _main(argv):
    from selfspec.cli import main

    return main(argv)


def _bench(*args: str) -> int:
    """``selfspec bench`` with the given arguments, 8 new tokens, no warm-up, no progress bar."""
    return _main(["bench", "--max-new-tokens", "8", "--warmup", "0", "--no-progress", *args])


def test_cli_bench_json_and_files(cli_on_tiny, tmp_path, capsys):
    out = tmp_path / "run"
    code = _bench("--dataset", str(cli_on_tiny), "--limit", "2", "--methods", "asd,hf", "--out", str(out), "--json")
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["lossless"] is True and [m["label"] for m in summary["methods"]] == ["vanilla", "asd", "hf"]
    assert summary["config"]["command"].startswith("selfspec bench --model smollm2-135m --dataset ")
    assert (out / "report.md").is_file() and (out / "speedup.png").is_file()


def test_cli_bench_exit_status_1_when_lossy(cli_on_tiny, monkeypatch, tmp_path, capsys):
    _corrupt(monkeypatch, "broken")
    code = _bench("--dataset", str(cli_on_tiny), "--limit", "1", "--methods", "asd@broken", "--out", str(tmp_path))
    assert code == 1
    assert "WARNING: method 'broken' is LOSSY" in capsys.readouterr().err


def test_cli_bench_stream_mode(cli_on_tiny, tmp_path, capsys):
    other = tmp_path / "code.jsonl"
    other.write_text(json.dumps({"prompt": PROMPTS[2].prompt}) + "\n")
    out = tmp_path / "s"
    stream = f"{cli_on_tiny},{other}"
    code = _bench("--stream", stream, "--limit", "2", "--methods", "asd", "--out", str(out), "--json", "--window", "2")
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["stream"]["tasks"] == ["prompts", "code"] and summary["stream"]["boundaries"] == [0, 2]
    assert (out / "stream.png").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "nope"], "unknown dataset 'nope': not one of xsum, humaneval, mtbench, spec-bench"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--methods", "asd:alpha=2x"], "bad option value"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--offset", "-1"], "--offset must be >= 0"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--temperature", "0.7", "--top-p", "0"], "top_p must be in"),
    ],
)
def test_cli_bench_bad_input_is_one_line(cli_on_tiny, argv, message, capsys):
    assert _bench(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_spec_bench_questions_per_category():
    from selfspec.datasets import SPEC_BENCH_CATEGORIES, load_prompts

    everything = load_prompts("spec-bench", chat=False)
    assert len(everything) == 480
    assert {p.task for p in everything} == set(SPEC_BENCH_CATEGORIES)
    two = load_prompts("spec-bench", limit=2, offset=1, chat=True)
    assert [p.task for p in two] == [c for c in SPEC_BENCH_CATEGORIES for _ in range(2)]
    assert two[0].id == everything[1].id and two[0].prompt[0]["role"] == "user"
    assert [p.task for p in load_prompts("spec-bench", categories=["rag", "qa"], limit=1)] == ["rag", "qa"]
    with pytest.raises(InvalidInputError, match="unknown Spec-Bench category"):
        load_prompts("spec-bench", categories=["poetry"])
    with pytest.raises(InvalidInputError, match="spec-bench only"):
        load_prompts("xsum", categories=["rag"])


def test_llamacpp_peer_takes_paths_and_a_speculation_type():
    from selfspec.bench.spec import parse_methods

    methods = parse_methods("llamacpp:spec=ngram-mod@ngram,llamacpp:gguf=/models/x.gguf")
    assert [m.options for m in methods[1:]] == [{"spec": "ngram-mod"}, {"gguf": "/models/x.gguf"}]
    with pytest.raises(InvalidInputError, match="positive integer"):
        parse_methods("llamacpp:threads=two")


def test_llama_bench_is_found_beside_the_server_and_its_json_read(tmp_path, monkeypatch):
    """`selfspec kernels --compare-llama-cpp` reads llama-bench's JSON: pp and tg tests apart (a stand-in script
    prints what llama-bench -o json prints, with the arguments it was given echoed back)."""
    from selfspec.bench.llamacpp import ENV, find_binary, llama_bench
    from selfspec.errors import ExternalToolError

    monkeypatch.delenv(ENV, raising=False)
    bench = tmp_path / "llama-bench"
    bench.write_text(
        "#!/usr/bin/env python3\nimport json, sys\na = sys.argv\n"
        "p, n = int(a[a.index('-p') + 1]), int(a[a.index('-n') + 1])\n"
        "print(json.dumps([{'n_prompt': p, 'n_gen': 0, 'avg_ts': 300.5, 'n_threads': int(a[a.index('-t') + 1])},"
        " {'n_prompt': 0, 'n_gen': n, 'avg_ts': 72.25}]))\n"
    )
    bench.chmod(0o755)
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "llama-server").chmod(0o755)
    assert find_binary(str(tmp_path / "llama-server"), tool="llama-bench") == bench  # its sibling
    assert find_binary(str(tmp_path), tool="llama-bench") == bench  # its folder
    assert find_binary(str(tmp_path)) == tmp_path / "llama-server"
    got = llama_bench(tmp_path / "m.gguf", 2, binary=bench, prompt=64, generate=16)
    assert got == {"prefill_tokens_per_second": 300.5, "decode_tokens_per_second": 72.25}
    bench.write_text("#!/bin/sh\necho oops; exit 3\n")
    with pytest.raises(ExternalToolError, match="exited with status 3"):
        llama_bench(tmp_path / "m.gguf", 2, binary=bench)
    bench.write_text("#!/bin/sh\nkill -ILL $$\n")  # a build for instructions this CPU does not run
    with pytest.raises(ExternalToolError, match="SIGILL.*rebuild llama.cpp"):
        llama_bench(tmp_path / "m.gguf", 2, binary=bench)


def test_the_llama_cpp_comparison_takes_medians_of_rounds_in_turn(tmp_path, smollm2):
    """`selfspec kernels --compare-llama-cpp` runs llama-bench and our step in turn, round by round: each round's
    ratio from figures taken together, the reported rates and ratios the medians over rounds (a stand-in
    llama-bench whose speed changes from one run to the next, as a VM's does)."""
    from selfspec.cli.main import _compare_llama_cpp

    bench = tmp_path / "llama-bench"
    bench.write_text(
        "#!/usr/bin/env python3\nimport json, pathlib, sys\na = sys.argv\n"
        f"c = pathlib.Path({str(tmp_path / 'count')!r})\n"
        "n = int(c.read_text()) if c.exists() else 0\nc.write_text(str(n + 1))\n"
        "tg = [100.0, 50.0, 80.0][n % 3]\n"
        "print(json.dumps([{'n_prompt': int(a[a.index('-p') + 1]), 'n_gen': 0, 'avg_ts': 2 * tg},"
        " {'n_prompt': 0, 'n_gen': int(a[a.index('-n') + 1]), 'avg_ts': tg}]))\n"
    )
    bench.chmod(0o755)
    got = _compare_llama_cpp(smollm2, str(bench), prompt=32, rounds=3)
    rounds = got["rounds"]
    assert [r["decode_tokens_per_second"] for r in rounds] == [100.0, 50.0, 80.0]
    assert got["decode_tokens_per_second"] == 80.0 and got["prefill_tokens_per_second"] == 160.0
    for r in rounds:
        assert r["decode_ratio"] == pytest.approx(r["ours_decode_tokens_per_second"] / r["decode_tokens_per_second"])
        assert r["ours_prefill_tokens_per_second"] > 0
    assert got["decode_ratio"] == sorted(r["decode_ratio"] for r in rounds)[1]


@pytest.mark.parametrize("where", [("--dataset", "xsum"), ("--stream", "xsum,humaneval")])
def test_cli_bench_refuses_categories_without_spec_bench(where, capsys):
    """Checked before any model loads, with --dataset or in a stream that names no Spec-Bench."""
    assert _bench(*where, "--categories", "qa", "--methods", "pld") == 2
    assert "--categories applies to --dataset spec-bench only" in capsys.readouterr().err


def test_a_hybrids_draft_sources_are_summed_over_prompts_and_reported(model):
    """``auto`` reports per source (lookup, layer-skip) its rounds, drafted and accepted tokens and time: summed
    over the prompts they add up to the method's own drafted and accepted totals, and report.md tabulates them."""
    from selfspec.bench.report import markdown_report

    result = run_benchmark(model, PROMPTS, "auto", max_new_tokens=24, warmup=0)
    summary = summarize(result)
    auto = summary.method("auto")
    assert auto.sources is not None and set(auto.sources) == {"lookup", "layerskip"}
    assert auto.drafted > 0
    assert sum(s["drafted"] for s in auto.sources.values()) == auto.drafted
    assert sum(s["accepted"] for s in auto.sources.values()) == auto.accepted
    per_prompt = sum(r.stats["sources"]["lookup"]["rounds"] for r in result.by_method("auto"))
    assert auto.sources["lookup"]["rounds"] == per_prompt
    assert summary.method("vanilla").sources is None
    report = markdown_report(summary)
    assert "### draft sources" in report and "| auto | lookup |" in report


def test_prefill_and_decode_rates_are_reported_apart(run, tmp_path):
    """Every method that times its prefill gets prompt tokens / prefill seconds and new tokens / the seconds
    after it, in summary.json and report.md's tokens/s column; the three rates agree with one another."""
    summary = summarize(run)
    for label in ("vanilla", "asd", "asd-wide"):
        m = summary.method(label)
        recs = [r for r in run.by_method(label) if r.ok]
        prefill = sum(r.stats["prefill_time"] for r in recs)
        total = sum(r.stats["total_time"] for r in recs)
        assert m.prefill_tokens_per_second == pytest.approx(sum(r.stats["prompt_tokens"] for r in recs) / prefill)
        assert m.decode_tokens_per_second == pytest.approx(m.new_tokens / (total - prefill))
        assert m.decode_tokens_per_second > m.new_tokens / total  # decoding alone runs faster than end to end
    paths = write_outputs(run, summary, tmp_path)
    data = json.loads(paths["summary"].read_text())
    row = next(m for m in data["methods"] if m["label"] == "vanilla")
    assert row["decode_tokens_per_second"] == pytest.approx(summary.method("vanilla").decode_tokens_per_second)
    assert "tokens/s (prefill / decode)" in paths["report"].read_text()


def test_prompts_with_a_structure_are_held_to_it_and_judged_lossless(model, tmp_path):
    """A JSONL record's ``regex`` / ``json_schema`` holds every method's answer to it (the peers, which take
    none, are refused per prompt); every method still gives vanilla's tokens."""
    from selfspec.datasets import load_prompts

    data = tmp_path / "shaped.jsonl"
    data.write_text(json.dumps({"id": "r", "prompt": PROMPTS[0].prompt, "regex": "([a-e]{2,4} ){3,6}[0-9]+"}) + "\n"
                    + json.dumps({"id": "p", "prompt": PROMPTS[1].prompt}) + "\n")  # fmt: skip
    items = load_prompts(str(data))
    assert items[0].structure[0] == "regex" and items[1].structure is None
    result = run_benchmark(model, items, "pld,asd:preset=paper@asd,hf", max_new_tokens=20, warmup=0)
    held = [r for r in result.records if r.prompt_id == "r" and r.method != "hf"]
    assert {r.identical_to_vanilla for r in held} == {True}
    assert all(set(r.text.replace(" ", "")) <= set("abcde0123456789") for r in held)
    hf = next(r for r in result.records if r.prompt_id == "r" and r.method == "hf")
    assert not hf.ok and "takes no structure" in hf.error
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "regex": "a", "choice": ["b"]}) + "\n")
    with pytest.raises(InvalidInputError, match="record 1: give one of"):
        load_prompts(str(bad))
    shipped = load_prompts("structured")
    assert len(shipped) == 12 and all(item.structure[0] == "json_schema" for item in shipped)
    assert {item.task for item in shipped} == {"extraction", "generation", "classification", "code"}


# -- the simulated clock (--simulated) ------------------------------------------------------------


def test_a_simulated_run_gives_the_same_times_in_every_repeat(model):
    """Timed by a cost profile, a run's figures depend on the tokens alone: two runs agree to the last bit, and
    every method's outputs are still vanilla's."""
    from selfspec.cost.costs import read_bound_profile

    profile = read_bound_profile(model)
    runs = [run_benchmark(model, PROMPTS[:2], "pld,asd:preset=paper@asd", max_new_tokens=16, warmup=0,
                          simulated=profile, simulated_name="read-bound") for _ in range(2)]  # fmt: skip
    first, second = ([(r.method, r.prompt_id, r.time) for r in run.records] for run in runs)
    assert first == second
    assert all(t > 0 for _, _, t in first)
    assert runs[0].clock == "simulated: read-bound"
    summary = summarize(runs[0])
    assert summary.lossy == () and summary.config["clock"] == "simulated: read-bound"
    # the figures are the profile's: vanilla's time is its passes' cost (a prefill, then one pass a token)
    vanilla = next(r for r in runs[0].records if r.method == "vanilla")
    assert vanilla.time * 1000 >= (len(vanilla.token_ids) - 1) * profile.forward(1)


def test_a_simulated_run_refuses_peers_and_profiles_of_another_depth(model):
    from selfspec.cost.costs import read_bound_profile

    with pytest.raises(InvalidInputError, match="leave out the peers"):
        run_benchmark(model, PROMPTS[:1], "asd,hf", max_new_tokens=4, warmup=0, simulated=read_bound_profile(model))
    other = read_bound_profile(tiny_model("llama", num_hidden_layers=model.num_layers + 2))
    with pytest.raises(InvalidInputError, match=f"with {model.num_layers + 2} layers"):
        run_benchmark(model, PROMPTS[:1], "asd", max_new_tokens=4, warmup=0, simulated=other)


def test_cli_bench_simulated_writes_its_profile_and_replays_it(cli_on_tiny, tmp_path, capsys):
    """--simulated read-bound writes the costs it ran on; --simulated FILE replays them: the same times."""
    first, again = tmp_path / "first", tmp_path / "again"
    args = ("--dataset", str(cli_on_tiny), "--limit", "2", "--methods", "pld", "--json")
    assert _bench(*args, "--simulated", "read-bound", "--out", str(first)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = summary["config"]
    assert config["clock"].startswith("simulated: ") and "--simulated read-bound" in config["command"]
    assert (first / "profile.json").is_file() and "**clock** simulated" in (first / "report.md").read_text()
    assert _bench(*args, "--simulated", str(first / "profile.json"), "--out", str(again)) == 0
    times = [[json.loads(line)["time"] for line in (d / "results.jsonl").read_text().splitlines()]
             for d in (first, again)]  # fmt: skip
    assert times[0] == times[1] and all(t > 0 for t in times[0])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--simulated", "/nonexistent/profile.json"], "cannot read it"),
        (["--simulated", "read-bound", "--methods", "asd,hf"], "leave out the peers"),
        (["--simulated", "--clients", "2"], "--simulated times single runs"),
        (["--simulated", "read-bound", "--turns", "2"], "--simulated times single runs"),
    ],
)
def test_cli_bench_simulated_bad_input_is_one_line(cli_on_tiny, extra, message, capsys):
    assert _bench("--dataset", str(cli_on_tiny), "--limit", "1", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_bench_simulated_refuses_a_file_that_is_no_profile(cli_on_tiny, tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text('{"version": 1}')
    assert _bench("--dataset", str(cli_on_tiny), "--limit", "1", "--simulated", str(bad)) == 2
    assert "not a cost profile of this version" in capsys.readouterr().err


def test_a_prompts_pass_is_charged_one_row_of_head():
    """A verification's cost table times the head over every row; a prompt's pass computes the last row's logits
    alone, and the simulated clock charges it so: its layers for every row, the head for one."""
    from selfspec.cost.costs import CostProfile, DraftCosts

    forward = {1: 10.0, 2: 11.0, 16: 40.0, 64: 140.0}
    head = {1: 4.0, 16: 10.0}  # the head alone: compute-bound past a few rows
    prof = CostProfile("t", forward, {"same": DraftCosts(0.1, 0.5, 1.0, 1.0)}, 4, head_ms=head)
    assert prof.pass_ms(64, SkipSet()) == pytest.approx(140.0), "a verification: every row's logits"
    head_64 = 10.0 + (10.0 - 4.0) / 15 * 48  # the head table extrapolated
    assert prof.pass_ms(64, SkipSet(), last_only=True) == pytest.approx(140.0 - head_64 + 4.0)
    assert prof.pass_ms(1, SkipSet(), last_only=True) == pytest.approx(10.0), "one row: the same pass"


def test_a_long_prompt_is_charged_by_the_measured_prompt_pass():
    """Past the 64-row grid a prompt's cost runs toward the profile's timed prompt pass and along its slope; an older
    profile without one (version 10) is still read, its prompts extrapolated from the 64-row pass."""
    from selfspec.cost.costs import CostProfile, DraftCosts

    forward = {1: 10.0, 2: 11.0, 16: 40.0, 64: 140.0}
    head = {1: 4.0, 16: 10.0}
    prof = CostProfile("t", forward, {"same": DraftCosts(0.1, 0.5, 1.0, 1.0)}, 4, head_ms=head, prompt_ms={256: 300.0})
    at_64 = prof.pass_ms(64, SkipSet(), last_only=True)
    assert prof.pass_ms(256, SkipSet(), last_only=True) == pytest.approx(300.0)
    assert prof.pass_ms(160, SkipSet(), last_only=True) == pytest.approx((at_64 + 300.0) / 2)
    assert prof.pass_ms(448, SkipSet(), last_only=True) == pytest.approx(300.0 + (300.0 - at_64))
    again = CostProfile.from_dict(prof.to_dict())
    assert again == prof
    old = prof.to_dict() | {"version": 10}
    del old["prompt_ms"]
    older = CostProfile.from_dict(old)
    assert older.prompt_ms == {} and older.pass_ms(256, SkipSet(), last_only=True) > 300.0
