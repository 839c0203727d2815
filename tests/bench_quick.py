"""Run a benchmark driver's --quick mode and load the JSON it wrote: in this process
(`run_quick`) or as a subprocess (`run_quick(..., process=True)`).

In this process by default: a subprocess costs ~6-10 s of imports (torch, transformers, the
drivers' own) that the test worker has already paid, and a driver given its argv never
re-executes itself (`bench_common.pin_threads`). It starts with the environment a driver
pins for --quick's one thread, as a subprocess would, and everything the driver sets for
the whole process (torch's thread count, OpenMP's variables, the CPU affinity) is put
back after it: a module-scoped fixture runs before conftest's per-test guard takes its
snapshot. A subprocess where the thread setting must reach threads torch does not own
(bench_offline's HF continuous batching, whose OpenMP threads read the environment once,
when torch loads) or where the driver serves over HTTP (`loadtest.bench_serving`).
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys

import torch

from engine import cpu_threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quick(module: str, out: str, *extra: str, wait: str | None = "passive",
              process: bool = False) -> dict:
    """`python -m <module> --quick --out OUT ...` (`benchmarks.bench_offline`,
    `loadtest.bench_serving`); returns the one run JSON.
    `wait`: the driver's default wait (`pin_threads`' default_wait; spin for the offline
    drivers), None for one that pins nothing (its children start as a user's would; a
    subprocess). `process`: run it as a subprocess (see the module docstring)."""
    env = {} if wait is None else cpu_threads.environment(
        cpu_threads.plan(1, None, default_wait=wait))
    argv = ["--quick", *extra, "--out", out]
    if process or wait is None:
        proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO,
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        _in_process(module, argv, env)
    name = module.rpartition(".")[2]
    runs = glob.glob(os.path.join(out, f"{name}-*.json"))
    assert len(runs) == 1, runs
    with open(runs[0], encoding="utf-8") as f:
        return json.load(f)


def _in_process(module: str, argv: list[str], env: dict[str, str]) -> None:
    """`module.main(argv)` here, the thread settings as they were afterwards."""
    saved = {k: os.environ.get(k) for k in {*env, *cpu_threads.ENV_VARS}}
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0)
    os.environ.update(env)
    try:
        importlib.import_module(module).main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)
        if os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
