"""CPU threads of `kvserve serve` (issue 22): how long 4 concurrent requests take against
one, on a quiet machine and beside a process that keeps a core busy, for kvserve's
default and the alternatives it was chosen over.

Each variant is a `kvserve serve` child started as a user would (no thread variables
but the variant's own), warmed up, then timed: one request alone and four at once
(greedy, `--max-tokens`, EOS ignored), the best of `--repeats` each; then the same
beside a `python -c "while True: pass"` child. The best is what the server can do, the
rest is whatever else ran on the machine.

    python -m benchmarks.bench_threads --repeats 7 --out runs/

Writes runs/bench_threads-<timestamp>.json, results/bench_threads.json and the
"## CPU threads (issue 22)" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import httpx

from benchmarks.bench_common import markers, save_json
from benchmarks.bench_threads_report import render
from engine.cpu_threads import ENV_VARS, allowed_cpus, physical_cores
from loadtest.fingerprint import fingerprint
from loadtest.report import update_doc
from loadtest.spawn import Spawned, free_port, kvserve_cmd

NAME = "bench_threads"
HEADING = "## CPU threads (issue 22)"
PROMPTS = ("The os module", "import sys", "def read(path):", "class Path:")
# label -> (kvserve options, environment): the default (kvserve's team polls, OpenMP's
# sleeps), both sleeping at once, the bounded spin, one thread fewer, and OpenMP's own spin
# (what every thread did before issue 22)
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default (--cpu-wait poll)": ((), {}),
    "--cpu-wait passive": (("--cpu-wait", "passive"), {}),
    "--cpu-wait spin (~1.5 ms, then sleep)": (("--cpu-wait", "spin"), {}),
    "--cpu-threads 1": (("--cpu-threads", "1"), {}),
    "OpenMP's default spin (GOMP_SPINCOUNT=300000)": ((), {"GOMP_SPINCOUNT": "300000"}),
}


async def _burst(url: str, n: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def one(prompt: str) -> None:
            r = await c.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(n)))
        return time.perf_counter() - t0


def four_over_one(url: str, repeats: int, max_tokens: int) -> dict[str, Any]:
    asyncio.run(_burst(url, 4, max_tokens))  # warm-up
    one, four = [], []
    for _ in range(repeats):
        one.append(asyncio.run(_burst(url, 1, max_tokens)))
        four.append(asyncio.run(_burst(url, 4, max_tokens)))
    return {"one_s": one, "four_s": four, "one_best_s": min(one), "four_best_s": min(four),
            "ratio": min(four) / min(one)}


def measure(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, (opts, env) in VARIANTS.items():
        port = free_port()
        log = os.path.join(a.out, f"{NAME}-{port}.log")
        cmd = kvserve_cmd(a.model, port, *opts)
        row: dict[str, Any] = {"options": list(opts), "env": env}
        with Spawned(cmd, port, log_path=log, ready_path="/ready", env=env).start() as srv:
            for cond in ("quiet", "busy core"):
                spinner = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           if cond == "busy core" else None)
                try:
                    row[cond] = four_over_one(srv.url, a.repeats, a.max_tokens)
                finally:
                    if spinner:
                        spinner.kill()
                        spinner.wait()
                r = row[cond]
                print(f"{label:36s} {cond:9s} one {r['one_best_s']:.3f} s  four "
                      f"{r['four_best_s']:.3f} s  ratio {r['ratio']:.2f}", flush=True)
        out[label] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="runs/")
    p.add_argument("--doc", default="", help="a markdown file to write the generated table into")
    p.add_argument("--results", default=f"results/{NAME}.json")
    a = p.parse_args(argv)
    if a.model is None:
        from server.cli import DEMO_MODEL

        a.model = str(DEMO_MODEL)
    for k in ENV_VARS:  # the servers start as a user's would: the variant's only
        os.environ.pop(k, None)
    os.makedirs(a.out, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": NAME, "command": "python -m benchmarks.bench_threads " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
        "settings": {"model": a.model, "max_tokens": a.max_tokens, "repeats": a.repeats,
                     "physical_cores": physical_cores(allowed_cpus())}}
    report["variants"] = measure(a)
    report["fingerprint"]["loadavg_at_end"] = os.getloadavg()
    run_path = save_json(report, a.out, NAME, a.results)
    if a.doc:
        update_doc(a.doc, render(report), HEADING, *markers(NAME))
    print(render(report), flush=True)
    print(f"wrote {run_path}, {a.results}, {a.doc}", flush=True)
    return report


if __name__ == "__main__":
    main()
