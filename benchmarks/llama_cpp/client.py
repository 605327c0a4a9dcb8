"""llama.cpp as ``benchmarks/run.py`` sees it: child processes of its own virtualenv.

``LlamaCpp`` keeps one ``bench_llama_cpp.py --serve SET`` child and asks it for one
measurement at a time, so that run.py can alternate: our measurement, then theirs, round
by round. Fresh-process probes (load cost, RSS per adapter) and the standalone run (the
same-weights check and llama.cpp's own extras) are single calls.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PYTHON = HERE / ".venv" / "bin" / "python"
SCRIPT = HERE / "bench_llama_cpp.py"


def available() -> bool:
    """Whether ``setup.sh`` has made the llama.cpp virtualenv."""
    return PYTHON.exists()


def _json_output(args: list[str], timeout: float) -> dict[str, Any]:
    done = subprocess.run([str(PYTHON), str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"bench_llama_cpp.py {' '.join(args[:2])} exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def standalone(out: Path) -> dict[str, Any]:
    """The full standalone run on the bench model (same-weights check, switch, RSS...)."""
    return _json_output(["--out", str(out)], timeout=3600)


def load_probe(model: Path, n_ctx: int, threads: int) -> dict[str, Any]:
    """Load time, first step and peak RSS of ``model`` in a fresh process."""
    return _json_output(["--load-probe", str(model), str(n_ctx), str(threads)], timeout=600)


def rss_per_adapter(model: Path, adapter: Path, copies: int) -> dict[str, Any]:
    """RSS growth per loaded copy of ``adapter``, in a fresh process."""
    return _json_output(["--rss-probe", str(model), str(adapter), str(copies)], timeout=600)


class LlamaCpp:
    """A ``--serve`` child for one model set; ``request(op, **fields)`` returns its reply."""

    def __init__(self, model_set: str) -> None:
        self._stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty child cannot block on it
        self._child = subprocess.Popen([str(PYTHON), str(SCRIPT), "--serve", model_set], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.hello = self._reply()

    def _reply(self) -> dict[str, Any]:
        while line := self._child.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        self._stderr.seek(0)
        raise RuntimeError(f"the llama.cpp child stopped: {self._stderr.read()[-1500:]}")

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        self._child.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self._child.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"llama.cpp {op} {fields}: {reply['error']}")
        return reply

    def close(self) -> None:
        self._child.stdin.close()
        self._child.wait(timeout=120)
        self._stderr.close()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
