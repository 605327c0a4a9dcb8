"""A short run of tools/fuzz.py (the full campaign is 100,000 cases): mutated .tflite,
PEFT and GGUF adapters and model files loaded in worker processes give no crash, hang or
non-StatusError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast suite: python3 -m pytest -m 'not slow'

TOOL = Path(__file__).resolve().parent.parent / "tools" / "fuzz.py"


def test_short_fuzz_campaign(tmp_path):
    done = subprocess.run(
        [sys.executable, str(TOOL), "--cases", "2000", "--seed", "11", "--out", str(tmp_path / "findings")],
        capture_output=True, text=True, timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "crashes 0, hangs 0, non-StatusError exceptions 0" in summary
    assert "'ok'" in summary and "InvalidArgumentError" in summary  # valid and invalid cases both ran
