#!/usr/bin/env python3
"""An on-device translator: one base model, an adapter per language pair, one of them
downloaded after start and hot-loaded with a SHA-256 pin, swapped, the unused one unloaded.

What it shows, step by step, all through the engine's public API:

1. the base model is loaded once with the pairs shipped with the app (``--pair``);
2. a pair is "downloaded" from a local HTTP server (127.0.0.1 only, a stand-in for your
   CDN) and registered from memory with ``LoraSource(buffer=..., sha256=PIN)``: a wrong pin
   is refused (``DataLossError``, nothing registered), the right one is accepted;
3. the session swaps to the new pair (``set_adapters(..., reset=True)``: no base reload)
   and back, timed cold (first use: the adapter's buffers are built) and warm;
4. the pair no longer wanted is unloaded (``engine.unload_adapter``) so memory stays flat;
5. ``engine.stats()``: each adapter's bytes, the resident buffers, switch and materialize
   latency; then a residency policy is picked from those numbers by the rule printed at the
   end (``OnlyActive`` if rebuilding a pair's buffers costs under 5% of translating a line,
   else ``KeepAll`` if every pair's buffers fit ``--budget-kib``, else ``Lru`` within it).

On the bundled demo model (the default) the "languages" are the demo's skills: English ->
capitals (``uppercase``, shipped) and English -> no vowels (``no_vowels``, downloaded).
From the repository root after ``pip install -e .``::

    python examples/translator.py
    python examples/translator.py --line "good morning" --line "zebra crossing"

On Gemma 3 270M (the export and tokenizer that ``benchmarks/gemma3.py``'s set-up makes in
``D=~/.cache/runtime/models/gemma3-270m``) with rank-8 translation adapters of your own, one
per pair (PEFT directories' safetensors, ``.gguf`` or ``.tflite`` LoRA files)::

    python examples/translator.py --model $D/gemma3-270m-int8.tflite --tokenizer $D/hf/tokenizer.json \\
        --chat-template $D/hf/chat_template.jinja --max-tokens 64 \\
        --pair en-fr=en_fr.gguf --download en-de=en_de.gguf --line "Where is the station?"

(the downloaded pair must be one file: a ``.tflite`` or ``.gguf`` LoRA; ``runtime serve``'s
``/v1/load_lora_adapter`` does the same over HTTP with a ``url`` and ``sha256``, see
``examples/serve_client.py``.)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from runtime import (ByteTokenizer, ChatTemplate, DataLossError, Engine, EngineSettings, KeepAll, LoraSource, Lru,
                     OnlyActive, SessionConfig)
from runtime.errors import StatusError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runtime" / "demo_assets"
NEWLINE = 10
COLD_SHARE = 0.05  # OnlyActive when a cold switch costs at most this share of a line's translation


@contextmanager
def local_download_server(files: dict[str, Path]):
    """An HTTP server on 127.0.0.1 (a free port) serving ``files`` by name: the stand-in for
    the app's download site. Yields its base URL."""
    with tempfile.TemporaryDirectory() as folder:
        for name, path in files.items():
            shutil.copyfile(path, Path(folder) / name)

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no access log on stderr
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=folder))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


def pairs(values: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` options as a dict (each name once: a pair is known by it)."""
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name:
            raise SystemExit(f"error: {value!r}: expected NAME=PATH")
        if name in out:
            raise SystemExit(f"error: --pair {name}: given twice")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", type=Path, default=DEMO / "model.tflite")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json or SentencePiece model (default: the "
                        "bundle's; byte tokens for a .tflite, as the demo model)")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template (default: the bundle's, else the "
                        "demo's line format)")
    parser.add_argument("--pair", action="append", help="NAME=PATH: a pair shipped with the app (repeatable)")
    parser.add_argument("--download", help="NAME=PATH: the pair served by the local HTTP server")
    parser.add_argument("--line", action="append", help="a line to translate (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--budget-kib", type=float, default=1024.0,
                        help="memory for adapter buffers the residency rule may use (KiB)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: expected 1 or more")
    if not 0 <= args.budget_kib < 1 << 40:  # NaN and infinity too
        parser.error(f"--budget-kib {args.budget_kib}: expected a number of KiB >= 0")
    shipped = pairs(args.pair or [f"en-upper={DEMO / 'adapters' / 'uppercase.tflite'}"])
    (new_name, new_path), = pairs([args.download or f"en-novowel={DEMO / 'adapters' / 'no_vowels.tflite'}"]).items()
    if new_name in shipped:  # the download would take the shipped pair's name, and its unload the new one
        parser.error(f"--download {new_name}: a --pair has that name")
    lines = args.line or ["hello world", "good morning"]

    started = time.perf_counter()
    tokenizer = args.tokenizer
    if tokenizer is None and args.model.suffix == ".tflite":  # no bundle: byte tokens (the demo model)
        tokenizer = ByteTokenizer(stop_token_ids=[NEWLINE])
    with Engine(args.model, EngineSettings(num_threads=args.threads), tokenizer=tokenizer) as engine:
        if engine.tokenizer is None:
            raise SystemExit(f"error: {args.model} has no tokenizer: give --tokenizer")
        template = ChatTemplate(args.chat_template.read_text()) if args.chat_template else engine.chat_template

        def prompt(line: str) -> list[int]:
            if template is None:
                return engine.tokenizer.encode(line + "\n")
            return engine.tokenizer.encode(template.render([{"role": "user", "content": line}]))

        ids = {name: engine.register_adapter(LoraSource(path=path)) for name, path in shipped.items()}
        print(f"1. base model {args.model.name} and {len(ids)} shipped pair(s) loaded in "
              f"{time.perf_counter() - started:.2f} s: {', '.join(ids)}")
        first = next(iter(ids))
        session = engine.create_session(SessionConfig(adapters={ids[first]: 1.0}))

        def translate(pair: str) -> tuple[list[str], float]:
            """Every line through the session (now on ``pair``); the answers and seconds per line."""
            answers, began = [], time.perf_counter()
            for line in lines:
                session.reset()
                answers.append(session.generate(prompt(line), max_new_tokens=args.max_tokens).text.strip())
            seconds = (time.perf_counter() - began) / len(lines)
            for line, answer in zip(lines, answers):
                print(f"   [{pair}] {line!r} -> {answer!r}")
            return answers, seconds

        translate(first)

        # 2. The download, pinned: the pin ships with the app (here: computed from the file).
        pin = hashlib.sha256(new_path.read_bytes()).hexdigest()
        with local_download_server({new_path.name: new_path}) as base_url:
            url = f"{base_url}/{new_path.name}"
            began = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as response:
                data = response.read()
            download_ms = (time.perf_counter() - began) * 1e3
        print(f"2. downloaded {new_name} from {url}: {len(data):,} bytes in {download_ms:.1f} ms")
        wrong = hashlib.sha256(b"another file").hexdigest()
        try:
            engine.register_adapter(LoraSource(buffer=data, sha256=wrong))
            print("   hot-load with a wrong sha256 pin: ACCEPTED (unexpected)")
        except DataLossError as exc:
            print(f"   hot-load with a wrong sha256 pin: refused ({type(exc).__name__}: {str(exc)[:90]}...)")
        began = time.perf_counter()
        ids[new_name] = engine.register_adapter(LoraSource(buffer=data, sha256=pin))
        print(f"   hot-load with the right sha256 pin {pin[:16]}...: accepted as adapter {ids[new_name]} "
              f"in {(time.perf_counter() - began) * 1e3:.2f} ms")

        # 3. Swap: cold (first use builds the buffers), then back and forth warm.
        began = time.perf_counter()
        session.set_adapters(adapters={ids[new_name]: 1.0}, reset=True)
        cold_swap_ms = (time.perf_counter() - began) * 1e3
        _, line_s = translate(new_name)
        warm = []
        for pair in (first, new_name) * 3:
            began = time.perf_counter()
            session.set_adapters(adapters={ids[pair]: 1.0}, reset=True)
            session.run_prefill(prompt(lines[0]))
            warm.append(time.perf_counter() - began)
        print(f"3. swapped to {new_name} with no base reload: set_adapters {cold_swap_ms:.2f} ms; swap + prefill "
              f"of a line, warm, median {sorted(warm)[len(warm) // 2] * 1e3:.2f} ms")
        before = engine.stats()

        # 4. Unload the pair no longer wanted (no live session may use it).
        engine.unload_adapter(ids.pop(first))
        session.reset()
        after = engine.stats()
        print(f"4. unloaded {first}: resident adapter buffers {before.resident_bytes / 1024:.0f} KiB -> "
              f"{after.resident_bytes / 1024:.0f} KiB, registered adapters {len(before.adapters)} -> "
              f"{len(after.adapters)}")

        # 5. The numbers, and the residency policy they call for.
        print("5. engine.stats():")
        for adapter in after.adapters:
            name = next(n for n, i in ids.items() if i == adapter.lora_id)
            print(f"   {name:<12} rank {adapter.rank}, {adapter.format}, tensors {adapter.tensor_bytes / 1024:.0f} KiB, "
                  f"resident buffers {adapter.resident_bytes / 1024:.0f} KiB, sessions {adapter.sessions}")
        per_pair = max((r.nbytes for r in before.resident), default=0)
        cold_ms, warm_ms = before.materialize.p50_ms, before.switch.p50_ms
        print(f"   switch p50 {warm_ms:.3f} ms / p99 {before.switch.p99_ms:.3f} ms ({before.switch.count}); "
              f"materialize (cold switch) p50 {cold_ms:.3f} ms / p99 {before.materialize.p99_ms:.3f} ms "
              f"({before.materialize.count}); register p50 {before.load.p50_ms:.2f} ms; "
              f"a line's translation {line_s * 1e3:.1f} ms")
        pair_count = len(shipped) + 1
        budget = int(args.budget_kib * 1024)
        if cold_ms <= COLD_SHARE * line_s * 1e3:
            policy, why = OnlyActive(), (f"a cold switch ({cold_ms:.3f} ms) costs <= {COLD_SHARE:.0%} of a line "
                                         f"({line_s * 1e3:.1f} ms): keep only the pair in use")
        elif pair_count * per_pair <= budget:
            policy, why = KeepAll(), (f"all {pair_count} pairs' buffers ({pair_count * per_pair / 1024:.0f} KiB) "
                                      f"fit the budget ({args.budget_kib:.0f} KiB): keep them, every switch warm")
        else:
            policy, why = Lru(max_resident=None, max_bytes=budget), (
                f"{pair_count} pairs need {pair_count * per_pair / 1024:.0f} KiB, over the budget: keep the "
                f"most recently used within {args.budget_kib:.0f} KiB")
        engine.set_residency(policy)
        print(f"   rule: OnlyActive if a cold switch <= {COLD_SHARE:.0%} of a line's translation, else KeepAll if "
              f"every pair's buffers ({per_pair / 1024:.0f} KiB each) fit --budget-kib, else Lru(max_bytes=budget)")
        print(f"   residency policy: {type(policy).__name__} ({why})")
        session.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (StatusError, OSError) as exc:  # a user's mistake (a missing model, adapter or file): one line
        sys.exit(f"error: {exc}")
