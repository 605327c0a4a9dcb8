"""``python -m runtime.demo``: one small base model, one adapter per skill, all at once.

Loads the bundled byte-level model (``runtime/demo_assets``), registers one adapter per
task (one of them from bytes in memory), and runs one session per adapter plus one on the
base model, concurrently, on the same prompts. Prints what each session answered and,
per adapter, its memory, load time, switch time and decode speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    """The base lane, one lane per task (the task ``in_memory`` gets its adapter as bytes),
    and one per extra adapter file (the same skill in another file convention)."""
    lanes = [Lane("base model", None)]
    for task in demo["tasks"]:
        path = assets / task["adapter"]
        if task["name"] == in_memory:
            lanes.append(Lane(f"{task['name']} (from memory)", LoraSource(buffer=path.read_bytes())))
        else:
            lanes.append(Lane(task["name"], LoraSource(path=path)))
    task_files = {task["adapter"] for task in demo["tasks"]}
    for entry in demo.get("adapters", {}).values():
        if entry["file"] not in task_files:
            label = f"{entry['task']} ({entry['convention']}, {entry['dtype']})"
            lanes.append(Lane(label, LoraSource(path=assets / entry["file"])))
    return lanes


def run_lane(lane: Lane, prompts: list[str], max_new_tokens: int) -> None:
    """Answers every prompt (one line each) in this lane's session."""
    for prompt in prompts:
        lane.session.reset()
        result = lane.session.generate(prompt.rstrip("\n") + "\n", max_new_tokens=max_new_tokens,
                                       stop_tokens=[NEWLINE])
        lane.answers.append(result.text)


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m runtime.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=ASSETS, help="folder with demo.json, the model and adapters")
    parser.add_argument("--prompt", action="append",
                        help="a line of lowercase words to give every session (repeatable); the model "
                        "was trained on letters a-z and spaces, up to 60 characters")
    args = parser.parse_args(argv)
    demo = load_demo(args.assets)
    prompts = [p.rstrip("\n") for p in (args.prompt or demo["demo_prompts"])]
    max_new_tokens = int(demo["max_new_tokens"])
    started = time.perf_counter()
    with Engine(args.assets / demo["model"]["file"], EngineSettings(num_threads=1),
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
        model_bytes = (args.assets / demo["model"]["file"]).stat().st_size
        print(f"Base model {demo['model']['file']} ({demo['model']['parameters']:,} parameters) loaded once in "
              f"{model_ms:.0f} ms; {len(lanes)} sessions ran "
              f"concurrently on the same {len(prompts)} prompts.\n")
        for index, prompt in enumerate(prompts):
            print(f"prompt: {prompt!r}")
            for lane in lanes:
                print(f"  {lane.name:<32} -> {lane.answers[index]!r}")
            print()
        print_costs(lanes, stats, model_bytes)
        for lane in lanes:
            lane.session.close()
    return 0


def step_seconds(sessions: list[Session], steps: int = 48) -> float:
    """Seconds per decode step with ``sessions`` taking turns on the executor."""
    for session in sessions:
        session.reset()
        session.run_decode(NEWLINE)
    started = time.perf_counter()
    for _ in range(steps):
        for session in sessions:
            session.run_decode(NEWLINE)
    return (time.perf_counter() - started) / (steps * len(sessions))


@dataclass
class LaneCost:
    """What one lane's decode costs, each figure the median over the measuring rounds."""

    tokens_per_s: float
    times_base: float  # its step over the base model's step in the same round
    switch_s: float  # extra per step when alternating with another lane's adapter


def measure_costs(lanes: list[Lane], rounds: int = 7) -> list[LaneCost]:
    """Every lane timed alone and alternating with another lane (a switch of session and
    adapter: a bind, no copy), in each of ``rounds`` rounds; medians, so drift of the
    machine's speed between lanes cancels out."""
    alone: list[list[float]] = [[] for _ in lanes]
    ratio: list[list[float]] = [[] for _ in lanes]
    switch: list[list[float]] = [[] for _ in lanes]
    for _ in range(rounds):
        times = [step_seconds([lane.session]) for lane in lanes]
        for index, lane in enumerate(lanes):
            other = 0 if index else len(lanes) - 1
            alternating = step_seconds([lane.session, lanes[other].session])
            alone[index].append(times[index])
            ratio[index].append(times[index] / times[0])
            switch[index].append(max(0.0, alternating - (times[index] + times[other]) / 2))
    return [LaneCost(1 / statistics.median(a), statistics.median(r), statistics.median(w))
            for a, r, w in zip(alone, ratio, switch)]


def print_costs(lanes: list[Lane], stats, model_bytes: int) -> None:
    """Per lane: adapter memory, load time, decode speed alone; then switch costs."""
    resident = {a.lora_id: a for a in stats.adapters}
    print(f"{'session':<32} {'adapter RAM':>12} {'load':>9} {'tokens/s alone':>15} {'time x base':>12} "
          f"{'switch':>9}")
    for lane, cost in zip(lanes, measure_costs(lanes)):
        adapter = resident.get(lane.lora_id)
        ram = f"{adapter.resident_bytes / 1024:.0f} KiB" if adapter else "-"
        load = f"{lane.load_ms:.2f} ms" if lane.source else "-"
        print(f"{lane.name:<32} {ram:>12} {load:>9} {cost.tokens_per_s:>15,.0f} {cost.times_base:>12.2f} "
              f"{cost.switch_s * 1e6:>6.0f} us")
    print(f"\nthe base model: {model_bytes / 1e6:.1f} MB, loaded once; each adapter adds only its buffers.")
    print("switch: what a decode step costs more when the executor alternates between this session and "
          "another one with another adapter (a bind: no weights or KV cache copied). The first use of an "
          f"adapter also builds its buffers: p50 {stats.materialize.p50_ms:.2f} ms.")


if __name__ == "__main__":
    raise SystemExit(main())
