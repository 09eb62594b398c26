"""The documentation holds together: cited result runs exist, every kept run is cited and regenerable, links resolve.

README.md and the pages under docs/ cite benchmark runs as ``docs/results/<run>/...``.  Every cited path must
exist, every run folder under docs/results/ must be cited (an uncited run is clutter: it lives in git history),
and each one needs the command that writes it again (``--out docs/results/<run>`` in docs/benchmarks.md and in
the Makefile's ``results`` target).  Relative links between README.md, CHANGELOG.md and docs/*.md, with their
``#section`` anchors, must resolve, and every docs/ page must be one link from the README.  CHANGELOG.md is not
checked for result paths: it quotes the paths of their day, which git history keeps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_RESULT_PATH = re.compile(r"docs/results/([A-Za-z0-9._-]+)((?:/[A-Za-z0-9._-]+)*)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _pages(root: Path) -> list[Path]:
    """The pages whose citations count: the README and docs/*.md (not CHANGELOG.md, a record of past states)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def cited_results(root: Path) -> dict[str, set[str]]:
    """``{path cited under docs/results/: {pages citing it}}``, e.g. ``"specbench-smollm2-135m/report.md"``."""
    cited: dict[str, set[str]] = {}
    for page in _pages(root):
        for m in _RESULT_PATH.finditer(page.read_text()):
            path = (m.group(1) + m.group(2)).rstrip(".")  # a path that ends a sentence
            if path:  # not "docs/results/..." standing for any run
                cited.setdefault(path, set()).add(page.name)
    return cited


def result_problems(root: Path) -> list[str]:
    """Every way the cited runs and the folders under docs/results/ disagree (empty: they agree)."""
    problems = []
    results = root / "docs" / "results"
    cited = cited_results(root)
    for path, pages in sorted(cited.items()):
        if not (results / path).exists():
            problems.append(f"docs/results/{path} is cited by {', '.join(sorted(pages))} but does not exist")
    cited_runs = {p.split("/")[0] for p in cited}
    runs = sorted(p.name for p in results.iterdir() if p.is_dir()) if results.is_dir() else []
    loose = sorted(p.name for p in results.iterdir() if p.is_file()) if results.is_dir() else []
    problems += [f"docs/results/{f} is a loose file: results live in one folder per run" for f in loose]
    problems += [f"docs/results/{run}/ is cited by no page (remove it: git history keeps it)" for run in runs
                 if run not in cited_runs]  # fmt: skip
    bench_page = root / "docs" / "benchmarks.md"
    makefile = root / "Makefile"
    for run in runs:
        out = f"--out docs/results/{run}"
        for where in (bench_page, makefile):
            text = where.read_text() if where.is_file() else ""
            if not re.search(re.escape(out) + r"(?![A-Za-z0-9._-])", text):
                problems.append(f"docs/results/{run}/ has no command that regenerates it ({out}) in {where.name}")
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")  # repeated headings get -1, -2, ...
    return found


def _links(page: Path) -> list[str]:
    text, in_code, out = page.read_text().splitlines(), False, []
    for line in text:
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            out += [m.group(1) for m in _LINK.finditer(line)]
    return out


def link_problems(root: Path) -> list[str]:
    """Relative links (and their #anchors) of README.md, CHANGELOG.md and docs/*.md that do not resolve."""
    problems = []
    for page in [*_pages(root), root / "CHANGELOG.md"]:
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                problems.append(f"{page.name}: link to {target}: {path_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{page.name}: link to {target}: no section #{anchor} in {dest.name}")
    return problems


def test_every_cited_result_exists_and_every_run_is_cited_and_regenerable():
    assert result_problems(ROOT) == []


def test_the_docs_cite_some_runs():
    assert len({p.split("/")[0] for p in cited_results(ROOT)}) >= 2


def test_links_and_their_sections_resolve():
    assert link_problems(ROOT) == []


def test_every_docs_page_is_one_link_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md") if not t.startswith("#")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")} | {(ROOT / "CHANGELOG.md").resolve()}
    assert sorted(p.name for p in pages - linked) == []


def test_the_readme_stays_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 450


def _tiny_tree(tmp_path: Path) -> Path:
    (tmp_path / "docs" / "results" / "specbench-a").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "specbench-a" / "report.md").write_text("# a\n")
    (tmp_path / "docs" / "results" / "specbench-b").mkdir()
    (tmp_path / "README.md").write_text(
        "# t\n\nSee `docs/results/specbench-a/report.md` and [b](docs/benchmarks.md#runs).\n"
    )
    commands = "selfspec bench --out docs/results/specbench-a\nselfspec bench --out docs/results/specbench-b\n"
    (tmp_path / "docs" / "benchmarks.md").write_text(f"# B\n\n## Runs\n\n`docs/results/specbench-b/`\n\n{commands}")
    (tmp_path / "Makefile").write_text(commands)
    (tmp_path / "CHANGELOG.md").write_text("# c\n\nOld: `docs/results/engine-v1/`.\n")
    return tmp_path


def test_the_checks_pass_on_a_consistent_tree(tmp_path):
    root = _tiny_tree(tmp_path)
    assert result_problems(root) == []
    assert link_problems(root) == []


def test_a_removed_cited_run_fails(tmp_path):
    root = _tiny_tree(tmp_path)
    (root / "docs" / "results" / "specbench-a" / "report.md").unlink()
    (root / "docs" / "results" / "specbench-a").rmdir()
    problems = result_problems(root)
    assert any("specbench-a/report.md is cited by README.md but does not exist" in p for p in problems)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda r: (r / "docs" / "results" / "extra-run").mkdir(), "extra-run/ is cited by no page"),
        (lambda r: (r / "Makefile").write_text(""), "no command that regenerates it (--out docs/results/specbench-a)"),
        (lambda r: (r / "docs" / "results" / "summary.json").write_text("{}"), "summary.json is a loose file"),
    ],
)
def test_uncited_unregenerable_or_loose_results_fail(tmp_path, change, expected):
    root = _tiny_tree(tmp_path)
    change(root)
    assert any(expected in p for p in result_problems(root)), result_problems(root)


def test_a_broken_link_or_anchor_fails(tmp_path):
    root = _tiny_tree(tmp_path)
    (root / "README.md").write_text("[x](docs/nowhere.md) [y](docs/benchmarks.md#no-such-section)\n")
    problems = link_problems(root)
    assert any("docs/nowhere.md does not exist" in p for p in problems)
    assert any("no section #no-such-section" in p for p in problems)


def test_slugs_follow_github():
    assert slug("`auto` (the default)") == "auto-the-default"
    assert slug("int8 activations (`--activations`, default `auto`)") == "int8-activations---activations-default-auto"
    assert slug("The draft's vocabulary") == "the-drafts-vocabulary"
    assert slug("Sampling at temperature 0.7, with lookahead (12 prompts)") == (
        "sampling-at-temperature-07-with-lookahead-12-prompts"
    )
