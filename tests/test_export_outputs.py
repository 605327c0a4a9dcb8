"""PendingOutputs: every output appears at once, or none does."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.errors import InvalidArgumentError, NotFoundError
from runtime.export.outputs import PendingOutputs, check_targets


def test_commit_renames_every_output_into_place(tmp_path: Path) -> None:
    model, bundle = tmp_path / "m.tflite", tmp_path / "m.litertlm"
    with PendingOutputs([model, bundle]) as outputs:
        outputs.temporary(model).write_bytes(b"model")
        scratch = outputs.scratch(bundle, ".tflite")
        scratch.write_bytes(b"scratch")
        outputs.temporary(bundle).write_bytes(b"bundle")
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []
        outputs.commit()
    assert model.read_bytes() == b"model" and bundle.read_bytes() == b"bundle"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.litertlm", "m.tflite"]


def test_an_error_leaves_nothing_behind(tmp_path: Path) -> None:
    model = tmp_path / "m.tflite"
    with pytest.raises(RuntimeError, match="conversion failed"):
        with PendingOutputs([model]) as outputs:
            outputs.temporary(model).write_bytes(b"half a model")
            outputs.scratch(model, ".tmp").write_bytes(b"x")
            raise RuntimeError("conversion failed")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_is_replaced_only_on_commit(tmp_path: Path) -> None:
    model = tmp_path / "m.tflite"
    model.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with PendingOutputs([model]) as outputs:
            outputs.temporary(model).write_bytes(b"new")
            raise KeyboardInterrupt
    assert model.read_bytes() == b"old" and list(tmp_path.iterdir()) == [model]


def test_commit_without_writing_an_output_is_refused(tmp_path: Path) -> None:
    with PendingOutputs([tmp_path / "m.tflite"]) as outputs:
        with pytest.raises(InvalidArgumentError, match="nothing was written"):
            outputs.commit()
    assert list(tmp_path.iterdir()) == []


def test_targets_are_checked_before_anything_is_created(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="the output directory .*missing does not exist"):
        check_targets([tmp_path / "missing" / "m.tflite"])
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        check_targets([tmp_path])
    with pytest.raises(InvalidArgumentError, match="name the same file"):
        PendingOutputs([tmp_path / "m.tflite", tmp_path / "." / "m.tflite"])
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_would_replace_an_input_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(InvalidArgumentError, match=f"would replace a file of the input {checkpoint}"):
        check_targets([tmp_path / "m.tflite", checkpoint / "config.json"], sources=[checkpoint])
    with pytest.raises(InvalidArgumentError, match=f"would replace the input {gguf}"):
        PendingOutputs([tmp_path / "." / "model.gguf"], sources=[gguf])
    check_targets([checkpoint / "m.tflite", tmp_path / "m.tflite"], sources=[checkpoint, gguf])  # new files: fine
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoint", "config.json", "model.gguf"]
