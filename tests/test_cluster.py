"""``runtime serve --replicas N`` (runtime.serve.cluster): the real command with a local Ray
(2 CPUs, 2 engine replicas) on the bundled demo model, driven over HTTP like any client.

Every greedy answer is compared with ``Session.generate`` offline on another engine of the
same model. The tests that need Ray are marked ``cluster`` and skipped without it; the one
about the missing extra runs everywhere. The module's last test stops the server with
SIGTERM and checks that none of its processes (Ray's included) is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime import ByteTokenizer, Engine, LoraSource, SessionConfig
from runtime.cli.main import build_parser
from runtime.errors import InvalidArgumentError
from runtime.serve.cluster import launch
from runtime.serve.cluster.launch import ClusterOptions
from runtime.serve.cluster.replica import EngineReplica, StallWatch, adapter_set_id, batches, parse_adapter_set_id
from runtime.serve.cluster import state as state_module
from runtime.serve.cluster.state import ClusterCatalog, ClusterState, file_sha256
from test_serve import huge_adapter

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(str(resources.files("runtime") / "demo_assets"))
MODEL = DEMO / "model.tflite"
NEWLINE = 10
KEY = "cluster-key-0123"
TEMPLATE = '{{ messages[-1].content + "\\n" }}'
ADAPTERS = ("uppercase", "no_vowels", "json")
PROMPTS = ("hello world\n", "the cat sat\n", "green tea\n")
DEMO_ADAPTERS = tuple(DEMO / "adapters" / f"{name}.tflite" for name in ADAPTERS)
TINY_MODEL = ROOT / "tests" / "models" / "gqa_default.tflite"  # random weights, rank slots 4 and 16
TINY_ADAPTERS = tuple(ROOT / "tests" / "models" / "adapters" / f"{name}.tflite" for name in ("torch_r4", "litertlm_r4"))
START_TIMEOUT_S = 180
REPLICA_TIMEOUT_S = 5  # the module's server's --replica-timeout

cluster = pytest.mark.cluster


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


class ClusterServer:
    """``python -m runtime serve --replicas 2`` in a subprocess of its own session."""

    def __init__(self, tmp: Path, model: Path = MODEL, adapters: tuple[Path, ...] = DEMO_ADAPTERS,
                 options: tuple[str, ...] = ("--stop-token", "10", "--replicas", "2", "--replica-timeout",
                                             str(REPLICA_TIMEOUT_S)),
                 environment: dict[str, str] | None = None) -> None:
        self.adapters = tmp / "adapters"
        self.adapters.mkdir(parents=True)
        for path in adapters:
            shutil.copy(path, self.adapters)
        template = tmp / "template.jinja"
        template.write_text(TEMPLATE)
        self.log = open(tmp / "server.log", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runtime", "serve", "--model", str(model), "--byte-tokens", *options,
             "--chat-template", str(template), "--adapters", str(self.adapters), "--served-model-name", "demo",
             "--port", "0", "--api-key", KEY, "--max-adapters-per-replica", "4"],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env={**_environment(), **(environment or {})},
            start_new_session=True)
        self.url = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        lines = []
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"at (http://\S+)/v1 ", line)
            if found:
                self.url = found.group(1)
                break
        if not self.url:
            self.process.kill()
            self.log.seek(0)
            raise AssertionError(f"the server did not start: {''.join(lines)}{self.log.read()[-3000:]}")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # drains stdout

    def call(self, path: str, body: object = None, *, method: str | None = None,
             timeout: float = 60) -> tuple[int, dict, dict]:
        """Status, JSON body and headers of one request."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {KEY}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, payload, headers = response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as error:
            status, payload, headers = error.code, error.read(), dict(error.headers)
        try:
            return status, json.loads(payload), headers
        except json.JSONDecodeError:
            return status, {"text": payload.decode(errors="replace")}, headers

    def complete(self, model: str, prompt: str, **fields) -> tuple[str, str]:
        """The text of a greedy completion and the replica that answered."""
        status, body, headers = self.call("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 64,
                                                               "temperature": 0, **fields})
        assert status == 200, body
        return body["choices"][0]["text"], headers["x-runtime-replica"]

    def stream(self, body: dict, timeout: float = 60) -> tuple[str, list[dict], str]:
        """A streaming completion: the replica header, every event's JSON, and the last line."""
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps({**body, "stream": True})
                                         .encode())
        request.add_header("Authorization", f"Bearer {KEY}")
        request.add_header("Content-Type", "application/json")
        events, last = [], ""
        with urllib.request.urlopen(request, timeout=timeout) as response:
            replica = response.headers.get("x-runtime-replica", "")
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                last = line[6:]
                if last != "[DONE]":
                    events.append(json.loads(last))
        return replica, events, last

    def metrics(self) -> str:
        request = urllib.request.Request(self.url + "/metrics")
        request.add_header("Authorization", f"Bearer {KEY}")
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read().decode()

    def replica_values(self, name: str) -> dict[str, float]:
        """One per-replica series of /metrics: replica -> value."""
        found = {}
        for line in self.metrics().splitlines():
            hit = re.fullmatch(rf'{name}{{replica="([^"]+)"}} (\S+)', line)
            if hit:
                found[hit.group(1)] = float(hit.group(2))
        return found

    def live_replicas(self) -> dict[str, int]:
        """Replicas reporting now -> their process id."""
        up = self.replica_values("runtime_replica_up")
        pids = self.replica_values("runtime_replica_pid")
        return {replica: int(pids[replica]) for replica, value in up.items() if value == 1.0}


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _gcs_address(server: ClusterServer) -> str:
    """HOST:PORT of the local Ray that ``server`` started (as its raylet was given it)."""
    for pid in _descendants(server.process.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                arguments = file.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for argument in arguments:
            if argument.startswith("--gcs-address="):
                return argument.partition("=")[2]
    raise AssertionError("no Ray process of the server names its GCS address")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("ray", reason="needs the cluster extra: pip install -e '.[cluster]'")
    server = ClusterServer(tmp_path_factory.mktemp("cluster"))
    yield server
    _stop(server)  # if the SIGTERM test did not


def _stop(server: ClusterServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def offline():
    engine = Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]))

    def generate(prompt: str, loras=(), max_tokens: int = 64) -> str:
        sources = [LoraSource(path=DEMO / "adapters" / f"{name}.tflite", scale=scale) for name, scale in loras]
        with engine.create_session(SessionConfig(loras=sources)) as session:
            result = session.generate(list(prompt.encode()), max_tokens, stop_tokens=[NEWLINE])
        return bytes(token for token in result.tokens if token != NEWLINE).decode(errors="replace")

    yield generate
    engine.close()


# -- without Ray -----------------------------------------------------------------


def test_adapter_set_ids_are_sorted_and_read_back():
    digests = {"b": "2" * 64, "a": "1" * 64}
    assert adapter_set_id(digests) == f"a@{'1' * 64}+b@{'2' * 64}"
    assert parse_adapter_set_id(adapter_set_id(digests)) == sorted(digests.items())
    assert adapter_set_id({}) == "" and parse_adapter_set_id("") == []


@pytest.fixture
def ingress_catalog(tmp_path):
    """A ClusterCatalog over the demo model and its adapters' directory (not scanned), and
    what it published, in order; ``hooks["publish"]`` runs before each is kept."""
    for path in DEMO_ADAPTERS:
        shutil.copy(path, tmp_path)
    published: list[dict[str, dict[str, str]]] = []
    hooks = {"publish": lambda entries: None}

    def publish(entries: dict[str, dict[str, str]]) -> None:
        hooks["publish"](entries)
        published.append(entries)

    engine = Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]))
    yield ClusterCatalog(engine, tmp_path, publish=publish), published, hooks
    engine.close()


def test_a_waiting_stream_says_alive_only_while_its_engine_steps():
    """A request queued behind others' prefills sends ("alive",) while the engine runs steps,
    so that --replica-timeout ends only a stuck replica's streams; a stuck engine's stream
    sends nothing until the job does."""
    async def scenario() -> None:
        events: asyncio.Queue = asyncio.Queue()
        runs = 0

        async def steps() -> int:
            return runs

        stream = batches(events, steps, interval=0.02)
        events.put_nowait(("start",))
        events.put_nowait(("text", "a"))
        assert await anext(stream) == [("start",), ("text", "a")]  # what came meanwhile: one list
        runs = 5  # the engine steps for other requests
        assert await asyncio.wait_for(anext(stream), 1) == [("alive",)]
        pending = asyncio.ensure_future(anext(stream))  # the engine stuck: no step any more
        done, _ = await asyncio.wait({pending}, timeout=0.2)
        assert not done
        events.put_nowait(("outcome", None))
        assert await asyncio.wait_for(pending, 1) == [("outcome", None)]

    asyncio.run(scenario())


def test_the_ingress_lists_an_adapter_only_while_the_replicas_have_it(ingress_catalog, monkeypatch):
    """A request may lease what the ingress lists: its digest and the replicas' entry must be
    there (it was listed while its file was hashed, then published: a KeyError (500) for its
    digest, then a 404 from the replica)."""
    catalog, published, hooks = ingress_catalog
    known = [{}]

    def check_listed(what: str) -> None:
        for entry in catalog.entries():
            assert entry.name in known[0], f"{entry.name} listed {what}, the replicas not told"
            assert catalog.digest(entry.name) == known[0][entry.name]["sha256"]

    def hashing(path: Path) -> str:
        check_listed("while its file was hashed")
        return file_sha256(path)

    def publishing(entries: dict[str, dict[str, str]]) -> None:
        check_listed("before it was published")
        known[0] = entries

    monkeypatch.setattr(state_module, "file_sha256", hashing)
    hooks["publish"] = publishing
    for name in ADAPTERS:
        catalog.load_path(name, f"{name}.tflite")
    catalog.unload("json")
    assert set(published[-1]) == {"uppercase", "no_vowels"} and set(known[0]) == {"uppercase", "no_vowels"}


def test_concurrent_loads_publish_a_catalogue_with_both(ingress_catalog):
    """Each publication is the whole catalogue: a slower one built before another must not
    be sent after it (the replicas lost the other adapter: 404s for an adapter listed)."""
    catalog, published, hooks = ingress_catalog
    first_publishing, second_published = threading.Event(), threading.Event()

    def publishing(entries: dict[str, dict[str, str]]) -> None:
        if set(entries) == {"uppercase"}:
            first_publishing.set()
            second_published.wait(1.0)  # the fix makes the second wait for this one: 1 s
        else:
            second_published.set()

    hooks["publish"] = publishing
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(catalog.load_path, "uppercase", "uppercase.tflite")
        assert first_publishing.wait(30)
        second = pool.submit(catalog.load_path, "json", "json.tflite")
        first.result(), second.result()
    assert set(published[-1]) == {"uppercase", "json"}, published


def test_a_replica_silent_for_a_minute_leaves_the_reports(monkeypatch):
    """A killed replica's replacement has a new name: the dead one is shown as down for a
    while, then dropped (every replica that ever ran stayed on /metrics, one series each)."""
    clock = [1000.0]
    monkeypatch.setattr(state_module, "time", SimpleNamespace(time=lambda: clock[0]))
    state = ClusterState()
    state.sync("killed", {"requests": 3})
    clock[0] += 30
    state.sync("replacement", {"requests": 1})
    assert set(state.reports()) == {"killed", "replacement"}
    clock[0] += state_module.REPORT_KEEP_S - 29
    state.sync("replacement", {"requests": 2})
    assert state.reports() == {"replacement": (clock[0], {"requests": 2, "catalogue_version": 0})}


def test_a_replica_whose_engine_runs_no_step_while_requests_work_fails_its_health_checks():
    """Stuck in a step, a replica's event loop still answered Ray Serve's health checks, so it
    was never replaced and every request routed to it ended after --replica-timeout."""
    watch = StallWatch(limit_s=60)
    assert watch.stalled_for(working=0, invokes=5, now=0) is None  # idle: never stuck
    assert watch.stalled_for(working=1, invokes=5, now=2) is None
    assert watch.stalled_for(working=1, invokes=5, now=61) == 61
    assert watch.stalled_for(working=1, invokes=6, now=63) is None  # a step: going on
    assert watch.stalled_for(working=1, invokes=6, now=120) is None  # 57 s: a long step, not yet stuck
    assert watch.stalled_for(working=0, invokes=6, now=500) is None
    assert watch.stalled_for(working=1, invokes=6, now=502) is None  # stuck since it was last idle at most
    never = StallWatch(limit_s=0)  # --replica-timeout 0
    assert never.stalled_for(1, 5, 0) is None and never.stalled_for(1, 5, 1e6) is None

    invokes = [7]
    replica = object.__new__(EngineReplica)  # its health check alone, without Ray
    replica.name, replica._lock, replica._working = "r1", threading.Lock(), 1
    replica.engine = SimpleNamespace(stats=lambda: SimpleNamespace(invokes=invokes[0]))
    replica._start_sync = lambda: None
    replica._stalls = StallWatch(limit_s=0.05)
    asyncio.run(replica.check_health())
    time.sleep(0.1)
    with pytest.raises(RuntimeError, match=r"replica r1: 1 request\(s\) running and its engine ran no step for 0 s "
                       r"\(--replica-timeout 0.05\): stuck"):
        asyncio.run(replica.check_health())
    invokes[0] += 1
    asyncio.run(replica.check_health())


def test_replicas_without_the_extra_is_one_line_naming_it(tmp_path):
    hide_ray = ("import sys; sys.modules['ray'] = None; from runtime.cli.main import main; "
                f"sys.exit(main(['serve', '--model', {str(MODEL)!r}, '--byte-tokens', '--replicas', '2']))")
    done = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True, env=_environment(),
                          timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install -e ".[cluster]"' in lines[0], done.stderr


@pytest.mark.parametrize("flag,value", [("--ray-address", "127.0.0.1:1"), ("--max-adapters-per-replica", "4"),
                                        ("--replica-timeout", "5")])
def test_a_replicas_option_without_replicas_is_refused(flag, value):
    parsed = build_parser().parse_args(["serve", "--model", str(MODEL), "--byte-tokens", flag, value,
                                        "--port", "70000"])  # were it not refused: an error, not a server
    with pytest.raises(InvalidArgumentError, match=f": {flag} goes with --replicas N$"):
        parsed.run(parsed)


def test_each_replica_reserves_the_cpus_it_runs():
    """A replica runs --executors copies of the model, each on --threads threads: it asks Ray for
    that many CPUs (it asked for --threads alone, and a machine took more replicas than it has cores)."""
    made = {}
    serve = SimpleNamespace(multiplexed=lambda **_: (lambda function: function),
                            deployment=lambda replica_class, **options: made.update(options))
    options = ClusterOptions(2, threads=2, executors=3)
    launch.deployment(serve, options)
    assert options.cpus_per_replica == 6 and made["ray_actor_options"] == {"num_cpus": 6}
    options.check_fits(12)
    with pytest.raises(InvalidArgumentError, match=r": --replicas 2 x --threads 2 x --executors 3 needs 12 CPUs .* "
                       r"has 11 available: at most 1 replicas"):
        options.check_fits(11)


def test_joining_a_cluster_without_the_replicas_cpus_says_the_server_waits_for_them():
    """Ray Serve waits for a replica's CPUs however long it takes: joined to a cluster
    (--ray-address) the server's start hung with nothing said."""
    options = ClusterOptions(3, address="10.0.0.1:6379", threads=2)
    assert options.wait_notice(free=6, total=6) is None
    assert options.wait_notice(free=4, total=8) == (
        "--replicas 3 x --threads 2 ask the Ray cluster for 6 CPUs and it has 4 free of 8: the replicas start as "
        "CPUs free up, and the server waits for them (Ctrl-C stops)")
    assert "it has 4 in all: the replicas start only once nodes join it" in options.wait_notice(free=1, total=4)


def test_more_replicas_than_the_machine_has_cpus_are_refused_before_ray_starts(monkeypatch):
    """A local Ray was started with as many CPUs as the replicas asked for, whatever the machine had."""
    monkeypatch.setattr(launch, "available_cpus", lambda: 4)
    parsed = build_parser().parse_args(["serve", "--model", str(MODEL), "--byte-tokens", "--replicas", "3",
                                        "--threads", "2", "--port", "70000"])
    with pytest.raises(InvalidArgumentError, match=r": --replicas 3 x --threads 2 needs 6 CPUs .* has 4 available: "
                       r"at most 2 replicas"):
        parsed.run(parsed)
    parsed = build_parser().parse_args(["serve", "--model", str(MODEL), "--byte-tokens", "--replicas", "2",
                                        "--threads", "2", "--executors", "2", "--port", "70000"])
    with pytest.raises(InvalidArgumentError, match=r"--executors 2 needs 8 CPUs"):
        parsed.run(parsed)


@pytest.mark.parametrize("args,words", [
    (["--model", "/no/such/model.tflite", "--byte-tokens"], "/no/such/model.tflite: no such model file"),
    (["--model", str(MODEL), "--byte-tokens", "--threads", str(os.cpu_count())],
     f"--replicas 2 x --threads {os.cpu_count()} needs {2 * os.cpu_count()} CPUs"),
    (["--model", str(MODEL), "--byte-tokens", "--port", "70000"], "--port 70000: expected 0-65535"),
    (["--model", str(MODEL), "--byte-tokens", "--threads", "0", "--port", "70000"],
     "--threads 0: expected an integer >= 1 with --replicas"),
])
@cluster
def test_what_one_process_refuses_is_refused_before_ray_starts(args, words):
    """As one line, as without --replicas (a model the replicas could not open was a Ray
    traceback of 190 lines after ~20 s of starting Ray and the replicas)."""
    pytest.importorskip("ray")
    done = subprocess.run([sys.executable, "-m", "runtime", "serve", *args, "--replicas", "2"], capture_output=True,
                          text=True, env=_environment(), timeout=120)
    assert done.returncode == 2 and "starting" not in done.stdout, done.stdout + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr[-2000:]


@cluster
def test_replicas_that_cannot_open_the_model_end_the_start_with_their_error(tmp_path):
    """As where the model is not at the ingress's path on a replica's node: the replicas' own
    error as the last line, exit 2 (was a Python traceback of Ray Serve's, exit 1)."""
    pytest.importorskip("ray")
    model = tmp_path / "model.tflite"
    shutil.copy(MODEL, model)
    process = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model", str(model), "--byte-tokens",
                                "--replicas", "1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_environment(), start_new_session=True)
    try:
        assert process.stdout.readline().startswith("starting 1 replicas")
        model.unlink()  # the ingress has it open; the replicas open it by its path after Ray started
        _, err = process.communicate(timeout=START_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    last = err.strip().splitlines()[-1]
    assert process.returncode == 2 and last.startswith("error: UNAVAILABLE: the replicas did not start: "), err[-3000:]
    assert f"NOT_FOUND: {model}: no such model file" in last, last


# -- answers ---------------------------------------------------------------------


@cluster
def test_greedy_answers_equal_offline(served, offline):
    for prompt in PROMPTS:
        for name in ADAPTERS:
            assert served.complete(name, prompt)[0] == offline(prompt, [(name, 1.0)])
        assert served.complete("demo", prompt)[0] == offline(prompt)
        assert served.complete("demo::json", prompt)[0] == offline(prompt, [("json", 1.0)])
        blend = [{"name": "uppercase", "scale": 0.5}]
        assert served.complete("demo", prompt, lora=blend)[0] == offline(prompt, [("uppercase", 0.5)])


@cluster
def test_chat_and_streaming_equal_offline(served, offline):
    status, body, headers = served.call("/v1/chat/completions", {
        "model": "no_vowels", "messages": [{"role": "user", "content": "green tea"}], "temperature": 0})
    assert status == 200 and headers["x-runtime-replica"]
    assert body["choices"][0]["message"]["content"] == offline("green tea\n", [("no_vowels", 1.0)])
    replica, events, last = served.stream({"model": "uppercase", "prompt": "the cat sat\n", "max_tokens": 64,
                                           "temperature": 0})
    assert replica and last == "[DONE]"
    assert "".join(event["choices"][0]["text"] for event in events) == offline("the cat sat\n",
                                                                              [("uppercase", 1.0)])
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@cluster
def test_models_are_the_catalogue_of_one_process(served):
    status, body, _ = served.call("/v1/models")
    assert status == 200
    assert {model["id"] for model in body["data"]} == {"demo", *ADAPTERS}


@cluster
def test_a_blend_of_two_adapters_is_one_set_on_a_replica(tmp_path, offline):
    """The tiny test model has a rank-16 slot: two rank-4 adapters blend, as one multiplexed set.

    Meanwhile a second server (the demo model) joins the first's Ray with --ray-address: each
    has its own replicas and catalogue (they shared one Serve application by name, so the
    second replaced the first's replicas with its own, and removed them on exit).

    Last, its one replica is killed: /health says unavailable until Ray Serve replaced it."""
    pytest.importorskip("ray")
    server = ClusterServer(tmp_path / "first", TINY_MODEL, TINY_ADAPTERS, ("--replicas", "1"))
    joined = None
    engine = Engine(TINY_MODEL, tokenizer=ByteTokenizer())
    try:
        joined = ClusterServer(tmp_path / "joined", options=("--stop-token", "10", "--replicas", "1", "--ray-address",
                                                             _gcs_address(server)),
                               environment={"RAY_AUTH_MODE": "token"})
        assert joined.complete("json", "green tea\n")[0] == offline("green tea\n", [("json", 1.0)])
        prompt = [5, 17, 42]

        def offline(loras) -> str:
            sources = [LoraSource(path=TINY_ADAPTERS[0].parent / f"{name}.tflite", scale=scale) for name, scale in loras]
            with engine.create_session(SessionConfig(loras=sources)) as session:
                return session.generate(prompt, 6).text

        blend = [("torch_r4", 0.6), ("litertlm_r4", -0.4)]
        status, body, headers = server.call("/v1/completions", {
            "model": "demo", "lora": [{"name": name, "scale": scale} for name, scale in blend], "prompt": prompt,
            "max_tokens": 6, "temperature": 0})
        assert status == 200 and headers["x-runtime-replica"], body
        assert body["choices"][0]["text"] == offline(blend) != offline([])
        status, body, _ = server.call("/v1/completions", {  # the same set, other scales: no new load
            "model": "litertlm_r4", "lora": [{"name": "torch_r4", "scale": 0.5}], "prompt": prompt,
            "max_tokens": 6, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == offline([("litertlm_r4", 1.0), ("torch_r4", 0.5)])
        deadline = time.monotonic() + 10
        while list(server.replica_values("runtime_replica_adapter_sets").values()) != [1.0]:  # one set, both
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.2)
        assert sum(server.replica_values("runtime_replica_adapter_loads_total").values()) == 1
        _stop(joined)
        assert joined.process.returncode == signal.SIGTERM
        status, body, _ = server.call("/v1/completions", {"model": "demo", "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == offline([]), body
        # /health while its one replica is gone (killed, then replaced): unavailable (it said ok).
        status, body, _ = server.call("/health")
        assert status == 200 and body["status"] == "ok" and body["replicas"] == 1, body
        (pid,) = server.live_replicas().values()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (answer := server.call("/health"))[0] == 200:
            assert time.monotonic() < deadline, "/health said ok with no replica running"
            time.sleep(0.1)
        status, body, _ = answer
        assert status == 503 and body["error"]["code"] == "unavailable", answer
        assert body["error"]["message"].startswith("no replica of the engine is running ("), body
    finally:
        if joined is not None:
            _stop(joined)
        _stop(server)
        engine.close()


# -- affinity --------------------------------------------------------------------


@cluster
def test_after_a_warm_up_each_adapters_requests_stay_on_one_replica(served):
    names = [f"affine{i}" for i in range(3)]
    for name, source in zip(names, ADAPTERS):  # adapters no replica holds yet
        shutil.copy(DEMO / "adapters" / f"{source}.tflite", served.adapters / f"{name}.tflite")
        assert served.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"{name}.tflite"})[0] == 200
    for name in names:  # warm-up: one replica loads each, and tells the router
        served.complete(name, "hello world\n")
    time.sleep(2.0)
    misses = sum(served.replica_values("runtime_replica_adapter_misses_total").values())
    seen = {name: {served.complete(name, prompt)[1] for prompt in PROMPTS * 2} for name in names}
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    assert sum(served.replica_values("runtime_replica_adapter_misses_total").values()) == misses  # no new load
    for name in names:
        assert served.call("/v1/unload_lora_adapter", {"lora_name": name})[0] == 200


# -- one catalogue ---------------------------------------------------------------


@cluster
def test_hot_load_and_unload_reach_every_replica(served, offline):
    shutil.copy(DEMO / "adapters" / "uppercase.tflite", served.adapters / "shout.tflite")
    before = _wait_for_one_catalogue_version(served)
    status, body, _ = served.call("/v1/load_lora_adapter", {"lora_name": "shout", "lora_path": "shout.tflite"})
    assert status == 200, body
    version = _wait_for_one_catalogue_version(served, newer_than=before)
    with ThreadPoolExecutor(6) as pool:  # a burst: both replicas may load it; each answers right
        answers = list(pool.map(lambda prompt: served.complete("shout", prompt), PROMPTS * 2))
    assert all(text == offline(prompt, [("uppercase", 1.0)]) for (text, _), prompt in zip(answers, PROMPTS * 2))
    deadline = time.monotonic() + 10
    while not _holding(served, "shout"):  # the replicas report every half second
        assert time.monotonic() < deadline, "no replica reports holding the adapter it answered with"
        time.sleep(0.2)
    status, body, _ = served.call("/v1/unload_lora_adapter", {"lora_name": "shout"})
    assert status == 200, body
    _wait_for_one_catalogue_version(served, newer_than=version)
    deadline = time.monotonic() + 10
    while _holding(served, "shout"):
        assert time.monotonic() < deadline, "a replica kept the unloaded adapter"
        time.sleep(0.2)
    status, body, _ = served.call("/v1/completions", {"model": "shout", "prompt": "hi\n"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def _wait_for_one_catalogue_version(served, newer_than: float = -1.0, seconds: float = 10) -> float:
    """The catalogue version once every live replica has seen the same one, newer than ``newer_than``."""
    deadline = time.monotonic() + seconds
    while True:
        live = served.live_replicas()
        versions = {value for replica, value in served.replica_values("runtime_replica_catalogue_version").items()
                    if replica in live}
        if len(live) == 2 and len(versions) == 1 and min(versions) > newer_than:
            return versions.pop()
        assert time.monotonic() < deadline, f"replicas at catalogue versions {versions}, live {live}"
        time.sleep(0.2)


def _holding(served, name: str) -> set[str]:
    """The replicas that hold adapter ``name`` now."""
    held = set()
    for line in served.metrics().splitlines():
        if line.startswith("runtime_replica_adapter_held{") and line.endswith(" 1.0"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels["adapter"] == name:
                held.add(labels["replica"])
    return held


@cluster
def test_a_file_changed_after_loading_is_refused_with_409(served):
    shutil.copy(DEMO / "adapters" / "no_vowels.tflite", served.adapters / "quiet.tflite")
    status, body, _ = served.call("/v1/load_lora_adapter", {"lora_name": "quiet", "lora_path": "quiet.tflite"})
    assert status == 200, body
    assert served.complete("quiet", "hello world\n")[0]
    time.sleep(0.01)
    shutil.copy(DEMO / "adapters" / "json.tflite", served.adapters / "quiet.tflite")  # rewritten in place
    for _ in range(4):
        status, body, _ = served.call("/v1/completions", {"model": "quiet", "prompt": "hello world\n"})
        assert status == 409 and "changed" in body["error"]["message"], body
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "quiet"})[0] == 200


@cluster
def test_a_file_rewritten_in_place_with_its_size_and_time_kept_is_refused_with_409(served):
    """A file rewritten in place with its size and modification time kept (cp -p) is caught
    by the ingress's quick check, whose change time moved (the replica's SHA-256 check stays
    behind it, for a rewrite racing that check)."""
    twin = served.adapters / "twin.tflite"
    shutil.copy(DEMO / "adapters" / "uppercase.tflite", twin)
    assert served.call("/v1/load_lora_adapter", {"lora_name": "twin", "lora_path": "twin.tflite"})[0] == 200
    status = twin.stat()
    other = (DEMO / "adapters" / "no_vowels.tflite").read_bytes()
    assert len(other) == status.st_size
    with open(twin, "r+b") as file:  # the same inode, size and modification time, other bytes
        file.write(other)
    os.utime(twin, ns=(status.st_atime_ns, status.st_mtime_ns))
    status, body, _ = served.call("/v1/completions", {"model": "twin", "prompt": "hello world\n"})
    assert status == 409 and "its file changed" in body["error"]["message"], body
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "twin"})[0] == 200


# -- faults ----------------------------------------------------------------------


@cluster
def test_an_adapter_that_makes_non_finite_logits_is_a_4xx_and_marked_unhealthy(served):
    """As in one process (the replica's NonFiniteLogits, no status error, was a 500 'internal')."""
    huge_adapter(DEMO / "adapters" / "json.tflite", served.adapters / "huge.tflite")
    assert served.call("/v1/load_lora_adapter", {"lora_name": "huge", "lora_path": "huge.tflite"})[0] == 200
    try:
        status, body, _ = served.call("/v1/completions", {"model": "huge", "prompt": "hi\n", "max_tokens": 4})
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "non_finite_logits", "model"), body
        card = served.call("/v1/models/huge")[1]
        assert card["healthy"] is False and "non-finite" in card["problem"]
    finally:
        assert served.call("/v1/unload_lora_adapter", {"lora_name": "huge"})[0] == 200


@cluster
def test_a_killed_replica_ends_its_streams_with_an_error_and_is_replaced(served, offline):
    expected = offline("hello world\n", [("json", 1.0)])
    body = {"model": "json", "prompt": "hello world\n", "max_tokens": 230, "ignore_eos": True, "temperature": 0}
    for attempt in range(3):
        before = served.live_replicas()
        assert len(before) == 2, before
        first = threading.Event()
        results: list[object] = []

        def one() -> None:
            try:
                replica, events, last = served.stream(body, timeout=60)
                results.append((replica, events, last))
            except Exception as exc:  # noqa: BLE001 - a broken stream is a failure below
                results.append(exc)
            finally:
                first.set()

        def watch_first() -> str:
            request = urllib.request.Request(served.url + "/v1/completions",
                                             data=json.dumps({**body, "stream": True}).encode())
            request.add_header("Authorization", f"Bearer {KEY}")
            request.add_header("Content-Type", "application/json")
            response = urllib.request.urlopen(request, timeout=60)
            replica = response.headers["x-runtime-replica"]
            os.kill(before[replica], signal.SIGKILL)  # as soon as its first token came
            lines = [raw.decode().strip() for raw in response]
            results.append((replica, [json.loads(line[6:]) for line in lines if line.startswith("data: {")],
                            [line for line in lines if line.startswith("data: ")][-1][6:]))
            return replica

        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(one) for _ in range(6)]
            killed = pool.submit(watch_first).result(timeout=90)
            for stream in streams:
                stream.result(timeout=90)  # never a hang
        broken = [result for result in results if isinstance(result, Exception)]
        assert not broken, broken
        cut = 0
        for replica, events, last in results:
            assert last == "[DONE]", "a stream ended without its end"  # never a silent cut
            errors = [event for event in events if "error" in event]
            if errors:
                cut += 1
                assert errors[0]["error"]["code"] == "unavailable" and replica == killed, errors
            else:
                text = "".join(event["choices"][0]["text"] for event in events if "choices" in event)
                assert text.startswith(expected)
        # New requests are answered at once (by the other replica)...
        assert served.complete("json", "green tea\n")[0] == offline("green tea\n", [("json", 1.0)])
        # ...and Ray Serve starts a new replica, which loads adapters on demand.
        deadline = time.monotonic() + 90
        while len(served.live_replicas()) < 2 or killed in served.live_replicas():
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            time.sleep(0.5)
        if cut:
            break
    assert cut, "no stream was running on the killed replica in three tries"
    for name in ADAPTERS:
        assert served.complete(name, "the cat sat\n")[0] == offline("the cat sat\n", [(name, 1.0)])


@cluster
def test_a_hung_replica_ends_its_streams_after_the_replica_timeout(served, offline):
    """A replica frozen in the middle of a stream (SIGSTOP: as one stuck in a step): the stream
    ends after --replica-timeout with an error event naming the replica and the time-out (it
    waited ~95 s, until Ray Serve's health checks gave the replica up, 3 x 30 s)."""
    body = {"model": "json", "prompt": "hello world\n", "max_tokens": 230, "ignore_eos": True, "temperature": 0,
            "stream": True}
    for _ in range(5):  # the stream may end before the replica is stopped: again
        live = served.live_replicas()
        assert len(live) == 2, live
        request = urllib.request.Request(served.url + "/v1/completions", data=json.dumps(body).encode())
        request.add_header("Authorization", f"Bearer {KEY}")
        request.add_header("Content-Type", "application/json")
        response = urllib.request.urlopen(request, timeout=60)
        replica = response.headers["x-runtime-replica"]
        os.kill(live[replica], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            lines = [raw.decode().strip() for raw in response]
            waited = time.monotonic() - stopped
        finally:
            os.kill(live[replica], signal.SIGCONT)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]", lines[-3:]
        errors = [event["error"] for event in events if "error" in event]
        if errors:
            break
    assert errors, "no stream was running when its replica was stopped, in five tries"
    assert REPLICA_TIMEOUT_S - 0.5 < waited < REPLICA_TIMEOUT_S + 10, waited
    assert errors[0]["code"] == "unavailable", errors
    assert f"replica {replica} sent nothing for {REPLICA_TIMEOUT_S} s (--replica-timeout" in errors[0]["message"]
    # The replica, going on, is answered by as before.
    deadline = time.monotonic() + 30
    while len(served.live_replicas()) < 2:
        assert time.monotonic() < deadline, "the stopped replica did not report again"
        time.sleep(0.2)
    for name in ADAPTERS:
        assert served.complete(name, "green tea\n")[0] == offline("green tea\n", [(name, 1.0)])


@cluster
def test_sigterm_drains_and_leaves_no_process(served):
    """The module's last test: the server stops, and with it the local Ray it started."""
    processes = _descendants(served.process.pid)
    assert len(processes) >= 4, processes  # Ray's GCS and raylet, the controller, the replicas...
    started = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(60) == signal.SIGTERM  # Ray's driver exits with the signal's number, once stopped
    deadline = time.monotonic() + 30
    while left := [pid for pid in processes if _alive(pid)]:
        assert time.monotonic() < deadline, f"processes left: {left}"
        time.sleep(0.2)
    print(f"stopped in {time.monotonic() - started:.1f} s")
