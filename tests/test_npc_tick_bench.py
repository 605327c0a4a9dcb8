"""benchmarks/npc_tick.py runs at the smallest scale on the bench model and finds every
answer of the engine and of `runtime serve` equal to its offline chain (llama-server is left
out: it is built only by benchmarks/llama_cpp/build_server.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_npc_tick_benchmark_runs_small_and_checks_every_answer(tmp_path):
    pytest.importorskip("fastapi")
    out = tmp_path / "npc_tick"
    done = subprocess.run([sys.executable, "-m", "benchmarks.npc_tick", "--npcs", "2,3", "--threads", "1", "--ticks",
                           "2", "--rounds", "1", "--skip-llama-cpp", "--out", str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(row["side"], row["npcs"]) for row in rows} == {(side, npcs) for side in ("engine", "runtime serve")
                                                           for npcs in (2, 3)}
    for row in rows:
        assert row["errors"] == 0 and row["equal"] == row["calls"] == row["npcs"] * 2 * 3
        assert len(row["ticks_per_s_by_round"]) == 1 and row["ticks_per_s"] > 0
    assert "llama-server: skipped (--skip-llama-cpp)" in out.with_suffix(".md").read_text()
    try:
        import matplotlib  # noqa: F401  (the bench extra draws the plot)
    except ImportError:
        return
    assert out.with_suffix(".png").stat().st_size > 0
