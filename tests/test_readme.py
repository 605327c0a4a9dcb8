"""The README and the docs: their Python examples run as written, from the repository root,
and their generated tables say what the benchmark results say."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(page, code) for page in PAGES for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def test_the_readme_has_a_python_example():
    assert any(page.name == "README.md" for page, _ in EXAMPLES)


@pytest.mark.parametrize("page, code", EXAMPLES, ids=[f"{page.name}:{i}" for i, (page, _) in enumerate(EXAMPLES)])
def test_the_python_examples_run(page, code):
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{page.name}: {done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{page.name}: the example printed nothing"


def _between(path: Path, begin: str, end: str) -> str:
    return path.read_text().split(begin + "\n")[1].split("\n" + end)[0]


def _rows(table: str) -> list[list[str]]:
    """The body rows of a markdown table, as cells (a ``|`` inside a cell is written ``\\|``)."""
    _, _, *body = table.splitlines()
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in body]


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((RESULTS / "results.json").read_text())


def test_the_generated_tables_are_the_reports(results):
    headline = _between(ROOT / "docs" / "benchmarks.md", report.HEADLINE_BEGIN, report.HEADLINE_END)
    assert headline == report.headline(results, RESULTS), "run python3 -m benchmarks.report"
    summary = _between(ROOT / "README.md", report.SUMMARY_BEGIN, report.SUMMARY_END)
    assert summary == report.summary(results, RESULTS), "run python3 -m benchmarks.report"


UNITS = {"x": 1.0, "KB": 1000.0, "KiB": 1024.0, "": 1.0}
NUMBER = r"(?<![\w.])(\d+(?:\.\d+)?(?:e[+-]?\d+)?)"


def _figure(measured: str) -> float:
    """The first figure of a measured cell, in bytes where it names a size: ``0.98
    [0.92-1.04]x (...)`` -> 0.98; ``7.8 KiB of Python objects, ...`` -> 7987.2."""
    match = re.search(NUMBER + r" ?(KiB|KB|x|)", measured)
    assert match, f"no figure in {measured!r}"
    return float(match.group(1)) * UNITS[match.group(2)]


def _holds(target: str, figure: float) -> tuple[bool, bool]:
    """Whether ``figure`` meets the target's first threshold (``>= N``, ``<= N``, ``<= N KB``;
    ``cost <= N%`` of a ratio: the ratio >= 1 - N/100), and whether that threshold is all the
    target asks."""
    match = re.search(r"(>=|<=) " + NUMBER + r" ?(KB|x|%|)", target)
    assert match, f"no threshold in {target!r}"
    op, value, unit = match.groups()
    if unit == "%":
        holds = figure >= 1 - float(value) / 100
    else:
        threshold = float(value) * UNITS[unit if unit != "%" else ""]
        holds = figure >= threshold if op == ">=" else figure <= threshold
    alone = len(re.findall(r">=|<=", target)) == 1 and not re.search(r"identical|errors|below|every", target)
    return holds, alone


def test_every_verdict_follows_from_its_figure():
    """Each headline verdict is re-derived here from the row's own threshold and figure, not
    by the report's code: a report that judged a figure against the wrong threshold, or the
    wrong way round, writes a table this test refuses."""
    headline = _between(ROOT / "docs" / "benchmarks.md", report.HEADLINE_BEGIN, report.HEADLINE_END)
    rows = _rows(headline)
    assert all(len(row) == 5 for row in rows), "a row whose cells do not line up"
    judged = [row for row in rows if row[3] in ("yes", "**NO**")]
    assert len(judged) >= 20 and any(row[3] == "**NO**" for row in judged) and any(row[3] == "yes" for row in judged)
    for target, where, measured, met, _ in judged:
        holds, alone = _holds(target, _figure(measured))
        if alone:
            assert holds == (met == "yes"), f"{target} ({where}): {measured} judged {met}"
        elif met == "yes":
            assert holds, f"{target} ({where}): {measured} judged yes"
    assert all(row[3] == "no target" for row in rows if row not in judged)


def test_the_decode_rows_show_the_measured_speeds(results):
    """The 1-thread decode rows carry results.json's own medians, ours against llama.cpp's, in
    that order: a report that read another field, or swapped the sides, fails here."""
    rows = {(target, where): measured for target, where, measured, *_ in
            _rows(_between(ROOT / "docs" / "benchmarks.md", report.HEADLINE_BEGIN, report.HEADLINE_END))}
    decode = results["sets"]["smollm2"]["threads"]["1"]["decode"]
    for precision, theirs in (("f32", "llama.cpp f32"), ("int8", "llama.cpp q8_0")):
        entry = decode[precision]["base"]
        measured = rows[(f"decode tokens/s >= 1.0x llama.cpp (ours {precision} vs {theirs})",
                         "SmolLM2-135M, 1 thread, base")]
        assert measured.startswith(f"{entry['speed']['median']:.2f} [{entry['speed']['min']:.2f}-"
                                   f"{entry['speed']['max']:.2f}]x")
        assert f"({entry['ours_ms']['median']:.1f} vs {entry['theirs_ms']['median']:.1f} ms)" in measured
        # speed is llama.cpp's ms over ours
        assert entry["speed"]["median"] == pytest.approx(entry["theirs_ms"]["median"] / entry["ours_ms"]["median"],
                                                         rel=0.1)


def test_the_summary_rows_are_headline_rows():
    headline = {tuple(row[:4]) for row in
                _rows(_between(ROOT / "docs" / "benchmarks.md", report.HEADLINE_BEGIN, report.HEADLINE_END))}
    summary = _rows(_between(ROOT / "README.md", report.SUMMARY_BEGIN, report.SUMMARY_END))
    assert 4 <= len(summary) <= 16  # the README stays short: one table, a row per headline target kind
    assert all(tuple(row) in headline for row in summary)


def test_a_table_is_written_between_its_markers_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{report.HEADLINE_BEGIN}\nold table\n{report.HEADLINE_END}\nafter\n")
    report.write_headline("| new | table |", page)
    assert page.read_text() == f"before\n{report.HEADLINE_BEGIN}\n| new | table |\n{report.HEADLINE_END}\nafter\n"
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="page.md: expected one"):
        report.write_headline("| new | table |", page)
    assert page.read_text() == "no markers\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{report.SUMMARY_BEGIN}\nold\n{report.SUMMARY_END}\nb\n")
    report.write_summary("| s |", readme)
    assert readme.read_text() == f"a\n{report.SUMMARY_BEGIN}\n| s |\n{report.SUMMARY_END}\nb\n"
