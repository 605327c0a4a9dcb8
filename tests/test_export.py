"""runtime.export end to end (needs the ``export`` extra): a tiny Llama directory and the same
weights as a GGUF file are exported, checked against float64 transformers (+ peft) through
this runtime, bundled with tokenizer, stop tokens and chat template; failures leave nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("litert_torch")

import checkpoints  # noqa: E402
from tflite_ops import signature_graphs  # noqa: E402
from runtime import Engine, InvalidArgumentError, SamplerConfig, SessionConfig  # noqa: E402
from runtime.export import families  # noqa: E402
from runtime.export.bundle import write_bundle  # noqa: E402
from runtime.export.exporter import export  # noqa: E402
from runtime.export.settings import QUANTIZATIONS, ExportSettings  # noqa: E402
from runtime.export.source import FAMILIES, inspect_source  # noqa: E402
from runtime.errors import NotFoundError  # noqa: E402
from runtime.util.model_weights import ModelWeights  # noqa: E402
from runtime.util.signature_names import LoraSlot  # noqa: E402

pytestmark = pytest.mark.export
PROMPT_LEN, TOKENS = 6, 24
TOKEN_IDS = [int(t) for t in np.random.default_rng(3).integers(5, checkpoints.VOCAB, TOKENS)]


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *map(str, args)], capture_output=True, text=True,
                          timeout=900)


def transformers_logits(model_dir: Path, adapter: Path | None = None) -> np.ndarray:
    """float64 logits of TOKEN_IDS from the prompt's last position on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKEN_IDS])).logits[0].numpy()
    return logits[PROMPT_LEN - 1:]


def runtime_logits(model: Path, adapter: Path | None = None) -> np.ndarray:
    with Engine(model) as engine, engine.create_session(SessionConfig(lora_path=adapter)) as session:
        rows = [session.run_prefill(TOKEN_IDS[:PROMPT_LEN])]
        rows += [session.run_decode(token) for token in TOKEN_IDS[PROMPT_LEN:]]
    return np.stack(rows)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(model_dir: Path, out: Path, targets: list[str] = ATTENTION, rank: int = 4) -> Path:
    """A random PEFT adapter of ``rank`` (4 by default) on ``targets`` (q/k/v/o by default),
    saved by peft; its weights shrink with the rank, so that its effect is alike at any rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3 * (4 / rank) ** 0.25)
    peft_model.save_pretrained(out)
    return out


@dataclass(frozen=True)
class Exported:
    """The tiny Llama's source directory and what the export command made of it."""

    source: Path
    model: Path
    bundle: Path
    run: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The tiny Llama exported once through the command line: a .tflite and a bundle."""
    work = tmp_path_factory.mktemp("export")
    source = checkpoints.write_llama_directory(work / "llama")
    (work / "out").mkdir()
    model, bundle = work / "out" / "tiny.tflite", work / "out" / "tiny.litertlm"
    done = cli("export", source, "--out", model, "--bundle", bundle, "--lora-ranks", "4", "--kv-length", "64",
               "--prefill-lengths", "8", "--batch-sizes", "3", "--attention-windows", "16", "--score-lengths", "8",
               "--jobs", "2",
               "--verbose", "--report", work / "report.json")
    assert done.returncode == 0, done.stderr
    return Exported(source, model, bundle, done)


def test_the_report_times_every_stage_and_signature_and_the_peak_memory(exported: Exported) -> None:
    report = json.loads((exported.model.parent.parent / "report.json").read_text())
    with Engine(exported.model) as engine:
        assert sorted(s["name"] for s in report["signatures"]) == sorted(engine.spec.signatures)
    assert report["jobs"] == 2 and sorted({s["worker"] for s in report["signatures"]}) == [0, 1]
    stages = [stage["name"] for stage in report["stages"]]
    assert stages == ["read the tokenizer", "load the weights", "build the litert-torch model",
                      "save the model for the workers", "trace, lower, convert in 2 workers",
                      "merge the workers' modules", "serialize", "rewrite decode attention (both forms)",
                      "write the bundle"]
    assert len(report["worker_convert_seconds"]) == len(report["worker_peak_rss_bytes"]) == 2
    # merging, serializing and quantizing run in a process without torch and litert-torch
    assert 0 < report["finisher_peak_rss_bytes"] < report["exporter_peak_rss_bytes"] / 2
    # the whole tree's peak covers each worker's own peak plus the exporter's
    assert report["peak_rss_bytes"] > max(report["worker_peak_rss_bytes"])
    # PSS counts the pages the processes share (libraries, the memory-mapped weights) once
    assert 0 < report["peak_pss_bytes"] <= report["peak_rss_bytes"]
    assert report["seconds"] >= sum(stage["seconds"] for stage in report["stages"]) - 0.5
    for stage in stages:  # --verbose prints the same breakdown
        assert re.search(rf"^{re.escape(stage)} +[0-9.]+ +[0-9.]+ GB +[0-9.]+ GB$", exported.run.stdout,
                         re.MULTILINE), stage


def test_the_command_writes_both_outputs_and_nothing_else(exported: Exported) -> None:
    from runtime.util.attention_rewrite import OUR_OPS, attention_forms, custom_codes
    from runtime.util.litertlm_bundle import LitertLmBundle

    assert sorted(p.name for p in exported.model.parent.iterdir()) == ["tiny.litertlm", "tiny.tflite"]
    # By default the .tflite carries both forms of decode attention (the op form's LoRA deltas and
    # float32 linears as ops too: the export has slots); the bundle, for LiteRT-LM, standard ops only.
    assert attention_forms(exported.model.read_bytes()) and custom_codes(exported.model.read_bytes()) == set(OUR_OPS)
    with LitertLmBundle(exported.bundle) as bundle:
        section = bundle.section_bytes(bundle.model_section())
        assert custom_codes(section) == set() and attention_forms(section) == {}
    assert f"wrote {exported.model}" in exported.run.stdout
    assert "LoRA slots [4], KV length 64" in exported.run.stdout
    # the libraries' warnings stay off stderr; off a terminal it holds a line per step, ours
    steps = exported.run.stderr.splitlines()
    assert steps and all(re.fullmatch(r"export: .+ \(\d+ done, \d+ s\)", line) for line in steps), steps
    assert any("load the weights" in line for line in steps)
    all_linear = LoraSlot(4, "all-linear")  # by default beside the attention-only slot, for Llama
    with Engine(exported.model) as engine:
        spec = engine.spec
        assert spec.slots == (LoraSlot(4), all_linear) and spec.kv_length == 64
        assert spec.prefill_lengths == (8,)
        assert spec.batch_sizes(LoraSlot(4)) == spec.batch_sizes(all_linear) == (3,) and spec.batch_sizes(None) == ()
        assert spec.windows(None) == spec.windows(LoraSlot(4)) == spec.windows(all_linear, rows=3) == (16,)


def test_a_batched_step_equals_each_session_alone_with_peft_adapters(exported: Exported, tmp_path: Path) -> None:
    adapter = write_peft_adapter(exported.source, tmp_path / "adapter")
    everywhere = write_peft_adapter(exported.source, tmp_path / "all_linear", ALL_LINEAR)
    # an all-linear row hosts the attention-only and plain rows (zero MLP inputs: exact)
    configs = [SessionConfig(lora_path=adapter), SessionConfig(), SessionConfig(lora_path=everywhere, lora_scale=0.5)]
    with Engine(exported.model) as engine:
        sessions = [engine.create_session(config) for config in configs]
        for row, session in enumerate(sessions):
            session.run_prefill(TOKEN_IDS[:PROMPT_LEN + row])  # rows at different positions
        together = engine.decode_together([(s, TOKEN_IDS[-1]) for s in sessions])
        assert dict(engine.stats().decode_batches) == {3: 1} and engine.stats().invokes == 3 * 2 + 1
    for row, (config, logits) in enumerate(zip(configs, together)):
        with Engine(exported.model) as engine, engine.create_session(config) as session:
            session.run_prefill(TOKEN_IDS[:PROMPT_LEN + row])
            assert np.max(np.abs(session.run_decode(TOKEN_IDS[-1]) - logits)) <= 1e-5


def test_logits_match_float64_transformers_plain_and_with_peft(exported: Exported, tmp_path: Path) -> None:
    plain = runtime_logits(exported.model)
    assert np.max(np.abs(plain - transformers_logits(exported.source))) <= 1e-4
    adapter = write_peft_adapter(exported.source, tmp_path / "adapter")
    with_adapter = runtime_logits(exported.model, adapter)
    assert np.max(np.abs(with_adapter - transformers_logits(exported.source, adapter))) <= 1e-4
    assert np.max(np.abs(with_adapter - plain)) > 0.1
    assert np.max(np.abs(runtime_logits(exported.bundle) - plain)) <= 1e-5  # standard ops; the .tflite runs the op
    everywhere = write_peft_adapter(exported.source, tmp_path / "all_linear", ALL_LINEAR)
    all_linear = runtime_logits(exported.model, everywhere)
    assert np.max(np.abs(all_linear - transformers_logits(exported.source, everywhere))) <= 1e-4
    assert np.max(np.abs(all_linear - with_adapter)) > 0.1  # the MLP's LoRA counts


def test_score_signatures_give_every_position_s_logits_while_prefill_computes_none(exported: Exported,
                                                                                  tmp_path: Path) -> None:
    """``--score-lengths 8``: ``score_8`` per slot returns the logits at all 8 positions (a
    prompt of 24 tokens: three runs), equal to float64 transformers with and without a PEFT
    adapter; the prefill signatures still return none."""
    adapter = write_peft_adapter(exported.source, tmp_path / "adapter")
    with Engine(exported.model) as engine:
        assert engine.spec.can_score and not engine.spec.prefill_has_logits
        assert {key for key in engine.spec.signatures if key.startswith("score")} == {
            "score_8", "score_8_lora_r4", "score_8_lora_all_r4"}
        for source in (None, adapter):
            with engine.create_session(SessionConfig(lora_path=source)) as session:
                before = engine.stats().invokes
                got = session.score(TOKEN_IDS)
                assert engine.stats().invokes - before == 3
            expected = transformers_logits(exported.source, source)
            assert np.max(np.abs(got[PROMPT_LEN - 1:] - expected)) <= 1e-4


def test_the_bundle_carries_tokenizer_stop_tokens_and_chat_template(exported: Exported) -> None:
    with Engine(exported.bundle) as engine:
        assert engine.tokenizer.stop_token_ids == (checkpoints.EOS,)
        prompt = engine.chat_template.render([{"role": "user", "content": "what is the capital of france ?"}])
        assert prompt == "<s><|user|> what is the capital of france ? <|assistant|>"
        prompt_ids = engine.tokenizer.encode(prompt)
        assert prompt_ids[:2] == [checkpoints.BOS, checkpoints.WORDS.index("<|user|>")]
    chat = cli("generate", "--model", exported.bundle, "--prompt", "what is the capital of france ?",
               "--max-new-tokens", "4")
    raw = cli("generate", "--model", exported.bundle, "--prompt", "what is the capital of france ?",
              "--max-new-tokens", "4", "--no-chat-template")
    assert chat.returncode == 0 and raw.returncode == 0, chat.stderr + raw.stderr
    assert f"prefill {len(prompt_ids)} tokens" in chat.stdout
    assert "prefill 7 tokens" in raw.stdout


def test_every_family_the_source_check_accepts_has_a_builder() -> None:
    assert set(families.BUILDERS) == set(FAMILIES)


def test_a_gguf_source_gives_the_same_model_in_one_process(exported: Exported, tmp_path: Path) -> None:
    gguf = checkpoints.write_llama_gguf(tmp_path / "tiny.gguf")
    settings = ExportSettings(kv_length=64, prefill_lengths=(8,))
    report = export(inspect_source(gguf), settings, model_out=tmp_path / "from_gguf.tflite", jobs=1)
    assert report.measurements.jobs == 1 and "save the model for the workers" not in report.stage_seconds
    assert "convert to TFLite ops" in report.stage_seconds
    np.testing.assert_allclose(runtime_logits(tmp_path / "from_gguf.tflite"), runtime_logits(exported.model),
                               atol=1e-5, rtol=0)


def buffer_digests(model: Path) -> list[str]:
    """The sorted digests of a .tflite's buffers' bytes."""
    import hashlib

    from ai_edge_litert import schema_py_generated as schema

    data = model.read_bytes()
    flatbuffer = schema.Model.GetRootAsModel(data, 0)
    digests = []
    for index in range(flatbuffer.BuffersLength()):
        buffer = flatbuffer.Buffers(index)
        raw = (data[buffer.Offset():buffer.Offset() + buffer.Size()] if buffer.Offset() > 1
               else buffer.DataAsNumpy().tobytes() if buffer.DataLength() else b"")
        digests.append(hashlib.sha1(raw).hexdigest())
    return sorted(digests)


def test_weights_lowered_as_resources_come_out_as_inline_ones_stored_once(
        exported: Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ExportSettings(lora_ranks=(4,), kv_length=64, prefill_lengths=(8,))
    export(inspect_source(exported.source), settings, model_out=tmp_path / "inline.tflite", jobs=2)
    # The tiny model's weights are below litert-torch's size for resource constants (1 MB);
    # at 4 KB its projections, embedding and mask are resources referring to the torch
    # tensors in both workers, as a real model's are, and its norms stay inline.
    monkeypatch.setenv("RESOURCE_CONSTANT_NUMEL_THRESHOLD", "4096")
    export(inspect_source(exported.source), settings, model_out=tmp_path / "resources.tflite", jobs=2)
    assert buffer_digests(tmp_path / "resources.tflite") == buffer_digests(tmp_path / "inline.tflite")
    np.testing.assert_array_equal(runtime_logits(tmp_path / "resources.tflite"),
                                  runtime_logits(tmp_path / "inline.tflite"))


def test_each_signature_is_one_subgraph_with_its_norms_inline(exported: Exported) -> None:
    # litert-torch lowers an RMSNorm as an odml.rms_norm composite by default: a subgraph of
    # its own per norm, called by the interpreter, cutting XNNPACK's partition at each norm.
    # (Besides them, the decode signatures' attention in the runtime's op: subgraphs no signature names.)
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.attention_rewrite import attention_forms

    data = exported.model.read_bytes()
    model = schema.Model.GetRootAs(data, 0)
    assert model.SubgraphsLength() - len(attention_forms(data)) == model.SignatureDefsLength() > 1


def test_every_signature_multiplies_its_lora_weights_where_they_lie(exported: Exported) -> None:
    # A RESHAPE of a LoRA input (one row's [in, r] made [1, in, r]) is a copy of the adapter
    # that XNNPACK makes on every step: ~3 ms of a rank-64 SmolLM2-135M step.
    readers = lora_readers(exported.model)
    assert "decode_attend16_lora_r4" in readers and "decode_batch3_lora_r4" in readers
    assert {kind for kinds in readers.values() for kind in kinds} == {"BATCH_MATMUL"}, readers


def lora_readers(model_file: Path) -> dict[str, set[str]]:
    """By signature, the kinds of the operators that read a ``lora_*`` input."""
    readers: dict[str, set[str]] = {}
    for key, graph in signature_graphs(model_file).items():
        lora = {index for name, index in graph.inputs.items() if name.startswith("lora_")}
        for kind, inputs in graph.operators:
            if lora.intersection(inputs):
                readers.setdefault(key, set()).add(kind)
    return readers


def test_a_high_rank_decode_multiplies_and_sums_its_lora_and_stays_exact(exported: Exported, tmp_path: Path) -> None:
    # From rank 32 one token's x A B is products and sums (no matmul whose operand XNNPACK
    # packs every step): decode in the window's step and the whole cache's, single rows only.
    settings = ExportSettings(lora_ranks=(32,), lora_targets="attention", kv_length=32, prefill_lengths=(8,),
                              attention_windows=(16,), batch_sizes=(2,))
    model = tmp_path / "r32.tflite"
    export(inspect_source(exported.source), settings, model_out=model, jobs=1)
    readers = lora_readers(model)
    for name in ("decode_lora_r32", "decode_attend16_lora_r32"):
        assert readers[name] == {"MUL"}, readers
    for name in ("prefill_8_lora_r32", "decode_batch2_lora_r32"):
        assert readers[name] == {"BATCH_MATMUL"}, readers
    adapter = write_peft_adapter(exported.source, tmp_path / "adapter", rank=32)
    with_adapter = runtime_logits(model, adapter)  # decodes at positions 6-15 in the window, 16-23 past it
    assert np.max(np.abs(with_adapter - transformers_logits(exported.source, adapter))) <= 1e-4
    assert np.max(np.abs(with_adapter - runtime_logits(model))) > 0.1
    configs = [SessionConfig(lora_path=adapter), SessionConfig()]
    with Engine(model) as engine:
        sessions = [engine.create_session(config) for config in configs]
        for row, session in enumerate(sessions):
            session.run_prefill(TOKEN_IDS[:PROMPT_LEN + row])
        together = engine.decode_together([(s, TOKEN_IDS[-1]) for s in sessions])
        assert dict(engine.stats().decode_batches) == {2: 1}
        alone = sessions[0]
        alone.reset()
        alone.run_prefill(TOKEN_IDS[:PROMPT_LEN])
        assert np.max(np.abs(alone.run_decode(TOKEN_IDS[-1]) - together[0])) <= 1e-5


def spoiling(after_step: str, files: str, directory: Path) -> Callable[[Iterable[str]], Iterator[str]]:
    """An export's ``progress`` that overwrites the scratch ``files`` (a glob in
    ``directory``) once ``after_step`` is done, before the next stage reads them."""
    def progress(steps: Iterable[str]) -> Iterator[str]:
        for step in steps:
            if step == after_step:
                for file in directory.glob(files):
                    file.write_bytes(b"not what was written")
            yield step
    return progress


@pytest.mark.parametrize("jobs, after_step, files, error", [
    (1, "convert to TFLite ops", ".m.mlirbc.*.partial", "export's finishing process .* failed"),
    (2, "save the model for the workers", ".m.pt.*.partial", "export worker [01] .* failed: RuntimeError: .*torch.save"),
])
def test_a_failing_process_is_raised_and_leaves_nothing(exported: Exported, tmp_path: Path, jobs: int,
                                                         after_step: str, files: str, error: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match=error):
        export(inspect_source(exported.source), ExportSettings(kv_length=64, prefill_lengths=(8,)),
               model_out=out / "m.tflite", bundle_out=out / "m.litertlm", jobs=jobs,
               progress=spoiling(after_step, files, out))
    assert list(out.iterdir()) == []


def test_a_terminated_export_leaves_nothing(exported: Exported, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "runtime", "export", exported.source, "--out", tmp_path / "m.tflite", "--jobs", "2"]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".m.worker1.*.partial")) and time.monotonic() < deadline:  # workers at work
        time.sleep(0.1)
    child.terminate()
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_a_failing_bundle_leaves_no_model_either(exported: Exported, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(model_path: Path, tokenizer: object, kv_length: int, out_path: Path) -> None:
        write_bundle(model_path, tokenizer, kv_length, out_path)
        raise OSError("disk full")

    monkeypatch.setattr("runtime.export.bundle.write_bundle", fail)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError, match="disk full"):
        export(inspect_source(exported.source), ExportSettings(kv_length=64, prefill_lengths=(8,)),
               model_out=out / "m.tflite", bundle_out=out / "m.litertlm", jobs=1)
    assert list(out.iterdir()) == []


def test_an_unreadable_tokenizer_is_refused_before_the_weights(tmp_path: Path) -> None:
    source = checkpoints.write_llama_directory(tmp_path / "llama")
    (source / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    done = cli("export", source, "--out", tmp_path / "m.tflite", "--bundle", tmp_path / "m.litertlm")
    assert done.returncode == 2
    assert re.fullmatch(r"error: INVALID_ARGUMENT: .*llama: the tokenizer cannot be read: .*\n", done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


@pytest.mark.parametrize("quantize", [q for q in QUANTIZATIONS if q != "none"])
def test_every_offered_quantization_runs_in_this_runtime(exported: Exported, tmp_path: Path,
                                                         quantize: str) -> None:
    settings = ExportSettings(kv_length=32, prefill_lengths=(8,), quantize=quantize)
    if quantize == "int4-block128":  # the tiny model's 32-wide weights do not split into blocks of 128
        with pytest.raises(InvalidArgumentError, match="int4-block128.*not divisible by block size 128"):
            export(inspect_source(exported.source), settings, model_out=tmp_path / "q.tflite", jobs=1)
        assert list(tmp_path.iterdir()) == []
        return
    report = export(inspect_source(exported.source), settings, model_out=tmp_path / "q.tflite", jobs=1)
    assert f"quantize ({quantize})" in report.stage_seconds
    assert (tmp_path / "q.tflite").stat().st_size < exported.model.stat().st_size
    quantized = runtime_logits(tmp_path / "q.tflite")[:8]
    reference = runtime_logits(exported.model)[:8]
    assert np.all(np.isfinite(quantized))
    assert np.corrcoef(quantized.ravel(), reference.ravel())[0, 1] > 0.9
    # The base weights an R-only LoRA-XS adapter needs: the checkpoint's, within the precision.
    weights = ModelWeights((tmp_path / "q.tflite").read_bytes(), "q.tflite")
    if quantize.startswith("int4"):
        with pytest.raises(NotFoundError, match="int4 ones are not"):
            weights.weight(0, "q")
        return
    tolerance = {"int8": 0.01, "int8-weights": 0.01, "fp16": 1e-3}[quantize]
    for name, expected in checkpoints.llama_weights().items():
        found = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.weight", name)
        if found:
            got = weights.weight(int(found[1]), found[2])
            assert np.max(np.abs(got - expected)) <= tolerance * np.max(np.abs(expected)), name


def test_the_base_weights_are_found_exactly_in_a_float32_export(exported: Exported) -> None:
    weights = ModelWeights(exported.model.read_bytes(), exported.model.name)
    found = 0
    for name, expected in checkpoints.llama_weights().items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.weight", name)
        if match:
            assert weights.shape(int(match[1]), match[2]) == expected.shape
            np.testing.assert_array_equal(weights.weight(int(match[1]), match[2]), expected)
            found += 1
    assert found == checkpoints.LAYERS * 7
    with pytest.raises(NotFoundError, match="no weight for layer 9 projection 'q'"):
        weights.weight(9, "q")


LITERT_LM_GREEDY = """
import sys
import litert_lm

engine = litert_lm.Engine(sys.argv[1], max_num_tokens=64)
session = engine.create_session(apply_prompt_template=False, max_output_tokens=int(sys.argv[3]),
                                sampler_config=litert_lm.SamplerConfig(top_k=1, temperature=0.0))
session.run_prefill([sys.argv[2]])
print(session.run_decode().texts[0])
"""


@pytest.mark.parametrize("layout", [None, "grouped"])
def test_a_bundle_runs_in_googles_litert_lm_engine(tmp_path: Path, layout: str | None) -> None:
    """--bundle's KV layout, the default (transposed) or grouped, is one LiteRT-LM reads; without
    LoRA slots (its engine garbles them) its greedy answer equals this runtime's (LiteRT-LM puts
    BOS first)."""
    pytest.importorskip("litert_lm")
    source = checkpoints.write_llama_directory(tmp_path / "llama")
    bundle = tmp_path / "tiny.litertlm"
    done = cli("export", source, "--bundle", bundle, "--kv-length", "64", "--prefill-lengths", "8",
               *(("--kv-layout", layout) if layout else ()))
    assert done.returncode == 0, done.stderr
    prompt, steps = "what is the capital of france ?", 8
    with Engine(bundle) as engine, engine.create_session() as session:
        assert engine.spec.kv_layout == (layout or "transposed")
        ours = session.generate([checkpoints.BOS, *engine.tokenizer.encode(prompt)], max_new_tokens=steps,
                                sampler=SamplerConfig(temperature=0.0), stop_tokens=[]).text
    # LiteRT-LM does not zero its KV buffers: fresh pages from the allocator keep NaN bits out.
    theirs = subprocess.run([sys.executable, "-c", LITERT_LM_GREEDY, str(bundle), prompt, str(steps)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "100000"})
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert theirs.stdout.strip() == ours.strip() and len(ours.split()) == steps


def test_several_quantizations_come_from_one_lowering_as_each_alone(exported: Exported, tmp_path: Path) -> None:
    settings = ("--lora-ranks", "4", "--kv-length", "64", "--prefill-lengths", "8", "--kv-layout", "transposed",
                "--jobs", "1")
    both = cli("export", exported.source, "--out", tmp_path / "m-{precision}.tflite", "--bundle",
               tmp_path / "m-{precision}.litertlm", "--quantize", "none,int8", *settings, "--report",
               tmp_path / "both.json")
    assert both.returncode == 0, both.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.json", "m-f32.litertlm", "m-f32.tflite",
                                                          "m-int8.litertlm", "m-int8.tflite"]
    report = json.loads((tmp_path / "both.json").read_text())
    assert report["quantizations"] == ["none", "int8"]
    stages = [stage["name"] for stage in report["stages"]]
    assert stages.count("serialize") == 1 and stages.count("quantize (int8)") == 1
    (tmp_path / "alone").mkdir()
    for quantize, name in (("none", "f32"), ("int8", "int8")):
        alone = cli("export", exported.source, "--out", tmp_path / "alone" / f"{name}.tflite", "--quantize", quantize,
                    *settings)
        assert alone.returncode == 0, alone.stderr
        assert (tmp_path / f"m-{name}.tflite").read_bytes() == (tmp_path / "alone" / f"{name}.tflite").read_bytes()
    assert (tmp_path / "m-int8.tflite").stat().st_size < (tmp_path / "m-f32.tflite").stat().st_size


def test_float16_caches_keep_the_float32_exports_tokens_and_the_bundle_keeps_float32(tmp_path: Path) -> None:
    """--kv-cache-dtype float16 with both attention forms and a bundle: the model file's
    every cache float16 (one stage after quantizing), its greedy tokens those of the float32
    export, logits within 1% of their range; the bundle's model keeps float32 caches."""
    from runtime.util.litertlm_bundle import LitertLmBundle
    from runtime.util.model_view import signature_details

    source = inspect_source(checkpoints.write_llama_directory(tmp_path / "llama"))
    common = dict(kv_length=32, prefill_lengths=(8,), attention_windows=(16,))
    export(source, ExportSettings(**common), model_out=tmp_path / "f32.tflite", jobs=1)
    report = export(source, ExportSettings(**common, kv_cache_dtype="float16"), model_out=tmp_path / "f16.tflite",
                    bundle_out=tmp_path / "f16.litertlm", jobs=1)
    assert "KV caches to float16, rewrite decode attention (both forms)" in report.stage_seconds

    def cache_types(model: bytes) -> set[str]:
        return {str(np.dtype(detail["dtype"])) for inputs, outputs in signature_details(model).values()
                for name, detail in [*inputs.items(), *outputs.items()] if name.startswith("kv_cache_")}

    assert cache_types((tmp_path / "f16.tflite").read_bytes()) == {"float16"}
    with LitertLmBundle(tmp_path / "f16.litertlm") as bundle:
        assert cache_types(bytes(bundle.section_bytes(bundle.model_section()))) == {"float32"}
    want, got = runtime_logits(tmp_path / "f32.tflite"), runtime_logits(tmp_path / "f16.tflite")
    assert (want.argmax(-1) == got.argmax(-1)).all()
    assert np.abs(want - got).max() <= 0.01 * np.ptp(want)


def test_float16_lora_factors_are_a_stage_of_their_own_and_the_bundle_keeps_float32(tmp_path: Path) -> None:
    """--lora-dtype float16 with both attention forms, batched rows and a bundle, in one
    export: a stage after quantizing; the model file's every LoRA factor input float16 and
    every other input as the bundle's model (the file before the passes) has it, whose factors
    stay float32; a PEFT adapter runs on it. (What the factors compute: test_lora_precision.py,
    on the committed exports.)"""
    from runtime.util.litertlm_bundle import LitertLmBundle
    from runtime.util.lora_precision import is_lora_factor
    from runtime.util.model_view import signature_details

    model_dir = checkpoints.write_llama_directory(tmp_path / "llama")
    settings = ExportSettings(kv_length=32, prefill_lengths=(8,), lora_ranks=(4,), batch_sizes=(2,),
                              lora_dtype="float16")
    report = export(inspect_source(model_dir), settings, model_out=tmp_path / "lf16.tflite",
                    bundle_out=tmp_path / "lf16.litertlm", jobs=1)
    assert "LoRA factors to float16, rewrite decode attention (both forms)" in report.stage_seconds

    def types(model: bytes) -> dict[str, str]:  # every signature input -> its type
        return {f"{key}/{name}": str(np.dtype(detail["dtype"])) for key, (inputs, _) in signature_details(model).items()
                for name, detail in inputs.items()}

    with LitertLmBundle(tmp_path / "lf16.litertlm") as bundle:
        before = types(bytes(bundle.section_bytes(bundle.model_section())))
    after = types((tmp_path / "lf16.tflite").read_bytes())
    factor = lambda key: is_lora_factor(key.split("/")[1].encode())  # noqa: E731
    assert before.keys() == after.keys() and any(factor(key) for key in after)
    assert all((after[key], before[key]) == ("float16", "float32") if factor(key) else after[key] == before[key]
               for key in after)
    logits = runtime_logits(tmp_path / "lf16.tflite", write_peft_adapter(model_dir, tmp_path / "adapter"))
    assert np.isfinite(logits).all()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler (cc or gcc) on PATH to build the attention kernel")
def test_the_native_attention_kernel_gives_the_standard_exports_numbers(tmp_path: Path) -> None:
    """--attention-kernel native at two precisions from one lowering: a stage of its own
    per precision, the custom ops in the decode signatures only (the float32 linears too in
    f32), and a session's logits within 1e-5 of their largest (at least 1) of the same export
    in standard ops (greedy tokens the same)."""
    from runtime.export.exporter import AlsoAt
    from runtime.util.attention_rewrite import DECODE_ATTENTION, LINEAR_ROWS, custom_codes

    source = inspect_source(checkpoints.write_llama_directory(tmp_path / "llama"))
    common = dict(kv_length=32, prefill_lengths=(8,), attention_windows=(16,), batch_sizes=(2,))
    export(source, ExportSettings(**common, attention_kernel="xnnpack"), model_out=tmp_path / "standard.tflite",
           jobs=1)
    report = export(source, ExportSettings(**common, attention_kernel="native"), model_out=tmp_path / "native.tflite",
                    also=[AlsoAt("int8", tmp_path / "native-int8.tflite")], jobs=1)
    stages = report.stage_seconds
    assert "rewrite decode attention (native kernel) (none)" in stages
    assert "rewrite decode attention (native kernel) (int8)" in stages
    assert custom_codes((tmp_path / "native.tflite").read_bytes()) == {DECODE_ATTENTION, LINEAR_ROWS}
    assert custom_codes((tmp_path / "native-int8.tflite").read_bytes()) == {DECODE_ATTENTION}
    standard, native = runtime_logits(tmp_path / "standard.tflite"), runtime_logits(tmp_path / "native.tflite")
    assert np.abs(standard - native).max() <= 1e-5 * max(1.0, float(np.abs(standard).max()))
    assert (standard.argmax(-1) == native.argmax(-1)).all()
    assert np.isfinite(runtime_logits(tmp_path / "native-int8.tflite")).all()
