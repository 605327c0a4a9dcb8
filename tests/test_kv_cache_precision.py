"""KV caches in float16 (``--kv-cache-dtype float16``, runtime.util.kv_cache_precision): the
committed fixtures' caches converted at test time, run against the float32 originals, in
the standard form and in the attention kernel's op form."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS, greedy, run_signature, step_inputs
from graph_passes import converted, needs_kernel, through
from runtime import Engine, EngineSettings, SessionConfig
from runtime.errors import InvalidArgumentError
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.native import NativeModel
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import attention_forms, rewrite_decode_attention
from runtime.util.kv_cache_precision import kv_caches_to_float16
from runtime.util.model_view import signature_details

# The transposed layout (what the kernel reads), Gemma 3 (sliding-window layers, its own
# steps) and the default layout (litert-torch's attention composite reads the cache).
FIXTURES = {"gqa": MODELS / "gqa_transposed.tflite", "gemma3": MODELS / "gemma3" / "model.tflite",
            "default layout": MODELS / "gqa_default.tflite"}
def to_float16(source: Path, out: Path, attention: str | None = None) -> dict[str, int]:
    return through(kv_caches_to_float16, source, out, attention)


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return converted(kv_caches_to_float16, FIXTURES, tmp_path_factory.mktemp("float16"))


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_every_signatures_caches_become_float16_and_nothing_else(fixture, half):
    before, after = signature_details(FIXTURES[fixture].read_bytes()), signature_details(half[fixture].read_bytes())
    assert before.keys() == after.keys()
    caches = 0
    for key in before:
        for side in (0, 1):  # inputs, outputs
            for name, detail in before[key][side].items():
                changed = after[key][side][name]
                assert list(changed["shape"]) == list(detail["shape"])
                if name.startswith("kv_cache_"):
                    assert np.dtype(detail["dtype"]) == np.float32 and np.dtype(changed["dtype"]) == np.float16
                    caches += 1
                else:
                    assert np.dtype(changed["dtype"]) == np.dtype(detail["dtype"]), f"{key}: {name}"
    assert caches > 0


def test_inspect_names_the_caches_type(half):
    done = subprocess.run([sys.executable, "-m", "runtime", "inspect", str(half["gqa"])], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "(transposed layout, float16, 16,384 bytes per session)" in done.stdout  # float32: 32,768


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_a_generation_keeps_its_tokens_to_the_end_of_the_cache(fixture, half):
    """Greedy decoding through the attention and prefill windows to the cache's last
    position: the float32 caches' tokens, every step's logits within 1% of their range
    (rows rounded to float16 when written, 2^-11 relative)."""
    original, converted = LlmExecutor(FIXTURES[fixture]), LlmExecutor(half[fixture])
    try:
        prompt = [5, 17, 42, 99, 3, 8, 120, 64, 33, 2, 7]
        steps = original.spec.kv_length - len(prompt) - 1
        want_tokens, want = greedy(original, prompt, steps)
        got_tokens, got = greedy(converted, prompt, steps)
        assert got_tokens == want_tokens
        for position, (a, b) in enumerate(zip(want, got), start=len(prompt)):
            assert float(np.abs(a - b).max()) <= 0.01 * float(np.ptp(a)), f"step at position {position}"
    finally:
        original.close()
        converted.close()


def test_the_first_layers_rows_are_the_float32_rows_rounded(half):
    """After a prefill, layer 0's cache (computed before any cache is read) holds exactly the
    float32 model's rows rounded to float16; the later layers' rows come within a few of
    float16's steps (their inputs read the rounded rows)."""
    rows = {}
    for name, path in (("f32", FIXTURES["gqa"]), ("f16", half["gqa"])):
        executor = LlmExecutor(path)
        kv = executor.create_kv_cache()
        executor.prefill(executor.bind(kv), [5, 17, 42, 99, 3, 8, 120], 0)
        rows[name] = {key: buffer.array.copy() for key, buffer in kv.at(kv.length).items()}
        executor.close()
    for key, want in rows["f32"].items():
        got = rows["f16"][key]
        assert got.dtype == np.float16
        if key.endswith("_0"):
            np.testing.assert_array_equal(got, want.astype(np.float16), err_msg=key)
        else:
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2, err_msg=key)


def test_batched_sessions_and_the_prefix_cache_run_on_float16_caches(half):
    """Sessions stepping together in the batched signatures, and a prompt started from the
    prefix cache's rows, give the tokens a session alone gives."""
    prompts = [[5, 17, 42, 99, 3, 8, 120, 64, 33, 2] + [i] for i in range(4)]
    with Engine(half["gqa"], EngineSettings(prefix_cache_bytes=1 << 20)) as engine:
        alone = []
        for prompt in prompts:
            with engine.create_session(SessionConfig()) as session:
                alone.append(session.generate(prompt, 12).tokens)
        assert engine.stats().prefix_cache.hits >= 3  # the prompts after the first start from its rows
        together: list = [None] * len(prompts)
        barrier = threading.Barrier(len(prompts))

        def work(i: int) -> None:
            with engine.create_session(SessionConfig()) as session:
                barrier.wait()
                together[i] = session.generate(prompts[i], 12).tokens

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert together == alone
        assert engine.stats().decode_batches  # (rows, batches): some steps ran batched
    with Engine(MODEL_FILES["transposed"]) as original:
        for prompt, tokens in zip(prompts, alone):
            with original.create_session(SessionConfig()) as session:
                assert session.generate(prompt, 12).tokens == tokens


def within(got: np.ndarray, want: np.ndarray, linear_op: bool = False) -> bool:
    """Float32 outputs (logits) within 1e-3, float16 ones (caches) within 1e-5 and two
    float16 steps of each value. The op and XNNPACK sum in other orders (1e-6 apart, as
    with float32 caches), and a row rounded to float16 after that may round a step apart
    (5e-4 relative), which the next layers carry: not 1e-5 as between float32 forms, but
    far below what a misread cache gives (differences of the values' own size).
    ``linear_op``: a step whose linear layers run as the op too (linear_rows, every decode
    signature of the op form: every projection's sums in another order, so more rows round a
    step apart and the layers after carry more of them; up to 31 steps of a small value, 5.2e-4
    of the caches' largest on the fixtures): every output within 1e-3 of its largest value, two
    float16 steps there."""
    assert got.dtype == want.dtype
    if linear_op:
        scale = max(1.0, float(np.abs(want.astype(np.float32)).max()))
        return float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max()) <= 1e-3 * scale
    if want.dtype == np.float16:
        return bool((np.abs(got.astype(np.float32) - want.astype(np.float32))
                     <= 1e-5 + 2 * np.spacing(np.abs(want)).astype(np.float32)).all())
    return float(np.abs(got - want).max()) <= 1e-3


@needs_kernel
@pytest.mark.parametrize("fixture", ["gqa", "gemma3"])
def test_the_kernel_reads_float16_caches_as_the_standard_form_does(fixture, half, tmp_path, kernel_cache):
    """The op form over float16 caches against the standard form over the same caches (its
    DEQUANTIZE to float32 dropped, the kernel converting as it reads): every decode
    signature, single-row and batched, windows and not (see :func:`within`)."""
    native_path = tmp_path / "native.tflite"
    counts = to_float16(FIXTURES[fixture], native_path, attention="native")
    assert counts["decode"] == (6 if fixture == "gemma3" else 4)  # K and V per layer
    standard = NativeModel(half[fixture], num_threads=1, weight_cache=":memory:", name="standard")
    native = NativeModel(native_path, num_threads=1, weight_cache=":memory:", name="native")
    try:
        keys = [key for key in standard.signatures if key.startswith("decode")]
        for key in keys:
            span = next(info.shape[2] for name, info in standard.signatures[key].inputs.items()
                        if name.startswith("kv_cache_k"))
            for position in sorted({0, 9, span - 1}):
                inputs = step_inputs(standard, key, position, seed=position)
                want, got = run_signature(standard, key, inputs), run_signature(native, key, inputs)
                for name in want:
                    assert within(got[name], want[name], linear_op=True), f"{key} at {position}: {name}"
    finally:
        standard.close()
        native.close()


@needs_kernel
def test_a_file_of_both_forms_with_float16_caches_runs_the_op_form(half, tmp_path, kernel_cache):
    both = tmp_path / "both.tflite"
    to_float16(FIXTURES["gqa"], both, attention="both")
    standard, chosen = LlmExecutor(half["gqa"]), LlmExecutor(both)
    try:
        assert chosen.attention_kernel
        prompt = [5, 17, 42, 99, 3]
        want_tokens, want = greedy(standard, prompt, 40)
        got_tokens, got = greedy(chosen, prompt, 40)
        assert got_tokens == want_tokens
        assert all(within(b, a) for a, b in zip(want, got))
    finally:
        standard.close()
        chosen.close()


def test_bad_models_are_refused_naming_why(half):
    with pytest.raises(InvalidArgumentError, match=r"signature 'prefill_8', input 'kv_cache_k_0': a FLOAT16 cache"):
        kv_caches_to_float16(flatbuffer_model.unpack(half["gqa"].read_bytes()))
    rewritten, _ = rewrite_decode_attention(FIXTURES["gqa"].read_bytes())
    with pytest.raises(InvalidArgumentError, match="already runs the runtime.s custom ops"):
        kv_caches_to_float16(flatbuffer_model.unpack(rewritten))
    adapter = MODELS / "adapters" / "torch_r4.tflite"
    with pytest.raises(InvalidArgumentError, match="no kv_cache_"):
        kv_caches_to_float16(flatbuffer_model.unpack(adapter.read_bytes()))


TOOL = Path(__file__).resolve().parent.parent / "tools" / "attention_kernel.py"


def test_the_tool_makes_an_exports_both_forms_again_with_float16_caches(half, tmp_path, kernel_cache):
    """``tools/attention_kernel.py --kv-cache-dtype float16`` on a file of both forms (what
    the export writes by default): float16 caches, both forms again, the same tokens and
    logits as the float16 model made from the standard file."""
    both_f32 = tmp_path / "both.tflite"
    both_f32.write_bytes(rewrite_decode_attention(FIXTURES["gqa"].read_bytes(), keep_standard=True)[0])
    out = tmp_path / "both16.tflite"
    done = subprocess.run([sys.executable, str(TOOL), str(both_f32), "--out", str(out), "--kv-cache-dtype", "float16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "carried both forms: its op form was made again" in done.stdout
    details = signature_details(out.read_bytes())
    assert {str(np.dtype(detail["dtype"])) for inputs, _ in details.values() for name, detail in inputs.items()
            if name.startswith("kv_cache_")} == {"float16"}
    assert attention_forms(out.read_bytes())
    made, direct = LlmExecutor(out), LlmExecutor(half["gqa"])
    try:
        want_tokens, want = greedy(direct, [5, 17, 42, 99, 3], 40)
        got_tokens, got = greedy(made, [5, 17, 42, 99, 3], 40)
        assert got_tokens == want_tokens and all(within(b, a) for a, b in zip(want, got))
    finally:
        made.close()
        direct.close()


def test_the_tool_refuses_a_file_whose_op_form_replaced_the_standard_one(tmp_path):
    native = tmp_path / "native.tflite"
    native.write_bytes(rewrite_decode_attention(FIXTURES["gqa"].read_bytes())[0])
    done = subprocess.run([sys.executable, str(TOOL), str(native), "--out", str(tmp_path / "out.tflite")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "in place of the standard form (--attention-kernel native): re-export it" \
        in done.stderr
    assert not (tmp_path / "out.tflite").exists()
