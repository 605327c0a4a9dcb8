"""Load on ``python -m runtime serve``: N concurrent streaming clients over K adapters for T seconds.

    python3 benchmarks/serve_load.py [--model M] [--clients 32] [--adapters 8] [--seconds 60]
        [--llama-server PATH --gguf BASE.gguf --gguf-lora A.gguf ...]

Needs the ``test`` extra (the ``serve`` extra and the ``openai`` client). Starts the server
as a subprocess on a free loopback port with K adapters (copies of the source adapters,
round robin, so that each is registered and materialized on its own), then runs N
clients, each streaming greedy completions one after another, each request on the next
adapter, until T seconds have passed. Every answer is compared with what
``Session.generate`` gives offline for the same adapter and prompt. Prints a table
(requests, errors, answers equal to offline, tokens/s, requests/s, time to first token
and inter-token latency p50/p99) and writes ``benchmarks/results/serve_load.{json,md}``.

The model: ``--model`` (default the bench model ``benchmarks/models/bench_f32.tflite``
with the PEFT adapters ``benchmarks/models/peft_*``; ``--model demo`` is the bundled demo
model with its adapters); ``--adapter PATH`` (repeatable) picks the source adapters. A
``.litertlm`` bundle brings its tokenizer; ``--tokenizer FILE`` gives one; a byte-level
model (vocabulary 256) gets ``--byte-tokens``; any other model is served with a
synthetic tokenizer whose token ``i`` is the word ``t{i}``, so that any vocabulary
streams as text (prompts are then random token ids; nothing stops a generation before
``--max-tokens``).

The same workload against llama.cpp's ``llama-server`` (``--llama-server``, built by
``bash benchmarks/llama_cpp/build_server.sh``) runs with ``--gguf`` (the same weights)
and one ``--gguf-lora`` per source adapter, in the same order: every client sends the
same prompt ids with a per-request ``lora: [{"id", "scale"}]``. Its answers are counted,
not compared (its text is its own vocabulary's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from runtime import ByteTokenizer, Engine, EngineSettings, HfTokenizer, LoraSource, SessionConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
WORK = RESULTS / "tmp" / "serve_load"  # gitignored: copies of the adapters, the synthetic tokenizer
BENCH_MODEL = HERE / "models" / "bench_f32.tflite"
BENCH_ADAPTERS = [HERE / "models" / name for name in ("peft_r8_a", "peft_r8_b", "peft_r64")]
DEMO = ROOT / "runtime" / "demo_assets"
DEMO_ADAPTERS = [DEMO / "adapters" / f"{name}.tflite" for name in ("uppercase", "no_vowels", "json")]
NEWLINE = 10
TEXT_PROMPTS = ["hello world\n", "the cat sat\n", "open the door now\n", "green tea\n", "my blue kite\n",
                "What is the capital of France?", "Name three colours.", "Write one short sentence."]


@dataclass
class Workload:
    """What the clients send and how each answer is checked."""

    model: Path
    server_args: list[str]  # tokenizer options for `python -m runtime serve`
    sources: list[Path]  # the source adapters
    prompts: list[list[int]]  # token ids
    expected: dict[tuple[int, int], str] = field(default_factory=dict)  # (source, prompt) -> offline text


@dataclass
class Request:
    """One streamed answer as a client saw it."""

    source: int
    prompt: int
    started: float
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    error: str | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(BENCH_MODEL), help="a model file, or 'demo'")
    parser.add_argument("--adapter", action="append", type=Path, help="a source adapter (repeatable)")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8, help="adapters served (copies of the sources)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per executor (both servers)")
    parser.add_argument("--executors", type=int, default=1, help="our server's --executors")
    parser.add_argument("--llama-server", type=Path, default=_default_llama_server())
    parser.add_argument("--gguf", type=Path, default=HERE / "models" / "gguf" / "bench-f32.gguf")
    parser.add_argument("--gguf-lora", type=Path, action="append")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_load")
    args = parser.parse_args(argv)

    workload = build_workload(args)
    print(f"model {workload.model.name}: {len(workload.sources)} source adapters -> {args.adapters} served, "
          f"{len(workload.prompts)} prompts, {args.clients} clients x {args.seconds:.0f} s, "
          f"max_tokens {args.max_tokens}", flush=True)
    rows = [run_ours(workload, args)]
    llama = llama_setup(workload, args)
    if isinstance(llama, str):
        print(f"llama-server: skipped ({llama})", flush=True)
    else:
        rows.append(run_llama(workload, args, llama))
    table = render(rows, workload, args, llama if isinstance(llama, str) else None)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table)
    args.out.with_suffix(".json").write_text(json.dumps({"settings": _settings(workload, args), "rows": rows},
                                                        indent=2) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0 if all(row["errors"] == 0 and row.get("mismatches", 0) == 0 for row in rows) else 1


# -- the workload ------------------------------------------------------------------


def build_workload(args: argparse.Namespace) -> Workload:
    """The model, the server's tokenizer options, the prompts and the offline answers."""
    model = DEMO / "model.tflite" if args.model == "demo" else Path(args.model)
    sources = args.adapter or (DEMO_ADAPTERS if args.model == "demo" else BENCH_ADAPTERS if model == BENCH_MODEL
                               else [])
    if not sources:
        raise SystemExit("give the source adapters with --adapter PATH")
    WORK.mkdir(parents=True, exist_ok=True)
    with Engine(model) as probe:
        bundled, vocab = probe.tokenizer is not None, probe.spec.vocab_size
    synthetic = False  # a tokenizer of token-id words: prompts are then random ids
    if args.tokenizer is not None:
        server_args, tokenizer = ["--tokenizer", str(args.tokenizer)], args.tokenizer
    elif bundled:
        server_args, tokenizer = [], None
    elif vocab == 256:
        server_args, tokenizer = ["--byte-tokens", "--stop-token", str(NEWLINE)], ByteTokenizer([NEWLINE])
    else:
        path = write_id_tokenizer(vocab, WORK / f"ids_{vocab}.json")
        server_args, tokenizer, synthetic = ["--tokenizer", str(path)], HfTokenizer(path), True
    workload = Workload(model, server_args, [Path(s) for s in sources], [])
    with Engine(model, EngineSettings(num_threads=args.threads), tokenizer=tokenizer) as engine:
        if synthetic:
            rng = random.Random(20250601)
            workload.prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(6, 14))] for _ in range(8)]
        else:
            workload.prompts = [engine.tokenizer.encode(text) for text in TEXT_PROMPTS]
        for s, source in enumerate(workload.sources):
            for p, prompt in enumerate(workload.prompts):
                with engine.create_session(SessionConfig(loras=[LoraSource(path=source)])) as session:
                    workload.expected[s, p] = session.generate(prompt, args.max_tokens).text
    return workload


def write_id_tokenizer(vocab: int, path: Path) -> Path:
    """A tokenizer.json whose token ``i`` is the word ``t{i}`` (for a model without a tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(path))
    return path


def copy_adapters(workload: Workload, count: int) -> tuple[Path, list[str]]:
    """``count`` copies of the source adapters, round robin, in a fresh folder; their names."""
    folder = WORK / "adapters"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = []
    for i in range(count):
        source = workload.sources[i % len(workload.sources)]
        name = f"a{i:02d}"
        if source.is_dir():
            shutil.copytree(source, folder / name)
        else:
            shutil.copy(source, folder / f"{name}{source.suffix}")
        names.append(name)
    return folder, names


# -- the clients -------------------------------------------------------------------


async def client_loop(client, index: int, deadline: float, workload: Workload, max_tokens: int,
                      request_options, out: list[Request]) -> None:
    """One client: streamed greedy completions one after another until the deadline."""
    turn = 0
    while time.perf_counter() < deadline:
        adapter = (index + turn) % len(request_options)
        prompt = (index * 3 + turn) % len(workload.prompts)
        model, extra = request_options[adapter]
        record = Request(adapter % len(workload.sources), prompt, time.perf_counter())
        last = None
        try:
            stream = await client.completions.create(
                model=model, prompt=workload.prompts[prompt], max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra)
            async for chunk in stream:
                if chunk.usage is not None:
                    record.tokens = chunk.usage.completion_tokens
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.perf_counter()
                if record.first is None:
                    record.first = now
                else:
                    record.gaps.append(now - last)
                last = now
                record.text += chunk.choices[0].text
        except Exception as exc:  # counted as an error
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        out.append(record)
        turn += 1


def drive(url: str, workload: Workload, args, request_options, key: str | None = None) -> tuple[list[Request], float]:
    """Runs the clients; returns every request and the wall time."""
    import openai

    async def run() -> tuple[list[Request], float]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0, timeout=120)
        requests: list[Request] = []
        started = time.perf_counter()
        deadline = started + args.seconds
        await asyncio.gather(*(client_loop(client, i, deadline, workload, args.max_tokens, request_options, requests)
                               for i in range(args.clients)))
        wall = time.perf_counter() - started
        await client.close()
        return requests, wall

    return asyncio.run(run())


def summarize(label: str, requests: list[Request], wall: float, workload: Workload | None) -> dict:
    """One row of the table."""
    done = [r for r in requests if r.error is None]
    ttft = [1e3 * (r.first - r.started) for r in done if r.first is not None]
    gaps = [1e3 * g for r in done for g in r.gaps]
    tokens = sum(r.tokens for r in done)
    row = {
        "server": label, "requests": len(requests), "errors": len(requests) - len(done),
        "tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(done) / wall, "wall_s": wall,
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(gaps, 50), "itl_ms_p99": _pct(gaps, 99),
        "first_errors": sorted({r.error for r in requests if r.error})[:3],
    }
    if workload is not None:
        row["mismatches"] = sum(r.text != workload.expected[r.source, r.prompt] for r in done)
    return row


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# -- our server --------------------------------------------------------------------


def run_ours(workload: Workload, args) -> dict:
    folder, names = copy_adapters(workload, args.adapters)
    command = [sys.executable, "-m", "runtime", "serve", "--model", str(workload.model), *workload.server_args,
               "--adapters", str(folder), "--port", "0", "--max-concurrent", str(args.clients),
               "--threads", str(args.threads), "--executors", str(args.executors)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = process.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        if found is None:
            raise SystemExit(f"the server did not start: {line}{process.stderr.read()}")
        url = found.group(0)
        _wait_healthy(url + "/health")
        requests, wall = drive(url, workload, args, [(name, None) for name in names])
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    row = summarize("runtime serve", requests, wall, workload)
    print(f"  runtime serve: {row['requests']} requests, {row['errors']} errors, {row['mismatches']} not equal "
          f"to offline, {row['tokens_per_s']:.0f} tokens/s", flush=True)
    return row


# -- llama-server ------------------------------------------------------------------


def _default_llama_server() -> Path | None:
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if found:
        return Path(found)
    built = Path(os.environ.get("LLAMA_CPP_SRC", HERE / "llama_cpp" / "src")) / "bin" / "llama-server"
    return built if built.exists() else None


def llama_setup(workload: Workload, args) -> list[Path] | str:
    """The GGUF adapters in source order, or why llama-server is left out."""
    if args.skip_llama_cpp:
        return "--skip-llama-cpp"
    if args.llama_server is None or not args.llama_server.exists():
        return "no llama-server binary: bash benchmarks/llama_cpp/build_server.sh, or --llama-server PATH"
    if not args.gguf.exists():
        return f"{args.gguf} is missing (bash benchmarks/llama_cpp/build_server.sh converts the bench model)"
    loras = args.gguf_lora or [args.gguf.parent / f"lora-{s.name}-f32.gguf" for s in workload.sources]
    missing = [str(p) for p in loras if not p.exists()]
    if missing or len(loras) != len(workload.sources):
        return f"GGUF adapters missing or not one per source adapter: {missing or loras}"
    return loras


def run_llama(workload: Workload, args, loras: list[Path]) -> dict:
    """The same clients and prompts against llama-server, adapters chosen per request."""
    port = _free_port()
    copies = [loras[i % len(loras)] for i in range(args.adapters)]
    command = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(256 * args.clients), "--parallel", str(args.clients), "-t", str(args.threads),
               "-tb", str(args.threads), "-fa", "off", "--cache-type-k", "f32", "--cache-type-v", "f32",
               "--lora-init-without-apply", "--no-webui"]
    for path in copies:
        command += ["--lora", str(path)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", process, seconds=120)
        options = [("bench", {"lora": [{"id": j, "scale": 1.0 if j == i else 0.0} for j in range(len(copies))],
                              "ignore_eos": True}) for i in range(len(copies))]
        requests, wall = drive(f"http://127.0.0.1:{port}", workload, args, options)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    row = summarize("llama-server", requests, wall, None)
    print(f"  llama-server: {row['requests']} requests, {row['errors']} errors, {row['tokens_per_s']:.0f} tokens/s",
          flush=True)
    return row


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen | None = None, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process is not None and process.poll() is not None:
            raise SystemExit(f"{url}: the server exited: {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: not healthy after {seconds:.0f} s")
        time.sleep(0.2)


# -- the report --------------------------------------------------------------------


def _settings(workload: Workload, args) -> dict:
    return {"model": str(workload.model.relative_to(ROOT) if workload.model.is_relative_to(ROOT) else workload.model),
            "source_adapters": [s.name for s in workload.sources], "adapters": args.adapters,
            "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
            "threads": args.threads, "executors": args.executors, "prompts": len(workload.prompts),
            "load_average_at_end": os.getloadavg()[0], "cpus": os.cpu_count()}


def render(rows: list[dict], workload: Workload, args, skipped: str | None) -> str:
    settings = _settings(workload, args)
    lines = [
        f"# Serving under load: {args.clients} streaming clients over {args.adapters} adapters for "
        f"{args.seconds:.0f} s",
        "",
        f"Model `{settings['model']}`, adapters {', '.join(settings['source_adapters'])} (copied round robin), "
        f"greedy, max_tokens {args.max_tokens}, {args.threads} thread(s), our --executors {args.executors}, "
        f"{settings['cpus']} CPUs (load average {settings['load_average_at_end']:.1f} at the end).",
        "",
        "| server | requests | errors | equal to offline | tokens/s | requests/s | TTFT p50 / p99 (ms) "
        "| inter-token p50 / p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        equal = (f"{row['requests'] - row['errors'] - row['mismatches']}/{row['requests'] - row['errors']}"
                 if "mismatches" in row else "n/a")
        lines.append(f"| {row['server']} | {row['requests']} | {row['errors']} | {equal} | {row['tokens_per_s']:.0f} "
                     f"| {row['requests_per_s']:.1f} | {_ms(row['ttft_ms_p50'])} / {_ms(row['ttft_ms_p99'])} "
                     f"| {_ms(row['itl_ms_p50'])} / {_ms(row['itl_ms_p99'])} |")
    if skipped:
        lines += ["", f"llama-server: skipped ({skipped})."]
    lines += ["", "Command: `python3 benchmarks/serve_load.py " + " ".join(sys.argv[1:]) + "`", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
