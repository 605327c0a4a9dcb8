"""``python -m runtime export`` refuses bad input with one ``error:`` line and exit code 2,
writing nothing. None of these cases needs torch: they are refused before it is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import write_llama_directory, write_llama_gguf


def export(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "export", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def refused(done: subprocess.CompletedProcess, match: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert match in lines[0], lines[0]
    assert done.stdout == ""


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_llama_directory(tmp_path / "llama")


def test_missing_config_json(tmp_path: Path, source: Path) -> None:
    (source / "config.json").unlink()
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m.tflite"), "no config.json")
    assert files(tmp_path) == before


def test_unknown_architecture(tmp_path: Path, source: Path) -> None:
    (source / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m.tflite", "--bundle", tmp_path / "m.litertlm"),
            "architecture MambaForCausalLM (model_type 'mamba') is not supported; supported: Llama")
    assert files(tmp_path) == before


def test_truncated_safetensors(tmp_path: Path, source: Path) -> None:
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m.tflite"), "model.safetensors: corrupt or truncated safetensors")
    assert files(tmp_path) == before


def test_truncated_gguf(tmp_path: Path) -> None:
    gguf = write_llama_gguf(tmp_path / "tiny.gguf")
    gguf.write_bytes(gguf.read_bytes()[:-2000])
    before = files(tmp_path)
    refused(export(gguf, "--out", tmp_path / "m.tflite"), "tiny.gguf: corrupt or truncated GGUF")
    assert files(tmp_path) == before


def test_output_in_a_missing_directory(tmp_path: Path, source: Path) -> None:
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "nowhere" / "m.tflite"), "the output directory")
    refused(export(source, "--out", tmp_path / "m.tflite", "--bundle", tmp_path / "nowhere" / "m.litertlm"),
            "nowhere does not exist")
    assert files(tmp_path) == before


@pytest.mark.parametrize("ranks, match", [("0", "lora_ranks=(0,)"), ("8,-8", "every value must be >= 1"),
                                          ("8,x", "--lora-ranks '8,x': expected comma-separated integers")])
def test_bad_ranks(tmp_path: Path, source: Path, ranks: str, match: str) -> None:
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m.tflite", "--lora-ranks", ranks), match)
    assert files(tmp_path) == before


def test_prefill_longer_than_the_kv_cache_and_no_output(tmp_path: Path, source: Path) -> None:
    refused(export(source, "--out", tmp_path / "m.tflite", "--kv-length", "64", "--prefill-lengths", "8,128"),
            "prefill_lengths [128] exceed kv_length=64")
    refused(export(source, "--out", tmp_path / "m.tflite", "--kv-length", "64", "--prefill-lengths", "8",
                    "--attention-windows", "16,64"),
            "attention_windows [64] are not shorter than kv_length=64")
    refused(export(source, "--out", tmp_path / "m.tflite", "--kv-length", "64", "--prefill-lengths", "8,16",
                    "--prefill-windows", "4"),
            "prefill_windows [4] are shorter than every prefill length [8, 16]")
    refused(export(source), "give --out MODEL.tflite, --bundle MODEL.litertlm or both")


def test_the_kv_length_defaults_to_the_models_context(tmp_path: Path, source: Path) -> None:
    """The test checkpoint states 256 positions (max_position_embeddings): without --kv-length
    the cache is that long, so a longer prefill is refused naming it."""
    refused(export(source, "--out", tmp_path / "m.tflite", "--prefill-lengths", "8,300"),
            "prefill_lengths [300] exceed kv_length=256")
    refused(export(source, "--out", tmp_path / "m.tflite", "--prefill-windows", "nonsense"),
            "--prefill-windows 'nonsense': expected comma-separated integers")


def test_a_memory_budget_the_model_cannot_fit_and_bad_jobs(tmp_path: Path, source: Path) -> None:
    refused(export(source, "--out", tmp_path / "m.tflite", "--max-memory", "0.5"),
            "needs about 2.3 GB to export, more than the 0.5 GB of --max-memory")
    refused(export(source, "--out", tmp_path / "m.tflite", "--jobs", "0"), "--jobs 0: expected at least 1")
    assert files(tmp_path) == files(source.parent)


@pytest.mark.parametrize("quantize, out, match", [
    ("int9", "m.tflite", "--quantize 'int9': expected one or more of none, int8"),
    ("none,int8,none", "m-{precision}.tflite", "--quantize 'none,int8,none': a quantization given twice"),
    ("none,int8", "m.tflite", "--out {tmp}/m.tflite: with several --quantize values (none, int8) the file name needs "
                              "{precision}, e.g. model-{precision}.tflite"),
])
def test_bad_quantizations(tmp_path: Path, source: Path, quantize: str, out: str, match: str) -> None:
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / out, "--quantize", quantize), match.replace("{tmp}", str(tmp_path)))
    assert files(tmp_path) == before


def test_the_native_attention_kernel_with_a_bundle_or_the_default_layout(tmp_path: Path, source: Path) -> None:
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m.tflite", "--bundle", tmp_path / "m.litertlm",
                   "--attention-kernel", "native"),
            "--attention-kernel native with --bundle: a .litertlm bundle is for LiteRT-LM, which runs standard ops")
    refused(export(source, "--bundle", tmp_path / "m.litertlm", "--attention-kernel", "native"), "with --bundle")
    refused(export(source, "--out", tmp_path / "m.tflite", "--kv-layout", "default", "--attention-kernel", "native"),
            "--attention-kernel native with --kv-layout default: the kernel reads the transposed and grouped layouts only")
    assert files(tmp_path) == before


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_a_memory_budget_that_is_not_a_finite_positive_size(tmp_path: Path, source: Path, value: str) -> None:
    refused(export(source, "--out", tmp_path / "m.tflite", f"--max-memory={value}"),
            f"--max-memory {float(value)}: expected a finite number of GB > 0")
    assert files(tmp_path) == files(source.parent)


def test_the_report_is_checked_as_an_output_and_no_output_replaces_the_source(tmp_path: Path, source: Path) -> None:
    """Refused before torch: each would have failed, or replaced a finished model or the
    checkpoint, only once the whole export was done."""
    before = files(tmp_path)
    out = tmp_path / "e.tflite"
    refused(export(source, "--out", out, "--report", out), f"the outputs {out}, {out} name the same file")
    refused(export(source, "--out", out, "--bundle", tmp_path / "e.litertlm", "--report", tmp_path / "e.litertlm"),
            "name the same file")
    refused(export(source, "--out", out, "--report", tmp_path), f"{tmp_path}: is a directory, expected a file name")
    refused(export(source, "--out", out, "--report", tmp_path / "nowhere" / "r.json"),
            f"r.json: the output directory {tmp_path / 'nowhere'} does not exist")
    refused(export(source, "--out", source / "model.safetensors"),
            f"model.safetensors: would replace a file of the input {source}")
    refused(export(source, "--out", out, "--report", source / "config.json"),
            f"config.json: would replace a file of the input {source}")
    gguf = write_llama_gguf(tmp_path / "tiny.gguf")
    refused(export(gguf, "--out", gguf), f"would replace the input {gguf}")
    gguf.unlink()
    assert files(tmp_path) == before


@pytest.mark.export
def test_the_export_api_refuses_an_output_that_would_replace_its_source(tmp_path: Path) -> None:
    """``export`` checked its outputs against each other only: called with the GGUF file it
    reads as ``model_out``, it would have renamed the finished model over the checkpoint."""
    pytest.importorskip("torch")  # the exporter's modules import it; the README's test command has none
    from runtime.errors import InvalidArgumentError
    from runtime.export import exporter
    from runtime.export.settings import ExportSettings
    from runtime.export.source import inspect_source

    gguf = write_llama_gguf(tmp_path / "tiny.gguf")
    before = gguf.read_bytes()
    with pytest.raises(InvalidArgumentError, match=f"would replace the input {gguf}"):
        exporter.export(inspect_source(gguf), ExportSettings(), model_out=gguf)
    assert gguf.read_bytes() == before and files(tmp_path) == {"tiny.gguf"}


def test_checkpoint_contents_refused_before_torch(tmp_path: Path, source: Path) -> None:
    """config.json's values and the weights' tensors are checked from headers: one line naming
    the field or tensor, nothing written (transformers would fill an untied lm_head at random)."""
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m.tflite"), "the weights have no tensor lm_head.weight [96, 32]")
    (source / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    refused(export(source, "--out", tmp_path / "m.tflite"), "num_attention_heads 4 is not a multiple of "
            "num_key_value_heads 3")
    assert files(tmp_path) == before


def test_a_bundle_without_a_tokenizer(tmp_path: Path) -> None:
    source = write_llama_directory(tmp_path / "llama", tokenizer=False)
    gguf = write_llama_gguf(tmp_path / "tiny.gguf")
    before = files(tmp_path)
    refused(export(source, "--bundle", tmp_path / "m.litertlm"), "llama: no tokenizer (tokenizer.json or")
    refused(export(gguf, "--out", tmp_path / "m.tflite", "--bundle", tmp_path / "m.litertlm"),
            "tiny.gguf: no tokenizer (tokenizer.ggml.model metadata), which a bundle carries")
    assert files(tmp_path) == before


def test_a_quantization_block_that_does_not_divide_the_weights(tmp_path: Path, source: Path) -> None:
    """Refused before torch; the quantizer said so only after every signature was lowered."""
    before = files(tmp_path)
    refused(export(source, "--out", tmp_path / "m-{precision}.tflite", "--quantize", "none,int4-block128"),
            "quantize='int4-block128' does not fit this model: its hidden_size 32 is not divisible by block size 128")
    assert files(tmp_path) == before
