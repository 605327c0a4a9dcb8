#!/usr/bin/env python3
"""The ``openai`` client against ``python -m runtime serve``: adapters by name, a blend,
streaming, and an adapter hot-loaded from a URL with its SHA-256.

What it shows: an OpenAI-compatible server where the adapter is chosen per request.
Without ``--base-url`` it starts ``python -m runtime serve`` itself on a free loopback port
(the demo model, byte tokens, the ``uppercase`` and ``json`` adapters copied into a
temporary adapters folder, downloads allowed from 127.0.0.1 only) and stops it at the end.
Then, with the ``openai`` client (``pip install -e '.[test]'``, or ``pip install openai``
beside the ``serve`` extra):

1. ``GET /v1/models``: the base model and the adapters;
2. a greedy completion per adapter, the adapter named as the ``model``;
3. a blend: ``lora: [{"name", "scale"}]`` (the server's extension) beside the ``model``'s
   adapter; the demo model has rank-8 slots only, so a blend of two rank-8 adapters is
   refused there (400 ``no_lora_slot``, printed) and the script sends the one adapter at
   scale 0.5 through the same ``lora`` field instead; models with larger slots blend;
4. a streamed completion, printed token by token as the server-sent events arrive;
5. ``POST /v1/load_lora_adapter`` with a ``url`` (a local HTTP server on 127.0.0.1 serving
   the demo's ``no_vowels`` adapter) and its ``sha256``: a wrong digest is refused, the right
   one loads it, a request uses it by name, ``/v1/unload_lora_adapter`` unloads it.

From the repository root after ``pip install -e '.[test]'``::

    python examples/serve_client.py
    python examples/serve_client.py --prompt "good morning"

Against a server you started yourself, e.g. SmolLM2-135M with its trained task adapters
(``tools/build_smollm2.py --batched``, ``tools/train_smollm2_adapters.py train``; the adapters
folder must be writable for the hot-load, and ``--allow-download-from 127.0.0.1`` lets it
fetch from this script's local server)::

    C=~/.cache/runtime; M=$C/models/smollm2-135m-instruct-batch/smollm2-135m-instruct-int8-batch.tflite
    mkdir -p adapters && cp -r $C/adapters/smollm2/{order_json,intent} adapters/
    python -m runtime convert $C/adapters/smollm2/reverse_words --model $M --out reverse_words.tflite
    python -m runtime serve --model $M --tokenizer $C/models/smollm2-135m-instruct-hf/tokenizer.json \\
        --chat-template $C/models/smollm2-135m-instruct-hf/chat_template.jinja --adapters adapters \\
        --allow-download-from 127.0.0.1 --port 8000 &
    python examples/serve_client.py --base-url http://127.0.0.1:8000/v1 --hot-load reverse_words.tflite \\
        --prompt "Reverse the order of these words: apple river stone"

(``--hot-load`` serves one file: a ``.tflite`` or ``.gguf`` LoRA, as ``/v1/load_lora_adapter``'s
``url`` takes.)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import re
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
from local_server import runtime_serve
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runtime" / "demo_assets"


@contextmanager
def demo_server(folder: Path):
    """``python -m runtime serve`` on the demo model, the ``uppercase`` and ``json`` adapters
    copied into ``folder/adapters``; yields its base URL and stops it at the end."""
    adapters = folder / "adapters"
    adapters.mkdir()
    for name in ("uppercase", "json"):
        shutil.copyfile(DEMO / "adapters" / f"{name}.tflite", adapters / f"{name}.tflite")
    with runtime_serve("--model", str(DEMO / "model.tflite"), "--byte-tokens", "--stop-token", "10",
                       "--adapters", str(adapters), "--allow-download-from", "127.0.0.1") as url:
        yield url


@contextmanager
def file_server(path: Path):
    """``path``'s folder over HTTP on 127.0.0.1 (a free port); yields the file's URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=path.parent))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{path.name}"
    finally:
        server.shutdown()
        server.server_close()


def ask(client: OpenAI, chat: bool, model: str, text: str, max_tokens: int, **extra) -> str:
    """One greedy answer to ``text``: a chat message where the server has a chat template,
    else a completion of the line (the demo's format: the text and a newline)."""
    if chat:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                              max_tokens=max_tokens, temperature=0, **extra).choices[0].message.content
    return client.completions.create(model=model, prompt=text + "\n", max_tokens=max_tokens, temperature=0,
                                     **extra).choices[0].text


def stream(client: OpenAI, chat: bool, model: str, text: str, max_tokens: int):
    """The pieces of a streamed greedy answer, as they arrive."""
    if chat:
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                    max_tokens=max_tokens, temperature=0, stream=True):
            yield chunk.choices[0].delta.content or ""
    else:
        for chunk in client.completions.create(model=model, prompt=text + "\n", max_tokens=max_tokens,
                                               temperature=0, stream=True):
            yield chunk.choices[0].text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base-url", help="a running server's http://HOST:PORT/v1 (default: start one on the "
                        "demo model)")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--prompt", default="hello world", help="the user's text (a chat message where the "
                        "server has a chat template, else a line)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--hot-load", type=Path, default=DEMO / "adapters" / "no_vowels.tflite",
                        help="the adapter file served for the hot-load")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: expected 1 or more")
    if not args.hot_load.is_file():  # checked before the server is asked anything: it is served at step 5
        parser.error(f"--hot-load {args.hot_load}: no such file")
    prompt = args.prompt.rstrip("\n")

    with ExitStack() as stack:
        base_url = args.base_url or stack.enter_context(demo_server(Path(stack.enter_context(
            tempfile.TemporaryDirectory()))))
        client = OpenAI(base_url=base_url, api_key=args.api_key)

        models = client.models.list().data
        base = models[0].id
        adapters = [m.id for m in models[1:]]
        chat = bool(models[0].model_extra.get("chat_template"))
        if not adapters:
            raise SystemExit(f"error: the server at {base_url} serves no adapter; start it with --adapters")
        print(f"1. models: base {base!r} ({'chat template' if chat else 'no chat template: completions'}), "
              f"adapters {adapters}")

        print("2. adapters by name (greedy):")
        for name in adapters[:2]:
            print(f"   model={name!r:<12} {prompt!r} -> {ask(client, chat, name, prompt, args.max_tokens)!r}")

        first, other = adapters[0], adapters[1 % len(adapters)]
        blend = [{"name": other, "scale": 0.5}]
        try:
            text = ask(client, chat, first, prompt, args.max_tokens, extra_body={"lora": blend})
            print(f"3. blend {first} 1.0 + {other} 0.5 -> {text!r}")
        except openai.BadRequestError as exc:
            print(f"3. blend {first} 1.0 + {other} 0.5 refused by the server: {exc.body['message']}")
            text = ask(client, chat, base, prompt, args.max_tokens, extra_body={"lora": [{"name": first, "scale": 0.5}]})
            print(f"   instead lora=[{{'name': {first!r}, 'scale': 0.5}}] on the base -> {text!r}")

        print(f"4. streaming (model={first!r}): ", end="", flush=True)
        chunks = 0
        for piece in stream(client, chat, first, prompt, args.max_tokens):
            print(piece, end="|", flush=True)
            chunks += 1
        print(f"\n   ({chunks} chunks)")

        name = "hot_" + re.sub(r"\W", "_", args.hot_load.stem)
        digest = hashlib.sha256(args.hot_load.read_bytes()).hexdigest()
        with file_server(args.hot_load) as url:
            try:
                client.post("/load_lora_adapter", cast_to=object,
                            body={"lora_name": name, "url": url, "sha256": hashlib.sha256(b"x").hexdigest()})
                print("5. hot-load with a wrong sha256: ACCEPTED (unexpected)")
            except openai.APIStatusError as exc:
                print(f"5. hot-load with a wrong sha256: refused, {exc.status_code} {exc.body['code']}: "
                      f"{exc.body['message'][:100]}")
            began = time.perf_counter()
            loaded = client.post("/load_lora_adapter", cast_to=object,
                                 body={"lora_name": name, "url": url, "sha256": digest})
            print(f"   hot-load of {url} with sha256 {digest[:16]}...: {loaded} in "
                  f"{(time.perf_counter() - began) * 1e3:.0f} ms")
        print(f"   model={name!r} {prompt!r} -> {ask(client, chat, name, prompt, args.max_tokens)!r}")
        unloaded = client.post("/unload_lora_adapter", cast_to=object, body={"lora_name": name})
        print(f"   unloaded: {unloaded}; adapters now {[m.id for m in client.models.list().data[1:]]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except openai.APIConnectionError as exc:  # a wrong --base-url, or the server went away
        sys.exit(f"error: cannot reach the server at {exc.request.url}: {exc}")
    except OSError as exc:  # a file that cannot be read
        sys.exit(f"error: {exc}")
