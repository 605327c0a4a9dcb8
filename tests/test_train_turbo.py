"""``python -m runtime train-turbo`` (runtime/cli/train_turbo_command.py and the training in
runtime/export/turbo_training.py) on the tiny GQA model whose export with verify signatures
is committed (tests/models/turbo/): a few steps end to end, the output loaded by the
runtime with its heads (greedy output unchanged by them), a resumed run equal to an
uninterrupted one, heads trained on an exported trunk's own hidden states, and bad inputs
refused by name."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

import checkpoints  # noqa: E402
from conftest import MODELS  # noqa: E402
from runtime import Engine, EngineSettings, LoraSource, SessionConfig  # noqa: E402
from runtime.cli import train_turbo_command  # noqa: E402
from runtime.cli.main import main  # noqa: E402
from runtime.engine.speculative import SpeculationPolicy  # noqa: E402
from runtime.export.source import inspect_source  # noqa: E402
from runtime.export.turbo_data import read_examples  # noqa: E402
from runtime.export.turbo_settings import TurboRun, TurboSettings, check_run  # noqa: E402

pytestmark = pytest.mark.export
TRUNK = MODELS / "turbo" / "default.tflite"  # the tiny GQA model: verify4 (3 drafts), LoRA slots r4 and r8
LORA = MODELS / "peft" / "qkvo_r4"  # a rank-4 q/k/v/o LoRA of the same model
FLAGS = ["--num-heads", "3", "--rank", "4", "--alpha", "8", "--epochs", "2", "--batch", "4", "--head-steps", "12",
         "--head-batch", "64", "--lora-lr", "1e-2", "--holdout", "0.25", "--checkpoint-every", "3",
         "--log-every", "2", "--threads", "1"]
PROMPTS = [[1, 3, 30, 40, 50, 4], [1, 3, 120, 7, 4], [1, 3, 11, 10, 8, 7, 9, 6, 12, 4]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoints.write_gqa_directory(tmp_path_factory.mktemp("gqa") / "model")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 examples: three words, and the same words reversed."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "reverse.jsonl"
    lines = []
    for _ in range(16):
        words = [f"w{rng.randrange(20, 200)}" for _ in range(3)]
        lines.append(json.dumps({"instruction": " ".join(words), "output": " ".join(reversed(words)) + " ."}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(model: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run through the command line."""
    out = tmp_path_factory.mktemp("runs") / "turbo"
    assert main(["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]) == 0
    return out


def _generate(engine: Engine, source: LoraSource, prompt: list[int]):
    with engine.create_session(SessionConfig(loras=[source])) as session:
        return session.generate(prompt, max_new_tokens=24).tokens, session.stats().speculation


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def test_the_output_loads_with_its_heads_and_greedy_output_is_unchanged(trained: Path) -> None:
    record = json.loads((trained / "training.json").read_text())
    config = json.loads((trained / "adapter_config.json").read_text())
    assert (config["medusa_num_heads"], config["r"], config["lora_alpha"]) == (3, 4, 8)
    assert [phase["steps"] for phase in record["phases"].values()] == [6, 12]  # 12 examples / 4 x 2 epochs; heads
    assert len(record["held_out_top1_per_head"]) == 3 and record["held_out_examples"] == 4
    assert not (trained / "checkpoint").exists()
    tensors = _tensors(trained)
    assert tensors["medusa_head.0.linear.weight"].shape == (64, 64) and "medusa_head.vocab" in tensors
    assert any("lora_B" in key and np.any(value) for key, value in tensors.items())  # the LoRA was trained
    with Engine(TRUNK, EngineSettings(speculation=SpeculationPolicy(probe_verifies=10_000))) as engine:
        for prompt in PROMPTS:
            turbo, stats = _generate(engine, LoraSource(path=trained), prompt)
            plain, plain_stats = _generate(engine, LoraSource(path=trained, heads=False), prompt)
            assert turbo == plain
            assert stats.verifies > 0 and plain_stats.verifies == 0  # registered with its draft heads


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(model: Path, data: Path, trained: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    """Interrupted in the LoRA's phase, resumed, interrupted in the heads', resumed: the
    same adapter, bit for bit, as the run never interrupted."""
    out = tmp_path / "turbo"
    argv = ["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
    for stop in ("lora step 4/", "heads step 10/"):
        _interrupted(argv + (["--resume"] if out.exists() else []), stop, monkeypatch, capsys)
        assert (out / "checkpoint" / "state.pt").is_file()
    assert main(argv + ["--resume"]) == 0
    resumed, uninterrupted = _tensors(out), _tensors(trained)
    assert sorted(resumed) == sorted(uninterrupted)
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def _interrupted(argv: list[str], at: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """Runs ``argv`` until a log line starts with ``at``, as Ctrl-C would stop it there;
    returns what it said on stderr."""
    def log(text: str) -> None:
        if text.startswith(at):
            raise KeyboardInterrupt
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(train_turbo_command, "_log", log)
        assert main(argv) == train_turbo_command.INTERRUPTED
    return capsys.readouterr().err


def test_a_run_interrupted_while_writing_the_adapter_leaves_no_partial_file(
        model: Path, data: Path, trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C half-way through the adapter's weights: only the checkpoint is left, and
    --resume writes the adapter the run never interrupted writes."""
    import safetensors.numpy

    def half_written(tensors, path):
        Path(path).write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    out = tmp_path / "turbo"
    argv = ["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
    with monkeypatch.context() as patch:
        patch.setattr(safetensors.numpy, "save_file", half_written)
        assert main(argv) == train_turbo_command.INTERRUPTED
    assert [path.name for path in out.iterdir()] == ["checkpoint"]
    assert main(argv + ["--resume"]) == 0
    resumed, uninterrupted = _tensors(out), _tensors(trained)
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def test_a_run_interrupted_while_removing_its_checkpoint_has_written_its_adapter(
        model: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Half of the checkpoint removed (here run.json, without which --resume refuses) must not
    be left for a checkpoint: the adapter is complete, and the run says so."""
    import shutil

    from runtime.export import turbo_training

    rmtree = shutil.rmtree

    def half_removed(path, ignore_errors=False):
        if ignore_errors:
            return rmtree(path, ignore_errors=True)
        (Path(path) / "run.json").unlink()
        raise KeyboardInterrupt

    out = tmp_path / "turbo"
    with monkeypatch.context() as patch:
        patch.setattr(turbo_training.shutil, "rmtree", half_removed)
        argv = ["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
        assert main(argv) == train_turbo_command.INTERRUPTED
    assert capsys.readouterr().err.strip() == f"interrupted as the run ended: {out} is written"
    assert not (out / "checkpoint").exists()
    with Engine(TRUNK) as engine:
        assert _generate(engine, LoraSource(path=out), PROMPTS[0])[1].verifies > 0


def test_an_interrupted_run_says_what_it_kept(model: Path, data: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "turbo"
    argv = ["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
    assert _interrupted(argv, "lora step 2/", monkeypatch, capsys).strip().splitlines() == [
        "interrupted before the first checkpoint: nothing kept"]  # checkpoints every 3 steps
    assert not out.exists()
    assert _interrupted(argv, "lora step 4/", monkeypatch, capsys).strip().splitlines() == [
        f"interrupted: the checkpoint in {out / 'checkpoint'} is kept; the same command with --resume continues it"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other shapes", "its LoRA truncated"])
def test_a_corrupt_checkpoint_is_refused_naming_the_file(model: Path, data: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture, damage: str) -> None:
    out = tmp_path / "turbo"
    argv = ["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
    _interrupted(argv, "heads step 4/" if damage == "its LoRA truncated" else "lora step 4/", monkeypatch, capsys)
    state = out / "checkpoint" / "state.pt"
    if damage == "its LoRA truncated":  # the LoRA phase's result, saved before the heads' phase
        state = out / "checkpoint" / "lora" / "adapter_model.safetensors"  # the file the refusal must name
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "garbage":
        state.write_bytes(b"not a checkpoint")
    elif damage == "truncated":
        state.write_bytes(state.read_bytes()[:state.stat().st_size // 2])
    else:  # a checkpoint whose LoRA has another rank than its run.json says
        saved = torch.load(state, weights_only=True)
        saved["params"] = {name: torch.zeros(8, *value.shape[1:]) for name, value in saved["params"].items()}
        torch.save(saved, state)
    err = _refusal(capsys, argv[1:] + ["--resume"])
    assert f"--resume: {state} cannot be read as this run's checkpoint" in err and len(err.strip().splitlines()) == 1


def test_a_corrupt_distillation_cache_is_computed_again(model: Path, data: Path, trained: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """checkpoint/distill.npz is what the trunk answered: unreadable, it is answered again,
    to the same adapter as the run never interrupted."""
    out = tmp_path / "turbo"
    argv = ["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
    _interrupted(argv, "heads step 4/", monkeypatch, capsys)
    cache = out / "checkpoint" / "distill.npz"
    cache.write_bytes(cache.read_bytes()[:100])
    assert main(argv + ["--resume"]) == 0
    assert f"{cache} cannot be read (" in capsys.readouterr().out
    resumed, uninterrupted = _tensors(out), _tensors(trained)
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def test_heads_trained_on_the_exported_trunks_own_hidden_states(model: Path, data: Path, tmp_path: Path) -> None:
    """--trunk: the exported model answers and its verify signature's hidden states train the
    heads, here on an existing LoRA (--lora); those states are torch's, to float error."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[2]
    with Engine(TRUNK) as engine, engine.create_session(SessionConfig(loras=[LoraSource(path=LORA)])) as session:
        session.run_prefill(prompt[:3])
        exported = session.hidden_states(prompt[3:])  # 7 tokens: two verify4 runs
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(LORA)).eval()
    with torch.inference_mode():
        reference = peft_model.get_base_model().model(input_ids=torch.tensor([prompt])).last_hidden_state[0, 3:]
    np.testing.assert_allclose(exported, reference.numpy(), atol=2e-4)

    out = tmp_path / "turbo"
    assert main(["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), "--lora", str(LORA),
                 "--trunk", str(TRUNK), *FLAGS]) == 0
    assert json.loads((out / "training.json").read_text())["run"]["trunk"] == str(TRUNK.resolve())
    lora = {key: value for key, value in _tensors(LORA).items()}
    written = _tensors(out)
    for key, value in lora.items():
        np.testing.assert_array_equal(written[key], value)  # the LoRA as given, heads added
    with Engine(TRUNK) as engine:
        for prompt in PROMPTS:
            assert _generate(engine, LoraSource(path=out), prompt)[0] == _generate(
                engine, LoraSource(path=out, heads=False), prompt)[0]


def _near_the_trunks_end(path: Path, words: int, count: int) -> list[str]:
    """Writes ``count`` examples whose prompts of ``words`` + 1 words leave the exported
    trunk's 64-position KV cache room for an answer of 1 token (55) or 2 (54); returns the
    flags training heads for it on that trunk."""
    path.write_text("".join(json.dumps({"instruction": " ".join(["w30"] * words + [f"w{40 + i}"]),
                                        "output": "w31 w32"}) + "\n" for i in range(count)))
    return ["--lora", str(LORA), "--trunk", str(TRUNK), "--num-heads", "3", "--holdout", "0", "--threads", "1"]


def test_answers_too_short_for_any_head_are_refused(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "long.jsonl"
    flags = _near_the_trunks_end(data, 55, 4)
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"), *flags])
    assert f"{data}: the trunk answered each of the 4 training prompts with a single token: no head has a token" in err
    assert not (tmp_path / "out").exists()


def test_heads_train_when_few_positions_have_a_target(model: Path, tmp_path: Path) -> None:
    """One example answered in 2 tokens: of its 2 positions one has a target; a heads batch
    drawn from both could hold none (no loss to step on: it stopped the run)."""
    data = tmp_path / "long.jsonl"
    flags = _near_the_trunks_end(data, 54, 1)
    out = tmp_path / "out"
    assert main(["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *flags,
                 "--head-steps", "30"]) == 0
    assert json.loads((out / "training.json").read_text())["phases"]["heads"]["log"][-1]["top1"][0] == 1.0


def test_joint_training_writes_a_loadable_adapter(model: Path, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "joint"
    assert main(["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), "--joint",
                 *FLAGS]) == 0
    record = json.loads((out / "training.json").read_text())
    assert list(record["phases"]) == ["joint"] and len(record["phases"]["joint"]["log"][-1]["top1"]) == 3
    assert len(record["held_out_top1_per_head"]) == 3  # the 4 examples --holdout 0.25 kept out, measured
    with Engine(TRUNK) as engine:
        assert _generate(engine, LoraSource(path=out), PROMPTS[0])[0] == _generate(
            engine, LoraSource(path=out, heads=False), PROMPTS[0])[0]


def test_every_long_phase_shows_progress(model: Path, data: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples' encoding and the trunk's answers too (generation: the longest wait
    before the heads' steps)."""
    shown = []

    def bar(description: str, unit: str = "it"):
        def wrap(items):
            items = list(items)
            shown.append((description, len(items)))
            return items
        return wrap

    monkeypatch.setattr(train_turbo_command, "progress_bar", bar)
    assert main(["train-turbo", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "turbo"),
                 *FLAGS]) == 0
    assert shown == [("train-turbo examples", 16), ("train-turbo lora", 6), ("train-turbo answers (train)", 1), ("train-turbo states (train)", 12),
                     ("train-turbo answers (test)", 1), ("train-turbo states (test)", 4), ("train-turbo heads", 12)]


def test_repeated_examples_are_not_held_out_against_themselves(model: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    """Eight copies of one example: nothing is left to hold out, and the run says so (with
    what it trained on) rather than reporting the heads' top-1 on copies of their training
    data."""
    data = tmp_path / "same.jsonl"
    data.write_text((json.dumps({"instruction": "w20 w30", "output": "w30 w20"}) + "\n") * 8)
    out = tmp_path / "turbo"
    assert main(["train-turbo", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "training.json").read_text())
    assert (record["distinct_examples"], record["train_examples"], record["held_out_examples"]) == (1, 8, 0)
    assert "7 of 8 examples repeat an earlier one" in printed
    assert printed.strip().splitlines()[-1].endswith(
        "trained on 8 of 8 examples (lora 4 steps, heads 12 steps), 0 s; no held-out examples to measure the heads "
        "on (--holdout 0.25 of 1 distinct examples)")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_other_families_train(family: str, data: Path, tmp_path: Path) -> None:
    """The tiny random model of each other family (tools/build_family_fixtures.py), with the
    word-level tokenizer and its chat template: a few steps through every phase."""
    from tools.build_family_fixtures import FAMILIES, build_hf_model

    model = build_hf_model(next(spec for spec in FAMILIES if spec.name == family))
    model.save_pretrained(tmp_path / "model")
    checkpoints.write_tokenizer(tmp_path / "model", model.config.vocab_size)
    out = tmp_path / "turbo"
    assert main(["train-turbo", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(out),
                 "--num-heads", "2", "--rank", "4", "--epochs", "1", "--head-steps", "6", "--threads", "1"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert [phase["steps"] for phase in record["phases"].values()] == [4, 6]
    assert "medusa_head.1.linear.weight" in _tensors(out)


def _refusal(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(["train-turbo", *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("a.jsonl", '{"instruction": "x", "output": "y"}\n{"instruction": "x"}\n', "a.jsonl: line 2: field 'output' is missing"),
    ("b.jsonl", '{"instruction": "x", "output": "y"}\n\n{"instruction": 3, "output": "y"}\n',
     "b.jsonl: line 3: field 'instruction' must be a non-empty string"),
    ("c.jsonl", '{"instruction": "x", "output": "y"}\nnot json\n', "c.jsonl: line 2: not valid JSON"),
    ("d.json", '[{"instruction": "x", "output": "y"}, ["x", "y"]]', "d.json: item 1: expected an object"),
    ("e.json", '{"instruction": "x", "output": "y"}', "e.json: expected a JSON list"),
    ("l.json", '{"instruction": "x", "output": "y"}\n{"instruction": "x", "output": "y"}\n',
     "l.json: not valid JSON: Extra data: line 2 column 1 (char 36) (a record a line is JSONL: name the file .jsonl)"),
    ("f.json", '[{"instruction": "x", "output": ""}]', "f.json: item 0: field 'output' must be a non-empty"),
    ("g.json", "[]", "g.json: no examples"),
    ("h.json", "\n", "h.json: empty (expected a JSON list"),
    pytest.param("k.jsonl", '{"instruction": "x", "output": "y"}\n' + "[" * 100_000 + "\n",
                 "k.jsonl: line 2: JSON nested too deeply", id="k.jsonl-deep"),
    ("j.jsonl", '{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}\n',
     "j.jsonl: line 1: field 'messages' holds a chat, which is not read: expected \"instruction\" and \"output\""),
    ("i.jsonl", '{"instruction": "x", "output": "y"}\n{"instruction": "x", "output": "y", "input": "a \\ud800"}\n',
     "i.jsonl: line 2: field 'input' holds '\\ud800' at character 2, a lone UTF-16 surrogate"),
])
def test_bad_data_is_refused_naming_file_line_and_field(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        name: str, text: str, expected: str) -> None:
    (tmp_path / name).write_text(text)
    err = _refusal(capsys, ["--model", str(model), "--data", str(tmp_path / name), "--out", str(tmp_path / "out")])
    assert expected in err
    assert not (tmp_path / "out").exists()


def test_data_is_read_as_json_reads_it(tmp_path: Path) -> None:
    """A byte-order mark, and U+2028 / U+0085 raw inside a JSONL line's strings (valid JSON,
    which ``str.splitlines`` would break the line at)."""
    from runtime.export.turbo_data import read_examples

    lines = [json.dumps({"instruction": f"a\u2028b{i}\x85", "output": "c"}, ensure_ascii=False) for i in range(3)]
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    assert [example.instruction for example in read_examples(tmp_path / "a.jsonl")] == [
        f"a\u2028b{i}\x85" for i in range(3)]


def test_data_that_is_not_a_regular_file_is_refused(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)  # reading it would block until a writer came
    err = _refusal(capsys, ["--model", str(model), "--data", str(fifo), "--out", str(tmp_path / "out")])
    assert f"{fifo}: not a regular file or directory" in err
    assert not (tmp_path / "out").exists()


def test_an_out_that_could_not_be_created_is_refused(model: Path, data: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """In a folder that does not exist (not created: ``export --out`` refuses it too), or
    under a file: one line before the model loads, nothing written."""
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "missing" / "deeper" / "out", tmp_path / "file" / "out"):
        err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(out)])
        assert f"--out {out}: {out.parent} is not an existing directory" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bad_runs_are_refused_before_any_training(model: Path, data: Path, trained: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "out")
    common = ["--model", str(model), "--data", str(data)]
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert "model_type 'gpt2') is not supported; supported: Llama" in _refusal(
        capsys, ["--model", str(gpt2), "--data", str(data), "--out", out])
    untokenized = tmp_path / "untokenized"
    shutil.copytree(model, untokenized, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    assert "no tokenizer (tokenizer.json or tokenizer.model or vocab.json or vocab.txt), which train-turbo encodes " \
           "the examples with" in \
        _refusal(capsys, ["--model", str(untokenized), "--data", str(data), "--out", out])
    assert f"--out {trained} exists" in _refusal(capsys, [*common, "--out", str(trained)])
    assert "no checkpoint to resume" in _refusal(capsys, [*common, "--out", str(trained), "--resume"])
    assert "no such file or directory" in _refusal(capsys, ["--model", str(model), "--data", str(tmp_path / "none"),
                                                             "--out", out])
    assert "give one of them" in _refusal(capsys, [*common, "--out", out, "--joint", "--lora", str(LORA)])
    assert "--lora" in _refusal(capsys, [*common, "--out", out, "--lora", str(tmp_path)])
    assert "--num-heads 0: expected a positive integer" in _refusal(capsys, [*common, "--out", out, "--num-heads", "0"])
    assert "--warmup-ratio 1.5" in _refusal(capsys, [*common, "--out", out, "--warmup-ratio", "1.5"])
    no_verify = MODELS / "gqa_default.tflite"
    assert "no verify signatures" in _refusal(capsys, [*common, "--out", out, "--trunk", str(no_verify)])
    assert "checks 3 drafts; give --num-heads 3" in _refusal(capsys, [*common, "--out", out, "--trunk", str(TRUNK)])
    assert not (tmp_path / "out").exists()


def test_examples_longer_than_the_models_context_are_left_out(model: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """The tiny model's context is 64 positions: a --seq-len above it does not let longer
    examples in."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"instruction": " ".join(["w30"] * 80), "output": "w31"}) + "\n")
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"),
                            "--seq-len", "1000"])
    assert f"{data}: every example is longer than the model's context (64; --seq-len 1000) tokens" in err
    assert not (tmp_path / "out").exists()


def test_a_lora_of_another_model_is_refused_and_leaves_nothing(model: Path, data: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    other = MODELS / "families" / "qwen3" / "adapter"
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"),
                            "--lora", str(other), *FLAGS])
    assert f"{other}: peft cannot load this LoRA on {model}" in err
    assert not (tmp_path / "out").exists()


def test_a_resumed_run_must_be_given_the_same_settings_and_data(model: Path, data: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    spec = TurboRun(model=model, data=data, out=out, settings=TurboSettings(rank=4))
    (out / "checkpoint" / "run.json").write_text(json.dumps(spec.describe(inspect_source(model), read_examples(data))))
    check_run(spec, resume=True)
    monkeypatch.chdir(model.parent)  # the same model named by a relative path is the same run
    check_run(dataclasses.replace(spec, model=Path(model.name)), resume=True)
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(out), "--resume", "--rank", "8"])
    assert "other settings (rank: 4, now 8)" in err
    edited = tmp_path / data.name  # the same examples but one, at the path the checkpoint names
    edited.write_text(data.read_text().replace("w", "v", 1))
    spec = dataclasses.replace(spec, data=edited)
    (out / "checkpoint" / "run.json").write_text(json.dumps(spec.describe(inspect_source(model), read_examples(data))))
    err = _refusal(capsys, ["--model", str(model), "--data", str(edited), "--out", str(out), "--resume", "--rank", "4"])
    assert "other settings (data_sha256: " in err and len(err.strip().splitlines()) == 1


def test_a_resumed_run_must_be_given_the_same_lora_and_trunk_files(model: Path, data: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Another LoRA or another export copied over the checkpointed run's (the same paths) is
    not that run's: its heads would continue on other states."""
    lora, trunk, out = tmp_path / "lora", tmp_path / "trunk.tflite", tmp_path / "out"
    shutil.copytree(LORA, lora)
    shutil.copy(TRUNK, trunk)
    (out / "checkpoint").mkdir(parents=True)
    spec = TurboRun(model=model, data=data, out=out, settings=TurboSettings(), lora=lora, trunk=trunk)
    (out / "checkpoint" / "run.json").write_text(json.dumps(spec.describe(inspect_source(model), read_examples(data))))
    check_run(spec, resume=True)
    argv = ["--model", str(model), "--data", str(data), "--out", str(out), "--resume", "--lora", str(lora),
            "--trunk", str(trunk)]
    for changed, field in ((trunk, "trunk_sha256"), (lora / "adapter_model.safetensors", "lora_sha256")):
        original = changed.read_bytes()
        changed.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        err = _refusal(capsys, argv)
        assert f"other settings ({field}: " in err and len(err.strip().splitlines()) == 1
        changed.write_bytes(original)
    check_run(spec, resume=True)


def test_without_the_export_extra_one_line_names_it(monkeypatch: pytest.MonkeyPatch, model: Path, data: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "runtime.export.turbo_training", None)  # its import fails as without torch
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out")])
    assert 'pip install -e ".[export]"' in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("flag", "value"), [("--lora-lr", "inf"), ("--head-lr", "nan"), ("--head-weight", "nan"),
                                             ("--head-weight", "inf")])
def test_non_finite_rates_and_weights_are_refused_naming_the_flag(model: Path, data: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture, flag: str,
                                                                  value: str) -> None:
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"), flag, value])
    assert f"{flag} {float(value)}: expected a finite" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("record", [b'{"model": ', b"\xff\xfe", b"[1, 2]"])
def test_a_corrupt_checkpoint_record_is_refused_naming_it(model: Path, data: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture, record: bytes) -> None:
    saved = tmp_path / "out" / "checkpoint" / "run.json"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(record)
    err = _refusal(capsys, ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"), "--resume"])
    assert f"--resume: {saved} cannot be read as the checkpointed run" in err and len(err.strip().splitlines()) == 1
    assert saved.read_bytes() == record
