"""Load on ``python -m runtime serve``: N concurrent streaming clients over K adapters for T seconds.

    python3 -m benchmarks.serve_load [--model M] [--clients 32] [--adapters 8] [--seconds 60]
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
``--max-tokens``). ``--chat-template FILE`` sends each prompt as a one-message conversation
rendered with that template: the prompts then begin alike (the template's system head),
which both servers' prefix caches can reuse.

``--replicas 1,2`` measures ``runtime serve --replicas N`` (the ``cluster`` extra; a local
Ray per server, ``--threads`` per replica) for each N instead of one process, the engine
alone and llama-server; ``--max-adapters-per-replica K`` bounds each replica's adapters,
``--zipf S`` draws each request's adapter from Zipf(S) over the adapters instead of round
robin, and a ``--warmup`` turn first lets the replicas tell Ray Serve's router what they
hold. Each row then adds the adapter hit rate (requests whose replica held their adapter)
and adapter loads per 1,000 requests, read from ``/metrics``, and the table the ratio of
each replica count's tokens/s to the first's.

The same workload against llama.cpp's ``llama-server`` (``--llama-server``, built by
``bash benchmarks/llama_cpp/build_server.sh``) runs with ``--gguf`` (the same weights)
and one ``--gguf-lora`` per source adapter, in the same order: every client sends the
same prompt ids with a per-request ``lora: [{"id", "scale"}]``. Its answers are counted,
not compared (its text is its own vocabulary's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import BENCHMARKS, REPO, RESULTS, date_and_cpu
from runtime import ByteTokenizer, Engine, EngineSettings, HfTokenizer, LoraSource, SessionConfig, Tokenizer
from runtime.components.chat_template import ChatTemplate

HERE, ROOT = BENCHMARKS, REPO
WORK = RESULTS / "tmp" / "serve_load"  # gitignored: copies of the adapters, the synthetic tokenizer
BENCH_MODEL = HERE / "models" / "bench_f32.tflite"
BENCH_ADAPTERS = [HERE / "models" / name for name in ("peft_r8_a", "peft_r8_b", "peft_r64")]
DEMO = ROOT / "runtime" / "demo_assets"
DEMO_ADAPTERS = [DEMO / "adapters" / f"{name}.tflite" for name in ("uppercase", "no_vowels", "json")]
NEWLINE = 10
HANG_SECONDS = 60.0  # a turn waits this long past its end for the last answers
TEXT_PROMPTS = ["hello world\n", "the cat sat\n", "open the door now\n", "green tea\n", "my blue kite\n",
                "What is the capital of France?", "Name three colours.", "Write one short sentence."]


@dataclass
class Workload:
    """What the clients send and how each answer is checked."""

    model: Path
    server_args: list[str]  # tokenizer options for `python -m runtime serve`
    tokenizer: Tokenizer | Path | None  # the same for an Engine in this process (None: the bundle's)
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
    parser.add_argument("--chat-template", type=Path,
                        help="a Jinja2 chat template: each prompt is sent as the token ids of a one-message "
                        "conversation rendered with it, as /v1/chat/completions would (the prompts then share the "
                        "template's head, e.g. a default system prompt)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8, help="adapters served (copies of the sources)")
    parser.add_argument("--seconds", type=float, default=60.0, help="load time per server")
    parser.add_argument("--rounds", type=int, default=2,
                        help="the seconds are split into this many rounds, servers taking turns")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per executor (both servers)")
    parser.add_argument("--executors", type=int, default=1, help="our server's --executors")
    parser.add_argument("--prefix-cache-mb", type=float, default=64.0,
                        help="our server's --prefix-cache-mb (also the engine alone's; llama-server reuses a "
                        "slot's prompt head by default too)")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--gguf", type=Path, default=HERE / "models" / "gguf" / "bench-f32.gguf")
    parser.add_argument("--gguf-lora", type=Path, action="append")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--replicas", type=lambda text: [int(n) for n in text.split(",")],
                        help="comma-separated replica counts: measure `runtime serve --replicas N` for each")
    parser.add_argument("--max-adapters-per-replica", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=None, help="each request's adapter drawn from Zipf(S)")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds of load before each server is measured")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the servers started below are stopped
    if args.zipf is not None:
        ZIPF.append(args.zipf)

    workload = build_workload(args)
    print(f"model {workload.model.name}: {len(workload.sources)} source adapters -> {args.adapters} served, "
          f"{len(workload.prompts)} prompts, {args.clients} clients x {args.seconds:.0f} s in {args.rounds} rounds, "
          f"max_tokens {args.max_tokens}", flush=True)
    folder, names = copy_adapters(workload, args.adapters)
    if args.out is None:
        args.out = RESULTS / ("serve_load_replicas" if args.replicas else "serve_load")
    if args.replicas:
        targets = [OurServer(workload, args, folder, names, replicas=n) for n in args.replicas]
        llama = "--replicas"
    else:
        targets = [OurServer(workload, args, folder, names), EngineAlone(workload, args, folder, names)]
        llama = llama_setup(workload, args)
    if isinstance(llama, str):
        print(f"llama-server: skipped ({llama})", flush=True)
    else:
        targets.append(LlamaServer(workload, args, llama))
    collected = {target.label: ([], 0.0) for target in targets}
    rates: list[dict[str, float]] = []
    started = date_and_cpu()
    with contextlib.ExitStack() as stack:
        for target in targets:
            stack.enter_context(target)
        for round_index in range(args.rounds):
            rates.append({})
            for target in targets if round_index % 2 == 0 else targets[::-1]:
                requests, wall = target.run(args.seconds / args.rounds)
                done, total = collected[target.label]
                collected[target.label] = (done + requests, total + wall)
                rates[-1][target.label] = sum(r.tokens for r in requests if r.error is None) / wall
                print(f"  round {round_index + 1} {target.label}: {len(requests)} requests in {wall:.1f} s, "
                      f"{rates[-1][target.label]:.0f} tokens/s", flush=True)
    rows = [summarize(t.label, *collected[t.label], workload if t.checks else None) for t in targets]
    for target, row in zip(targets, rows):
        row.update({f"replica_{key}": value for key, value in getattr(target, "adapter_counts", {}).items()})
    for row in rows[1:]:
        ratios = [r[rows[0]["server"]] / r[row["server"]] for r in rates if r[row["server"]] > 0]
        row["ours_vs_this_tokens_per_s"] = statistics.median(ratios) if ratios else None
        if args.replicas:  # each replica count against the first
            row["ours_vs_this_tokens_per_s"] = 1 / row["ours_vs_this_tokens_per_s"] if ratios else None
    settings = _settings(workload, args, started)
    table = render(rows, settings, args, llama if isinstance(llama, str) else None)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table)
    args.out.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows,
                                                         "tokens_per_s_by_round": rates}, indent=2) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    checked = [row for row in rows if "mismatches" in row]  # ours; llama-server's errors are reported, not ours
    return 0 if all(row["errors"] == 0 and row["mismatches"] == 0 for row in checked) else 1


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
    workload = Workload(model, server_args, tokenizer, [Path(s) for s in sources], [])
    with Engine(model, EngineSettings(num_threads=args.threads), tokenizer=tokenizer) as engine:
        if synthetic:
            rng = random.Random(20250601)
            workload.prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(6, 14))] for _ in range(8)]
        elif args.chat_template is not None:
            template = ChatTemplate(args.chat_template.read_text())
            workload.prompts = [engine.tokenizer.encode(template.render([{"role": "user", "content": text}]))
                                for text in TEXT_PROMPTS]
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
        adapter, prompt = _pick(index, turn, len(request_options), len(workload.prompts))
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
                if not chunk.choices or chunk.choices[0].finish_reason is not None:
                    continue  # the usage chunk, the closing chunk
                now = time.perf_counter()  # a token came (llama-server sends '' for pieces it holds back)
                if record.first is None:
                    record.first = now
                else:
                    record.gaps.append(now - last)
                last = now
                record.text += chunk.choices[0].text or ""
        except Exception as exc:  # counted as an error
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        out.append(record)
        turn += 1


def drive(url: str, workload: Workload, args, seconds: float, request_options) -> tuple[list[Request], float]:
    """Runs the clients against a server for ``seconds``; returns every request and the wall time."""
    import openai

    async def run() -> tuple[list[Request], float]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        requests: list[Request] = []
        started = time.perf_counter()
        deadline = started + seconds
        clients = [asyncio.ensure_future(client_loop(client, i, deadline, workload, args.max_tokens, request_options,
                                                     requests)) for i in range(args.clients)]
        _, hung = await asyncio.wait(clients, timeout=seconds + HANG_SECONDS)
        for task in hung:  # a request still unanswered long after the deadline: counted as an error
            task.cancel()
            requests.append(Request(-1, -1, deadline, error=f"no answer {HANG_SECONDS:.0f} s after the turn ended"))
        await asyncio.gather(*hung, return_exceptions=True)
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


# -- what is measured --------------------------------------------------------------


class OurServer:
    """``python -m runtime serve`` in a subprocess, one adapter per request by name (with
    ``replicas``: ``--replicas N`` on a local Ray, its adapter hits and loads counted)."""

    label = "runtime serve"
    checks = True  # its answers are compared with offline

    def __init__(self, workload: Workload, args, folder: Path, names: list[str], replicas: int | None = None) -> None:
        self._workload, self._args, self._names = workload, args, names
        self._command = [sys.executable, "-m", "runtime", "serve", "--model", str(workload.model),
                         *workload.server_args, "--adapters", str(folder), "--port", "0",
                         "--max-concurrent", str(args.clients), "--threads", str(args.threads),
                         "--executors", str(args.executors), "--prefix-cache-mb", str(args.prefix_cache_mb)]
        self._replicas = replicas
        self.adapter_counts: dict[str, float] = {}
        if replicas is not None:
            self.label = f"runtime serve --replicas {replicas}"
            self._command += ["--replicas", str(replicas),
                              "--max-adapters-per-replica", str(args.max_adapters_per_replica)]

    def __enter__(self) -> OurServer:
        log = WORK / "runtime-serve.log"  # a file, not a pipe: a full pipe would stall the server
        with open(log, "w") as stderr:
            self._process = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT)
        found = None
        for line in self._process.stdout:  # the address ("starting N replicas" may come first)
            found = re.search(r"http://127\.0\.0\.1:\d+", line)
            if found is not None:
                break
        if found is None:
            self._process.kill()
            raise SystemExit(f"the server did not start: {log.read_text()[-2000:]}")
        self._url = found.group(0)
        wait_healthy(self._url + "/health", self._process, log)
        if self._args.warmup > 0:
            drive(self._url, self._workload, self._args, self._args.warmup, [(name, None) for name in self._names])
            time.sleep(2.0)  # the replicas' report of what they hold reaches the router
        return self

    def __exit__(self, *exc_info) -> None:
        stop_process(self._process)

    def run(self, seconds: float) -> tuple[list[Request], float]:
        before = self._replica_counts()
        result = drive(self._url, self._workload, self._args, seconds, [(name, None) for name in self._names])
        for key, value in self._replica_counts().items():
            self.adapter_counts[key] = self.adapter_counts.get(key, 0.0) + value - before.get(key, 0.0)
        counts = self.adapter_counts
        if counts.get("requests"):
            counts["adapter_hit_rate"] = counts.get("hits", 0.0) / max(1.0, counts["hits"] + counts.get("misses", 0))
            counts["adapter_loads_per_1000_requests"] = 1000 * counts.get("loads", 0.0) / counts["requests"]
        return result

    def _replica_counts(self) -> dict[str, float]:
        """The replicas' adapter hits, misses, loads and requests, summed, from /metrics."""
        if self._replicas is None:
            return {}
        with urllib.request.urlopen(self._url + "/metrics", timeout=30) as response:
            page = response.read().decode()
        counts: dict[str, float] = {}
        for key, series in (("hits", "runtime_replica_adapter_hits_total"),
                            ("misses", "runtime_replica_adapter_misses_total"),
                            ("loads", "runtime_replica_adapter_loads_total"),
                            ("requests", "runtime_replica_requests_total")):
            counts[key] = sum(float(value) for value in re.findall(rf"^{series}{{[^}}]*}} (\S+)$", page, re.M))
        return counts


class LlamaServer:
    """llama.cpp's ``llama-server`` on the same weights, adapters chosen per request."""

    label = "llama-server"
    checks = False  # its text is its own vocabulary's

    def __init__(self, workload: Workload, args, loras: list[Path]) -> None:
        self._workload, self._args = workload, args
        self._port = free_port()
        copies = [loras[i % len(loras)] for i in range(args.adapters)]
        self._command = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1",
                         "--port", str(self._port), "-c", str(256 * args.clients), "--parallel", str(args.clients),
                         "-t", str(args.threads), "-tb", str(args.threads), "-fa", "off", "--cache-type-k", "f32",
                         "--cache-type-v", "f32", "--lora-init-without-apply", "--no-webui"]
        for path in copies:
            self._command += ["--lora", str(path)]
        self._options = [("bench", {"lora": [{"id": j, "scale": float(j == i)} for j in range(len(copies))],
                                    "ignore_eos": True}) for i in range(len(copies))]

    def __enter__(self) -> LlamaServer:
        log = WORK / "llama-server.log"  # it logs every request: a pipe nobody reads would fill and stall it
        with open(log, "w") as stderr:
            self._process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=stderr)
        wait_healthy(f"http://127.0.0.1:{self._port}/health", self._process, log, seconds=120)
        return self

    def __exit__(self, *exc_info) -> None:
        stop_process(self._process)

    def run(self, seconds: float) -> tuple[list[Request], float]:
        return drive(f"http://127.0.0.1:{self._port}", self._workload, self._args, seconds, self._options)


class EngineAlone:
    """The same requests on the engine in this process, one thread per client, no HTTP:
    what the server's own work costs is the difference."""

    label = "engine alone (no HTTP)"
    checks = True

    def __init__(self, workload: Workload, args, folder: Path, names: list[str]) -> None:
        self._workload, self._args = workload, args
        self._paths = [next(folder.glob(f"{name}*")) for name in names]

    def __enter__(self) -> EngineAlone:
        self._engine = Engine(self._workload.model,
                              EngineSettings(num_threads=self._args.threads, executors=self._args.executors,
                                             prefix_cache_bytes=int(self._args.prefix_cache_mb * 2**20)),
                              tokenizer=self._workload.tokenizer)
        for path in self._paths:
            self._engine.register_adapter(LoraSource(path=path))
        return self

    def __exit__(self, *exc_info) -> None:
        self._engine.close()

    def run(self, seconds: float) -> tuple[list[Request], float]:
        requests: list[Request] = []
        started = time.perf_counter()
        deadline = started + seconds
        threads = [threading.Thread(target=self._client, args=(i, deadline, requests)) for i in range(self._args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return requests, time.perf_counter() - started

    def _client(self, index: int, deadline: float, out: list[Request]) -> None:
        turn = 0
        while time.perf_counter() < deadline:
            adapter, prompt = _pick(index, turn, len(self._paths), len(self._workload.prompts))
            record = Request(adapter % len(self._workload.sources), prompt, time.perf_counter())
            times: list[float] = []
            try:
                with self._engine.create_session(SessionConfig(loras=[LoraSource(path=self._paths[adapter])])) as s:
                    result = s.generate(self._workload.prompts[prompt], self._args.max_tokens,
                                        on_token=lambda _: times.append(time.perf_counter()))
                record.text, record.tokens = result.text, len(result.tokens)
                record.first = times[0]
                record.gaps = [b - a for a, b in zip(times, times[1:])]
            except Exception as exc:  # counted as an error
                record.error = f"{type(exc).__name__}: {exc}"[:200]
            out.append(record)
            turn += 1


def default_llama_server() -> Path | None:
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


ZIPF: list[float] = []  # --zipf S: [S] (each request's adapter drawn from Zipf(S)); empty: round robin


def _pick(client: int, turn: int, adapters: int, prompts: int) -> tuple[int, int]:
    """The adapter and prompt of a client's turn: each request on the next adapter (or, with
    --zipf, one drawn from Zipf over the adapters, seeded by client and turn)."""
    if ZIPF:
        weights = [1.0 / (rank + 1) ** ZIPF[0] for rank in range(adapters)]
        adapter = random.Random(client * 1_000_003 + turn).choices(range(adapters), weights)[0]
        return adapter, (client * 3 + turn) % prompts
    return (client + turn) % adapters, (client * 3 + turn) % prompts


def stop_process(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{url}: the server exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: not healthy after {seconds:.0f} s")
        time.sleep(0.2)


# -- the report --------------------------------------------------------------------


def _settings(workload: Workload, args, started: dict[str, str]) -> dict:
    """The run's settings for the result files; ``started``: its date and CPU, taken as it began."""
    return {"model": str(workload.model.relative_to(ROOT) if workload.model.is_relative_to(ROOT) else workload.model),
            "source_adapters": [s.name for s in workload.sources], "adapters": args.adapters,
            "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
            "threads": args.threads, "executors": args.executors, "prefix_cache_mb": args.prefix_cache_mb,
            "prompts": len(workload.prompts),
            "load_average_at_end": os.getloadavg()[0], "cpus": os.cpu_count(), **started}


def render(rows: list[dict], settings: dict, args, skipped: str | None) -> str:
    lines = [
        f"# Serving under load: {args.clients} streaming clients over {args.adapters} adapters, "
        f"{args.seconds:.0f} s each",
        "",
        f"Model `{settings['model']}`, adapters {', '.join(settings['source_adapters'])} (copied round robin), "
        f"greedy, max_tokens {args.max_tokens}, {args.threads} thread(s), our --executors {args.executors} "
        f"and --prefix-cache-mb {args.prefix_cache_mb:g}, "
        f"{settings['cpus']} CPUs of {settings['cpu']} (load average {settings['load_average_at_end']:.1f} at the "
        f"end), {settings['date']}. "
        + ("Each replica count is its own server on a local Ray, with the thread(s) above per replica. "
           if args.replicas else "")
        + f"Each took {args.rounds} turns of {args.seconds / args.rounds:.0f} s, in alternating order; the last "
        + ("column is this row's tokens/s over the first row's" if args.replicas
           else "column is runtime serve's tokens/s over this row's")
        + ", the median of the turns' ratios.",
        "",
        "| server | requests | errors | equal to offline | tokens/s | requests/s | TTFT p50 / p99 (ms) "
        "| inter-token p50 / p99 (ms) | runtime serve vs this |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        equal = (f"{row['requests'] - row['errors'] - row['mismatches']}/{row['requests'] - row['errors']}"
                 if "mismatches" in row else "n/a")
        lines.append(f"| {row['server']} | {row['requests']} | {row['errors']} | {equal} | {row['tokens_per_s']:.0f} "
                     f"| {row['requests_per_s']:.1f} | {_ms(row['ttft_ms_p50'])} / {_ms(row['ttft_ms_p99'])} "
                     f"| {_ms(row['itl_ms_p50'])} / {_ms(row['itl_ms_p99'])} "
                     f"| {_ratio(row.get('ours_vs_this_tokens_per_s'))} |")
    replicated = [row for row in rows if "replica_adapter_hit_rate" in row]
    if replicated:
        mix = f"Zipf({args.zipf:g})" if args.zipf is not None else "round robin"
        lines += ["", f"Adapters: {mix} over {args.adapters}, --max-adapters-per-replica "
                  f"{args.max_adapters_per_replica}, {args.warmup:g} s of warm-up first (not counted). Read from the "
                  "replicas' counters on /metrics.", "",
                  "| server | adapter hit rate | adapter loads per 1,000 requests |", "|---|---:|---:|"]
        lines += [f"| {row['server']} | {100 * row['replica_adapter_hit_rate']:.1f}% "
                  f"| {row['replica_adapter_loads_per_1000_requests']:.1f} |" for row in replicated]
    if skipped and not args.replicas:
        lines += ["", f"llama-server: skipped ({skipped})."]
    lines += ["", "Command: `python3 -m benchmarks.serve_load " + " ".join(sys.argv[1:]) + "`", ""]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
