"""Tests for benchmarks/open_time.py: its measured children and its table."""

from __future__ import annotations

from conftest import MODEL_FILES, adapter_path
from benchmarks import open_time


def test_the_engine_child_reports_what_compiled_at_open_and_at_a_slots_first_use():
    model = str(MODEL_FILES["transposed"])
    runs = {mode: open_time._child(["engine", "--model", model, "--compile", mode, "--adapter",
                                    str(adapter_path("torch_r4"))]) for mode in open_time.MODES}
    assert runs["on-demand"]["compiled_at_open"] == ["plain"]
    # The slot's first use, a 32-token prompt: its decode's group and its prefill_32's.
    assert runs["on-demand"]["compiled_after_adapter"] == ["plain", "lora_r4", "lora_r4_prefill32"]
    assert len(runs["all"]["compiled_at_open"]) == runs["all"]["groups"] == 10
    assert runs["all"]["compiled_after_adapter"] == runs["all"]["compiled_at_open"]
    for run in runs.values():
        assert run["signatures"] == 36 and run["open_ms"] > 0 and run["open_cpu_ms"] > 0
    assert open_time.engine_names_ok(model)


def test_the_table_has_a_row_per_model_and_mode():
    row = {"open_ms": 100.0, "open_cpu_ms": 50.0, "signatures": 4, "compiled_at_open": ["plain"],
           "generate": {"first_token_ms": 900.0, "cpu_ms": 400.0}}
    data = {"runs": {"/m/a.litertlm": {"on-demand": [row], "all": [dict(row, open_cpu_ms=100.0)]}},
            "kinds": {"/m/a.litertlm": "engine"}, "loads": [[3.0, 2.0, 1.0]], "threads": 1, "rounds": 1,
            "cpu": "a CPU", "date": "today"}
    lines = open_time.table(data, "python3 -m benchmarks.open_time --model /m/a.litertlm")
    rows = [line for line in lines if line.startswith("| m/a.litertlm")]
    assert rows == ["| m/a.litertlm | 4 | on-demand | plain | 100 | 50 | 0.50 | 900 | 400 | - |",
                    "| m/a.litertlm | 4 | all | plain | 100 | 100 | 1.00 | 900 | 400 | - |"]
    assert "load average (1 min) 3.0-3.0" in lines[0]
