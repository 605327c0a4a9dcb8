"""The report's long-context rows (issue 53) judge each box's result files: a cache's step ratios
within rounds, every depth against its threshold, the all-linear adapter's ratio against
llama.cpp's, and opening against both of its limits."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report import long_context_targets


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "date": "2026-12-06 22:00 UTC", "cpu": "AMD EPYC (AVX2, FMA)"}))


def test_nothing_is_judged_without_result_files(tmp_path):
    assert long_context_targets(tmp_path) == []


def test_the_cache_length_ratio_is_taken_within_rounds_and_only_f32_is_judged(tmp_path):
    rows = [{"export": "kv256f32", "position": 10, "per_round_ms": [30.0, 40.0, 35.0]},
            # within the rounds 1.4x, 1.0x, 1.0x; the medians across rounds would say 40 / 35 = 1.14x
            {"export": "kv4096f32", "position": 10, "per_round_ms": [42.0, 40.0, 35.0]},
            {"export": "kv4096f32", "position": 3000, "per_round_ms": [42.0, 60.0, 39.0]},
            {"export": "kv256int8", "position": 10, "per_round_ms": [10.0, 10.0, 10.0]},
            {"export": "kv4096int8", "position": 3000, "per_round_ms": [19.0, 19.0, 19.0]}]
    _write(tmp_path / "avx2" / "kv_span_smollm2.json", {"rows": rows})
    found = {(t.where.split(",")[0], t.target.split(" <=")[0]): t for t in long_context_targets(tmp_path)}
    start = found["SmolLM2-135M f32", "a decode step near the start"]
    assert start.met and start.measured.startswith("1.00 [1.00-1.40]x (40.0 vs 35.0 ms)")
    deep = found["SmolLM2-135M f32", "a decode step after 3,000 tokens"]
    assert deep.met is False and deep.measured.startswith("1.40 [1.11-1.50]x")  # 42 / 30, 60 / 40, 39 / 35
    assert found["SmolLM2-135M int8", "a decode step after 3,000 tokens"].met is None  # shown, not judged
    assert ("SmolLM2-135M int8", "a decode step near the start") not in found  # no kv4096int8 step at 10
    assert all("kv_span_smollm2.json`, 2026-12-06 22:00 UTC, AMD EPYC" in t.source for t in found.values())


def _depth_row(position: int, ours: str, ratio: float) -> dict:
    return {"position": position, "ours": ours, "native_ms": 10.0, "llama_cpp_ms": 10.0 * ratio,
            "ratio_native": {"min": ratio, "median": ratio, "max": ratio}}


def test_every_depth_must_meet_its_precisions_threshold(tmp_path):
    rows = [_depth_row(10, "f32", 0.5),  # the start is not among the depths asked
            _depth_row(512, "f32", 1.12), _depth_row(2048, "f32", 1.15), _depth_row(4000, "f32", 1.2),
            _depth_row(512, "int8", 1.5), _depth_row(2048, "int8", 1.29), _depth_row(4000, "int8", 1.6)]
    _write(tmp_path / "kernel_depth_smollm2_fa_off.json", {"rows": rows})
    f32, int8 = long_context_targets(tmp_path)
    assert ">= 1.1x" in f32.target and f32.met and f32.measured.startswith("1.12x / 1.15x / 1.20x (10.0 / 10.0")
    assert ">= 1.3x" in int8.target and int8.met is False  # 1.29x after 2,048 tokens
    _write(tmp_path / "kernel_depth_smollm2_fa_off.json", {"rows": rows[:3]})  # 4,000 not measured: no row
    assert long_context_targets(tmp_path) == []


def test_the_all_linear_adapter_and_opening_are_judged_against_their_limits(tmp_path):
    ratio = {"ours": "int8", "llama_cpp": "q8_0", "ours ratio": {"median": 1.15}, "llama.cpp ratio": {"median": 1.14}}
    _write(tmp_path / "avx2" / "lora_ratio_smollm2.json", {"rows": [ratio]})
    run = {"open_ms": 200.0, "signatures": 7, "generate": {"first_token_ms": 900.0}}
    slow = {**run, "generate": {"first_token_ms": 1100.0}}
    _write(tmp_path / "avx2" / "open_time.json", {"runs": {"/m/fast.tflite": {"on-demand": [run] * 3, "all": [slow]},
                                                          "/m/slow.litertlm": {"on-demand": [run, slow, slow]}}})
    adapter, fast, slow_open = long_context_targets(tmp_path)
    assert adapter.met is False and adapter.measured.startswith("1.0088x (ours 1.150x, llama.cpp 1.140x)")
    assert fast.met and "`fast.tflite`, 7 signatures" in fast.where
    assert fast.measured.startswith("0.20 s, first token 0.90 s")
    assert slow_open.met is False  # its median first token is 1.1 s


def test_eight_sessions_are_judged_by_the_gain_within_rounds_and_deep_rows_by_their_own_target(tmp_path):
    rows = [{"position": 0, "one_tokens_per_s": [80.0, 100.0, 90.0], "together_tokens_per_s": [250.0, 250.0, 300.0]},
            {"position": 998, "one_tokens_per_s": [70.0, 70.0, 70.0], "together_tokens_per_s": [180.0, 175.0, 170.0]}]
    _write(tmp_path / "avx2" / "batch_cost_smollm2_int8.json", {"sessions": 8, "rows": rows})
    start, latency, deep = long_context_targets(tmp_path)
    # gains 3.125, 2.5, 3.33 by round: median 3.125 (the medians across rounds would give 250 / 90 = 2.78)
    assert ">= 3x" in start.target and start.met and start.measured.startswith("3.12 [2.50-3.33]x (250 vs 90 tokens/s)")
    assert "<= 2x" in latency.target and latency.met is False and latency.measured == "2.56x"  # 8 / 3.125
    assert "~1,000 tokens deep" in deep.target and ">= 2.5x" in deep.target and deep.met  # 2.50x
    assert all(t.where.startswith("SmolLM2-135M, ours int8") for t in (start, latency, deep))


def test_the_default_export_is_judged_by_its_time_and_its_largest_process(tmp_path):
    report = {"settings": {"kv_length": 4096}, "signatures": [{}] * 7, "jobs": 2, "seconds": 134.0,
              "peak_rss_bytes": 4.2e9, "peak_pss_bytes": 3.1e9, "exporter_peak_rss_bytes": 1.9e9,
              "finisher_peak_rss_bytes": 2.3e9, "worker_peak_rss_bytes": [1.7e9, 1.8e9]}
    _write(tmp_path / "avx2" / "export_defaults_smollm2_f32.json", report)  # the tree's 4.2 GB is not one process
    _write(tmp_path / "avx2" / "export_defaults_smollm2_int8.json", {**report, "worker_peak_rss_bytes": [2.6e9]})
    f32, int8 = long_context_targets(tmp_path)
    assert f32.met and f32.measured.startswith("2.2 min (134 s), the largest process 2.30 GB")
    assert "f32, KV 4,096, 7 signatures, 2 jobs" in f32.where
    assert int8.met is False  # a worker of 2.6 GB


def test_the_attention_ops_read_rate_is_judged_against_the_faster_loop_from_1000_positions_on(tmp_path):
    def row(position: int, dtype: str, read: float, read4: float, kernel: float) -> dict:
        return {"position": position, "dtype": dtype, "mb": 46.0, "read_ms": [read, read * 2, read],
                "read4_ms": [read4, read4, read4 * 5], "kernel_ms": {"this checkout": [kernel, kernel, kernel * 3]}}

    rows = [row(128, "f32", 1.0, 1.0, 5.0),  # short spans are not asked about
            row(1000, "f32", 3.0, 3.5, 4.0),  # one stream the faster here: 3.0 / 4.0
            row(4095, "f32", 10.0, 7.0, 9.0),  # four streams: 7.0 / 9.0
            row(1000, "f16", 1.5, 1.5, 3.0), row(4095, "f16", 5.0, 5.0, 6.0)]
    _write(tmp_path / "kernel_bench_smollm2.json", {"span": 4096, "rows": rows})
    f32, f16 = long_context_targets(tmp_path)
    assert f32.met and f32.measured.startswith("0.75x / 0.78x at 1,000 / 4,095 positions (4.00 / 9.00 ms for 30 "
                                               "layers, against 15.3 / 6.6 GB/s read)")
    rows[2] = row(4095, "f32", 10.0, 6.0, 9.0)  # 6.0 / 9.0 = 0.67x
    _write(tmp_path / "kernel_bench_smollm2.json", {"span": 4096, "rows": rows})
    assert long_context_targets(tmp_path)[0].met is False
    assert f16.met is None and "float16 caches" in f16.where
