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


def test_the_report_row_at_16_npcs_asks_2x_ticks_lower_p99_and_every_answer_of_ours_equal(tmp_path):
    from benchmarks.report import npc_targets

    def row(side: str, npcs: int, ticks: float, p99: float, equal: int, ratio: float | None = None) -> dict:
        out = {"side": side, "threads": 1, "npcs": npcs, "ticks_per_s": ticks, "tick_ms_p99": p99, "calls": 96,
               "equal": equal, "errors": 0}
        return out if ratio is None else {**out, "vs_llama_server_ticks_per_s": ratio}

    rows = [row("llama-server", 16, 2.0, 9000.0, 40), row("engine", 16, 4.4, 5000.0, 96, 2.2),
            row("runtime serve", 16, 4.4, 5000.0, 95, 2.2), row("engine", 8, 1.0, 1.0, 96, 0.5),
            row("llama-server", 8, 2.0, 9000.0, 40)]
    settings = {"load_average_at_start": 3.2, "load_average_at_end": 4.1, "date": "2026-12-05 09:00 UTC"}
    assert npc_targets(tmp_path) == []
    (tmp_path / "npc_tick_smollm2.json").write_text(json.dumps({"settings": settings, "rows": rows}))
    targets = {t.where.split(", ")[1]: t for t in npc_targets(tmp_path)}
    assert set(targets) == {"engine", "runtime serve"}  # 16 NPCs only, one row per side of ours
    assert targets["engine"].met and targets["engine"].headline
    assert not targets["runtime serve"].met  # one answer not equal to the offline chain
    assert "2.20x (4.4 vs 2.0 ticks/s), p99 5.00 vs 9.00 s, equal 96/96 (llama-server 40/96)" in targets["engine"].measured
