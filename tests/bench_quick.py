"""Run a benchmark driver's --quick mode as a subprocess and load the JSON it wrote.

A subprocess because the drivers pin the OpenMP thread count in their environment
before torch loads. The child starts with the environment a driver pins for --quick's one
thread (`bench_common.pin_threads`), so it runs at once instead of importing
torch, finding the variables unset and re-executing itself (~4 s of imports a run);
a driver that wants another setting still re-executes."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from engine import cpu_threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quick(module: str, out: str, *extra: str, wait: str | None = "passive") -> dict:
    """`python -m <module> --quick --out OUT ...` (`benchmarks.bench_offline`,
    `loadtest.bench_serving`); returns the one run JSON.
    `wait`: the driver's default wait (`pin_threads`' default_wait; spin for the offline
    drivers), None for one that pins nothing (its children start as a user's would)."""
    env = dict(os.environ)
    if wait is not None:
        env.update(cpu_threads.environment(cpu_threads.plan(1, None, default_wait=wait)))
    name = module.rpartition(".")[2]
    proc = subprocess.run([sys.executable, "-m", module, "--quick", *extra,
                           "--out", out], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = glob.glob(os.path.join(out, f"{name}-*.json"))
    assert len(runs) == 1, runs
    with open(runs[0], encoding="utf-8") as f:
        return json.load(f)
