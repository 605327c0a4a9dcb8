"""The README's Python example runs as written, from the repository root."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has no Python example"
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), "the example printed nothing"


def _report():
    """``benchmarks/report.py`` as a module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return report


def test_the_headline_table_is_the_reports():
    report = _report()
    results = ROOT / "benchmarks" / "results"
    text = (ROOT / "README.md").read_text()
    written = text.split(report.HEADLINE_BEGIN + "\n")[1].split("\n" + report.HEADLINE_END)[0]
    expected = report.headline(json.loads((results / "results.json").read_text()), results)
    assert written == expected, "README's headline differs from the results: run python3 benchmarks/report.py"
    assert "| yes |" in written  # verdicts, not an empty table


def test_the_headline_is_written_between_its_markers_only(tmp_path):
    report = _report()
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{report.HEADLINE_BEGIN}\nold table\n{report.HEADLINE_END}\nafter\n")
    report.write_headline("| new | table |", readme)
    assert readme.read_text() == f"before\n{report.HEADLINE_BEGIN}\n| new | table |\n{report.HEADLINE_END}\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="README.md: expected one"):
        report.write_headline("| new | table |", readme)
    assert readme.read_text() == "no markers\n"
