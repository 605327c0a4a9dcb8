"""What the ingress's hop to a replica costs per token: one stream at a time, one process against
``--replicas 1``.

    python3 -m benchmarks.cluster_hop [--model demo] [--streams 10] [--tokens 230]

Starts ``python -m runtime serve`` on the demo model (byte tokens) once as one process and once
with ``--replicas 1`` on a local Ray (the ``cluster`` extra), streams ``--streams`` greedy
completions of ``--tokens`` tokens one after another (``ignore_eos``) from each, and prints the
median time between two streamed tokens and time to first token, and the difference per token.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "runtime" / "demo_assets"


def stream(url: str, tokens: int) -> tuple[float, float]:
    """Seconds per token after the first, and to the first, of one streamed completion."""
    body = {"model": "model", "prompt": "hello world\n", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    times = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            if raw.startswith(b"data: {"):
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1), times[0] - started


def measure(extra: list[str], streams: int, tokens: int) -> tuple[float, float]:
    command = [sys.executable, "-m", "runtime", "serve", "--model", str(DEMO / "model.tflite"), "--byte-tokens",
               "--port", "0", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        url = None
        for line in process.stdout:
            found = re.search(r"http://127\.0\.0\.1:\d+", line)
            if found:
                url = found.group(0)
                break
        if url is None:
            raise SystemExit(f"the server did not start: {' '.join(command)}")
        for _ in range(3):
            stream(url, tokens)  # warm-up
        runs = [stream(url, tokens) for _ in range(streams)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    finally:
        process.send_signal(2)
        process.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=230)
    args = parser.parse_args()
    alone, alone_first = measure([], args.streams, args.tokens)
    hop, hop_first = measure(["--replicas", "1"], args.streams, args.tokens)
    print(f"one process:   {1e3 * alone:.3f} ms a token, first token {1e3 * alone_first:.1f} ms")
    print(f"--replicas 1:  {1e3 * hop:.3f} ms a token, first token {1e3 * hop_first:.1f} ms")
    print(f"the hop: {1e3 * (hop - alone):+.3f} ms a token, {1e3 * (hop_first - alone_first):+.1f} ms to the first "
          f"(median of {args.streams} streams of {args.tokens} tokens, demo model)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
