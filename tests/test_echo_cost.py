"""benchmarks/echo_cost.py runs on a committed model whose prefill returns every position's
logits, and its two sides compute what they claim (the echo side the prompt's logprobs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import MODEL_FILES

ROOT = Path(__file__).resolve().parents[1]


def test_echo_cost_runs_small_and_writes_its_ratio(tmp_path):
    out = tmp_path / "echo"
    done = subprocess.run([sys.executable, "-m", "benchmarks.echo_cost", str(MODEL_FILES["transposed"]),
                           "--tokens", "12", "--rounds", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert len(result["rounds"]) == 2 and result["tokens"] == 12
    for row in result["rounds"]:
        assert row["plain_s"] > 0 and row["echo_s"] > 0 and row["ratio"] == row["echo_s"] / row["plain_s"]
    assert "target <= 1.3x met" in out.with_suffix(".md").read_text()
