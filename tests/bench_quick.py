"""Run a benchmark driver's --quick mode as a subprocess and load the JSON it wrote.

A subprocess because the drivers pin the OpenMP thread count in their environment
before torch loads."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quick(name: str, out: str, *extra: str) -> dict:
    """`python -m loadtest.<name> --quick --out OUT ...`; returns the one run JSON."""
    proc = subprocess.run([sys.executable, "-m", f"loadtest.{name}", "--quick", *extra,
                           "--out", out], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = glob.glob(os.path.join(out, f"{name}-*.json"))
    assert len(runs) == 1, runs
    with open(runs[0], encoding="utf-8") as f:
        return json.load(f)
