"""Tests for the command line (runtime.cli), run as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import MODEL_FILES, MODELS, adapter_path

from runtime import ByteTokenizer, Engine, EngineSettings, SamplerConfig, SessionConfig


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime", *map(str, args)], capture_output=True, text=True, timeout=120,
        env=env and {**os.environ, **env},
    )


def test_generate_prints_tokens_and_timings():
    done = cli("generate", "--model", MODEL_FILES["default"], "--lora", f"{adapter_path('torch_r4')}:0.5",
               "--prompt-ids", "5,17,42", "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
    tokens_line, timings = done.stdout.strip().splitlines()
    assert len(tokens_line.split()) == 4  # streamed as they came
    assert "ms/token" in timings and "prefill 3 tokens" in timings
    assert done.stderr == ""  # the native library's INFO lines stay off the terminal


def test_generate_prints_where_the_runs_time_went_op_by_op():
    done = cli("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "5,17,42", "--max-new-tokens", "4",
               "--profile-ops")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("ops of the generation"))
    assert int(summary.split(": ")[1].split(" runs")[0]) >= 4  # the prefill's runs and 3 decode steps
    assert any(line.startswith("| Fully Connected (NC, F32) GEMM | XNNPACK |") for line in lines)
    assert done.stderr == ""


def test_generate_keeps_packed_weights_in_a_weight_cache_dir(tmp_path):
    runs = [cli("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "5,17,42", "--max-new-tokens", "4",
                "--weight-cache-dir", tmp_path / "packed") for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr
    assert runs[0].stdout.splitlines()[0] == runs[1].stdout.splitlines()[0]  # the same tokens from the file
    assert packed_files(tmp_path / "packed") == ["xnnpack", "xnnpack.source"]


def packed_files(directory) -> list[str]:
    """The kinds of file a weight-cache directory holds (its lock aside): the packed
    weights and, beside them, the record of the model they were packed from."""
    return sorted(f.name[f.name.index(".xnnpack") + 1:] for f in directory.iterdir() if f.name != ".lock")


def test_generate_keeps_packed_weights_in_the_user_cache_unless_told_not_to(tmp_path):
    generate = ("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "5,17,42", "--max-new-tokens", "4")
    without = cli(*generate, "--no-weight-cache", env={"RUNTIME_CACHE": str(tmp_path)})
    assert without.returncode == 0, without.stderr
    assert not (tmp_path / "xnnpack").exists()
    default = cli(*generate, env={"RUNTIME_CACHE": str(tmp_path)})
    assert default.returncode == 0, default.stderr
    assert default.stdout.splitlines()[0] == without.stdout.splitlines()[0]
    assert packed_files(tmp_path / "xnnpack") == ["xnnpack", "xnnpack.source"]
    both = cli(*generate, "--no-weight-cache", "--weight-cache-dir", tmp_path)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_generate_text_with_byte_tokens_and_adapter_from_stdin():
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "generate", "--model", str(MODEL_FILES["default"]), "--lora-buffer",
         "--byte-tokens", "--prompt", "hi", "--max-new-tokens", "3"],
        input=adapter_path("torch_r4").read_bytes(), capture_output=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert b"<in-memory buffer of 16640 bytes>" in done.stdout and b"prefill 2 tokens" in done.stdout


def test_generate_streams_text_that_joins_to_exactly_the_generated_text():
    """The streamed text is the answer's text: each token was decoded alone, so a character
    split over tokens printed as one U+FFFD per part (and a broken sequence as too many)."""
    demo = MODELS.parent.parent / "runtime" / "demo_assets" / "model.tflite"
    sampling = ("--temperature", "50", "--seed", "3")  # near uniform bytes: characters made of 2-4 of them
    done = subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", str(demo), "--byte-tokens",
                           "--prompt", "hello", "--max-new-tokens", "200", *sampling], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    streamed, _ = done.stdout.rsplit(b"\nmodel load ", 1)
    with Engine(demo, EngineSettings(num_threads=1), tokenizer=ByteTokenizer()) as engine:
        with engine.create_session(SessionConfig(sampler=SamplerConfig(temperature=50.0, seed=3))) as session:
            expected = session.generate("hello", max_new_tokens=200).text
    assert any(ord(character) > 0x7F and character != "\ufffd" for character in expected)  # whole characters made
    assert streamed.decode() == expected


def test_bench_prints_a_table():
    done = cli("bench", "--model", MODEL_FILES["default"], "--lora", adapter_path("torch_r4"),
               "--lora", adapter_path("litertlm_r4"), "--repeats", "1", "--steps", "8")
    assert done.returncode == 0, done.stderr
    assert "| decode step, base model |" in done.stdout and "switch a session" in done.stdout


def test_help_texts():
    for command in ("inspect", "generate", "convert", "bench"):
        done = cli(command, "--help")
        assert done.returncode == 0 and "usage: python -m runtime " + command in done.stdout


def test_inspect_model_and_adapter():
    model = cli("inspect", MODEL_FILES["transposed"])
    assert model.returncode == 0
    assert "LoRA slots r4, r16" in model.stdout and "transposed layout" in model.stdout
    assert "base weights map present" in model.stdout
    assert "decode attention xnnpack (standard ops)" in model.stdout
    assert "batched decode rows [2, 4] (LoRA slot r4), [2, 4] (LoRA slot r16)" in model.stdout
    assert "attention windows [16, 32]" in model.stdout and "prefill windows [16, 32]" in model.stdout
    # One line per kind of tensor, numbered by layer (and a batch's row), not one per tensor.
    assert "lora_atten_q_a_prime_weight_{0-1} (2)" in model.stdout and "[LoRA]" in model.stdout
    batch = model.stdout.split("signature decode_batch4_lora_r16:")[1].split("  signature ")[0].splitlines()
    assert "outputs kv_cache_k_{0-1}_{0-3}, kv_cache_v_{0-1}_{0-3}, logits" in batch[0]
    assert [line.split()[:2] for line in batch[3:5]] == [["kv_cache_k_{0-1}_{0-3}", "(8)"],
                                                          ["kv_cache_v_{0-1}_{0-3}", "(8)"]]
    assert len(batch) == 1 + 2 + 2 + 8  # tokens, input_pos, K and V caches, 8 LoRA factors of 2 layers each
    adapter = cli("inspect", adapter_path("litertlm_r4"), "--model", MODEL_FILES["default"])
    assert adapter.returncode == 0
    assert "convention litert-lm, rank 4" in adapter.stdout and "external" in adapter.stdout
    assert "fits" in adapter.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bogus = tmp_path / "bogus.tflite"
    bogus.write_bytes(b"\0" * 100)
    cases = [
        ("inspect", bogus),
        ("inspect", tmp_path / "missing.tflite"),
        ("inspect", adapter_path("wrong_hidden_r4"), "--model", MODEL_FILES["default"]),
        ("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "1,x"),
        ("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "1,999"),
        ("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "1", "--lora", tmp_path),
        ("generate", "--model", MODEL_FILES["default"], "--prompt", "text without a tokenizer"),
        ("inspect", "--check", adapter_path("torch_r4")),
        ("convert", adapter_path("torch_r4"), "--model", bogus, "--out", tmp_path / "o.tflite"),
        ("bench", "--model", tmp_path / "missing.tflite"),
    ]
    for case in cases:
        done = cli(*case)
        assert done.returncode == 2, case
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, (case, done.stderr)


def refused(*args: object, naming: str) -> None:
    """The command fails with one ``error:`` line naming ``naming``, and no traceback."""
    done = cli(*args)
    assert done.returncode == 2, (args, done.stderr)
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, (args, done.stderr)
    assert naming in done.stderr, (args, done.stderr)


def test_a_negative_seed_is_refused_naming_it():
    refused("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "1,2", "--seed", "-1", naming="seed=-1")


def test_a_directory_or_fifo_given_as_a_model_is_refused_naming_it(tmp_path):
    refused("inspect", MODELS, naming=f"{MODELS}: is a directory, expected a model file")
    refused("inspect", "--check", adapter_path("torch_r4"), "--model", MODELS,
            naming=f"{MODELS}: is a directory, expected a model file")
    os.mkfifo(tmp_path / "fifo")  # refused, not waited on for a writer
    refused("inspect", tmp_path / "fifo", naming="fifo: is not a regular file, expected a model file")


def test_convert_checks_its_output_first_and_leaves_nothing_behind(tmp_path):
    convert = ("convert", adapter_path("torch_r4"), "--model")
    bogus = tmp_path / "bogus.tflite"
    bogus.write_bytes(b"\0" * 100)  # the output is refused before the model is opened
    refused(*convert, bogus, "--out", tmp_path / "nodir" / "o.tflite",
            naming=f"o.tflite: the output directory {tmp_path / 'nodir'} does not exist")
    (tmp_path / "somedir").mkdir()
    refused(*convert, MODEL_FILES["default"], "--out", tmp_path / "somedir", naming="somedir: is a directory")
    copy = tmp_path / "model.tflite"
    copy.write_bytes(MODEL_FILES["default"].read_bytes())
    refused(*convert, copy, "--out", copy, naming=f"would replace the input {copy}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bogus.tflite", "model.tflite", "somedir"]
    assert list((tmp_path / "somedir").iterdir()) == []
    done = cli(*convert, MODEL_FILES["default"], "--out", tmp_path / "o.tflite")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bogus.tflite", "model.tflite", "o.tflite", "somedir"]


def test_bench_refuses_steps_and_repeats_it_cannot_measure():
    bench = ("bench", "--model", MODEL_FILES["default"])
    refused(*bench, "--steps", "0", naming="--steps 0: expected at least 1")
    refused(*bench, "--repeats", "0", naming="--repeats 0: expected at least 1")
    refused(*bench, "--steps", "200", naming="--steps 200: ")


def test_inspect_refuses_a_model_whose_attention_op_the_runtime_has_no_kernel_for(tmp_path):
    """As opening it does (generate), not "decode attention xnnpack" and exit 0."""
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.attention_rewrite import DECODE_ATTENTION, rewrite_decode_attention
    from runtime.util.flatbuffer_model import pack

    data, _ = rewrite_decode_attention(MODEL_FILES["transposed"].read_bytes())  # the op form alone
    model = schema.ModelT.InitFromPackedBuf(data, 0)
    for code in model.operatorCodes:
        if code.customCode == DECODE_ATTENTION.encode():
            code.customCode = b"vendor.flash_attention"
    path = tmp_path / "vendor.tflite"
    path.write_bytes(pack(model))
    naming = f"{path}: custom op 'vendor.flash_attention': this runtime has no kernel for it"
    refused("inspect", path, naming=naming)
    refused("generate", "--model", path, "--prompt-ids", "1,2", "--no-weight-cache",
            naming="custom op 'vendor.flash_attention' (subgraph")


def test_a_file_given_as_the_weight_cache_dir_is_refused_saying_so(tmp_path):
    (tmp_path / "notes.md").write_text("a file")
    refused("generate", "--model", MODEL_FILES["default"], "--prompt-ids", "1,2", "--weight-cache-dir",
            tmp_path / "notes.md", naming=f"INVALID_ARGUMENT: {tmp_path / 'notes.md'}: is a file, not a directory")
