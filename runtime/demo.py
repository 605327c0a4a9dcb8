"""``python -m runtime.demo``: one small base model, one adapter per skill, all at once.

Loads the bundled byte-level model (``runtime/demo_assets``), registers one adapter per
task (one of them from bytes in memory), and runs one session per adapter plus one on the
base model, concurrently, on the same prompts. Prints what each session answered and,
per adapter, its memory, load time, switch time and decode speed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from runtime.components.tokenizer import ByteTokenizer
from runtime.engine.config import EngineSettings, SessionConfig
from runtime.engine.engine import Engine
from runtime.engine.session import Session
from runtime.framework.lora_source import LoraSource

ASSETS = Path(str(resources.files("runtime") / "demo_assets"))
NEWLINE = 10


@dataclass
class Lane:
    """One session of the demo: its name, its adapter and what it produced."""

    name: str
    source: LoraSource | None
    lora_id: int | None = None
    load_ms: float = 0.0
    session: Session | None = None
    answers: list[str] = field(default_factory=list)


def load_demo(assets: Path = ASSETS) -> dict:
    """The demo's description: tasks, adapters, prompts and measured accuracy."""
    return json.loads((assets / "demo.json").read_text())


def build_lanes(demo: dict, assets: Path, in_memory: str) -> list[Lane]:
    """The base lane and one lane per task; the task ``in_memory`` gets its adapter as bytes."""
    lanes = [Lane("base model", None)]
    for task in demo["tasks"]:
        path = assets / task["adapter"]
        if task["name"] == in_memory:
            lanes.append(Lane(f"{task['name']} (from memory)", LoraSource(buffer=path.read_bytes())))
        else:
            lanes.append(Lane(task["name"], LoraSource(path=path)))
    return lanes


def run_lane(lane: Lane, prompts: list[str], max_new_tokens: int) -> None:
    """Answers every prompt in this lane's session."""
    for prompt in prompts:
        lane.session.reset()
        result = lane.session.generate(prompt + "\n", max_new_tokens=max_new_tokens, stop_tokens=[NEWLINE])
        lane.answers.append(result.text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=ASSETS, help="folder with demo.json, the model and adapters")
    parser.add_argument("--prompt", action="append", help="a line to give every session (repeatable)")
    args = parser.parse_args(argv)
    demo = load_demo(args.assets)
    prompts = args.prompt or demo["prompts"]
    max_new_tokens = int(demo.get("max_new_tokens", 64))
    started = time.perf_counter()
    with Engine(args.assets / demo["model"], EngineSettings(num_threads=1),
                tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE])) as engine:
        model_ms = (time.perf_counter() - started) * 1e3
        lanes = build_lanes(demo, args.assets, in_memory=demo["tasks"][-1]["name"])
        for lane in lanes:
            if lane.source is not None:
                began = time.perf_counter()
                lane.lora_id = engine.register_adapter(lane.source)
                lane.load_ms = (time.perf_counter() - began) * 1e3
            lane.session = engine.create_session(SessionConfig(loras=[lane.source] if lane.source else []))
        threads = [threading.Thread(target=run_lane, args=(lane, prompts, max_new_tokens)) for lane in lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = engine.stats()
        print(f"Base model {demo['model']} loaded once in {model_ms:.0f} ms; {len(lanes)} sessions ran "
              f"concurrently on the same {len(prompts)} prompts.\n")
        for index, prompt in enumerate(prompts):
            print(f"prompt: {prompt!r}")
            for lane in lanes:
                print(f"  {lane.name:<24} -> {lane.answers[index]!r}")
            print()
        print_costs(lanes, stats)
        for lane in lanes:
            lane.session.close()
    return 0


def print_costs(lanes: list[Lane], stats) -> None:
    """Per lane: adapter memory, load time, decode speed; then the engine's switch latency."""
    by_session = {s.session_id: s for s in stats.sessions}
    resident = {a.lora_id: a for a in stats.adapters}
    print(f"{'session':<24} {'adapter RAM':>12} {'load':>9} {'tokens/s':>10}")
    for lane in lanes:
        session = by_session[lane.session.session_id]
        adapter = resident.get(lane.lora_id)
        ram = f"{adapter.resident_bytes / 1024:.0f} KiB" if adapter else "-"
        load = f"{lane.load_ms:.2f} ms" if lane.source else "-"
        print(f"{lane.name:<24} {ram:>12} {load:>9} {session.decode_tokens_per_s:>10,.0f}")
    print(f"\nswitches between sessions/adapters: {stats.switch.count}, p50 {stats.switch.p50_ms * 1e3:.0f} us, "
          f"p99 {stats.switch.p99_ms * 1e3:.0f} us (runtime work per switch; no weights are copied)")
    print(f"adapter buffers resident: {stats.resident_bytes / 1024:.0f} KiB in {len(stats.resident)} slot set(s); "
          f"materialize p50 {stats.materialize.p50_ms:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
