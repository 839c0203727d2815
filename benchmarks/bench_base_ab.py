"""A policy's decode step now against a base commit, the engines stepped in turn.

    python -m benchmarks.bench_base_ab --base 8d48c3e~1 --policies knorm,keydiff,h2o,tova,pyramid

Why: issue 65 asks that a per-head policy's share of the step be no higher than the
per-layer share of the commit before per-head pages (8d48c3e~1, the default base), and
this machine's speed moves by 20-30% within minutes, so two runs a minute apart cannot
resolve a few percent. Here each engine runs in a process of its own (the base in a
checkout, `--base DIR`, or a temporary `git worktree` of a commit, as
`bench_common.checkout_process` runs one), every one built with the same requests, and
the controller steps them in turn over pipes, the first of each round rotating: they
share the same minutes of the machine, one step at a time. bench_step_host's `--base`
runs whole rounds a side instead: fine for a step's host share, too coarse here.

Engines (`--ways`): `base` (per layer at the base commit), `layer` and `head` (per layer
and per kv head now; `head` on a pool of the same bytes, bench_policies' sizing). The
workload is bench_heads_ab's: `--batch` requests whose prompts exceed the budget,
`--warm` steps to reach it, then `--steps` decode steps each. Reports each engine's step,
policy and forward time and its policy share, and the ratios to the base. Writes JSON
with the environment fingerprint and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAME = "bench_base_ab"
ROOT = Path(__file__).resolve().parent.parent
WAYS = ("base", "layer", "head")


def worker(a: argparse.Namespace) -> None:
    """One engine, stepped on request: reads a line per step from stdin ("s": step and
    answer its seconds; "q": answer the decode steps' means as JSON and exit). Runs in its
    checkout with only what both commits have: nothing of the controller's."""
    import torch

    from benchmarks.policy_eval import policy_config
    from engine.sampling import SamplingParams
    from loadtest.random_models import FIRST_TOKEN_ID, MODEL_CONFIGS
    from scheduler.engine_core import EngineConfig, EngineCore
    from scheduler.resolve import resolve_request

    torch.set_num_threads(a.threads)
    cfg = MODEL_CONFIGS[a.model]
    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    budget = round(a.budget * (a.prompt + a.gen))
    prompt = max(a.prompt, budget + 1)
    blocks = a.batch * layers * (math.ceil((prompt + a.warm + a.steps) / 16) + 2)
    kv = policy_config(a.policy, budget)
    extra: dict = {}
    if a.way == "head":
        from benchmarks import bench_common as bc

        kv["heads"] = "uniform"  # type: ignore[index]
        blocks = bc.head_pool_pages(a.model_dir, blocks, "auto", "auto", kv)
        extra = {"kv_layout": "head", "default_kv_policy": kv}
    eng = EngineCore(EngineConfig(model=a.model_dir, num_blocks=blocks, max_num_seqs=a.batch,
                                  max_num_batched_tokens=2048, enable_prefix_caching=False,
                                  **extra))
    rng = random.Random(a.seed)
    req_kv = resolve_request(eng.limits, kv).kv_policy
    for i in range(a.batch):
        eng.add_request(f"r{i}", [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(prompt)],
                        SamplingParams(max_tokens=a.warm + a.steps + 1, temperature=0,
                                       ignore_eos=True, detokenize=False), kv_policy=req_kv)
    for _ in range(a.warm):
        eng.step()
    stats: list = []
    eng.on_step = stats.append
    if a.cpus:  # every engine on the same cores, each step after the others' (see --cpus)
        os.sched_setaffinity(0, a.cpus)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "s":
            break
        t = time.perf_counter()
        eng.step()
        print(time.perf_counter() - t, flush=True)
    decode = [s for s in stats if s.num_seqs == a.batch and s.num_prefill_tokens == 0]
    n = max(1, len(decode))
    print(json.dumps({"decode_steps": len(decode),
                      "policy_ms": 1e3 * sum(s.policy_s for s in decode) / n,
                      "forward_ms": 1e3 * sum(s.forward_s for s in decode) / n}), flush=True)


def _start(way: str, tree: str, own_build: bool, policy: str, model_dir: str,
           a: argparse.Namespace) -> subprocess.Popen:
    from benchmarks.bench_common import checkout_process

    cmd, env = checkout_process(tree, __file__, ["--worker", "--way", way, "--policy", policy,
                                                 "--model-dir", model_dir, *_shape(a)],
                                own_build)
    return subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _shape(a: argparse.Namespace) -> list[str]:
    return ["--model", a.model, "--batch", str(a.batch), "--prompt", str(a.prompt),
            "--gen", str(a.gen), "--budget", str(a.budget), "--warm", str(a.warm),
            "--steps", str(a.steps), "--seed", str(a.seed), "--threads", str(a.threads),
            "--cpus", ",".join(map(str, a.cpus))]


def _read(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"a worker exited (code {p.wait()}); its stderr is above")
    return line.strip()


def pair(trees: dict[str, tuple[str, bool]], policy: str, model_dir: str,
         a: argparse.Namespace, rotate: int) -> dict:
    """One pass: every way's engine built (side by side, on any core: builds are not
    timed), then stepped in turn, the first of each round rotating from `rotate`."""
    procs = {way: _start(way, *trees[way], policy, model_dir, a) for way in a.ways}
    for p in procs.values():
        assert _read(p) == "ready"
    wall = dict.fromkeys(a.ways, 0.0)
    order = list(a.ways)
    for i in range(a.steps):
        k = (i + rotate) % len(order)
        for way in order[k:] + order[:k]:
            p = procs[way]
            assert p.stdin is not None
            p.stdin.write("s\n")
            p.stdin.flush()
            wall[way] += float(_read(p))
    out: dict = {"first": order[rotate % len(order)]}
    for way, p in procs.items():
        assert p.stdin is not None
        p.stdin.write("q\n")
        p.stdin.flush()
        r = json.loads(_read(p))
        p.wait()
        assert r["decode_steps"] == a.steps, f"{policy} {way}: a step was not all decode"
        r["step_ms"] = 1e3 * wall[way] / a.steps
        r["share"] = r["policy_ms"] / r["step_ms"]
        out[way] = r
    return out


def _worktree(commit: str, tmp: Path) -> str:
    """A worktree of `commit` under `tmp` (its C++ ops are built in it on first use, a
    few CPU-minutes: a library's build cannot be shared between two checkouts, whose
    paths differ, without rebuilding it for each in turn)."""
    tree = str(tmp / "base")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tree, commit],
                   check=True, capture_output=True)
    return tree


def _drop_worktree(tree: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tree],
                   capture_output=True)


def run(a: argparse.Namespace) -> dict:
    from benchmarks import bench_common as bc
    from loadtest.random_models import build_model

    report = bc.new_report(NAME, a, ("base", "model", "policies", "ways", "cpus", "batch",
                                     "prompt", "gen", "budget", "warm", "steps", "seed",
                                     "threads"))
    worktree = "base" in a.ways and not os.path.isdir(a.base)
    if "base" in a.ways:  # the commit a checkout is at, or the one named
        where, rev = (str(ROOT), a.base) if worktree else (a.base, "HEAD")
        report["base_commit"] = subprocess.run(["git", "-C", where, "rev-parse", rev], check=True,
                                               capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = str(tmp / "model")
        report["params"] = build_model(a.model, model_dir, max_positions=4096)
        trees = {w: (str(ROOT), False) for w in a.ways}
        try:
            if worktree:
                trees["base"] = (_worktree(a.base, tmp), True)
            elif "base" in a.ways:
                trees["base"] = (a.base, True)
            report["policies"] = {}
            for policy in a.policies:
                passes = [pair(trees, policy, model_dir, a, rotate)
                          for rotate in range(a.passes)]
                report["policies"][policy] = {"passes": passes, **summary(passes, a.ways)}
                print(f"[{policy}] " + ", ".join(
                    f"{w} {report['policies'][policy][w]['share']:.1%}" for w in a.ways),
                      flush=True)
        finally:
            if worktree:
                _drop_worktree(trees["base"][0])
    return report


def summary(passes: list[dict], ways: list[str]) -> dict:
    """Per way the passes' means; step and share ratios to the first way (geometric
    means of the passes' ratios: each pass is paired, the passes are not)."""
    out: dict = {}
    for w in ways:
        out[w] = {k: statistics.mean(p[w][k] for p in passes)
                  for k in ("step_ms", "policy_ms", "forward_ms", "share")}
        out[w]["step_ratio"] = statistics.geometric_mean(
            p[w]["step_ms"] / p[ways[0]]["step_ms"] for p in passes)
        out[w]["share_ratio"] = statistics.geometric_mean(
            p[w]["share"] / p[ways[0]]["share"] for p in passes)
    return out


def table(report: dict) -> str:
    ways = report["settings"]["ways"]
    ref = ways[0]
    lines = ["| policy | " + " | ".join(f"{w}: step ms, policy ms, share" for w in ways)
             + " | " + " | ".join(f"{w} / {ref}: step, share" for w in ways[1:]) + " |",
             "|---|" + "---|" * (2 * len(ways) - 1)]
    for policy, r in report["policies"].items():
        cells = [f"{r[w]['step_ms']:.2f}, {r[w]['policy_ms']:.3f}, {r[w]['share']:.1%}"
                 for w in ways]
        cells += [f"{r[w]['step_ratio']:.3f}, **{r[w]['share_ratio']:.3f}**" for w in ways[1:]]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="8d48c3e~1",
                   help="another checkout (a directory), or a commit to check out in a "
                        "temporary worktree (default: the last one before per-head pages)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    p.add_argument("--policies", default="knorm,keydiff,h2o,tova,pyramid")
    p.add_argument("--model", default="3m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=512, help="with --prompt, sizes the budget")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--warm", type=int, default=30)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--passes", type=int, default=3,
                   help="passes per policy, each its engines built anew, the first rotating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpus", default="",
                   help="comma list of the CPUs every engine runs on (default: the last "
                        "--threads of this process's; the scheduler would otherwise put "
                        "engines on cores of their own, their caches warm, which a server "
                        "stepping one engine never is)")
    p.add_argument("--out", default="runs")
    p.add_argument("--results", default=f"results/{NAME}.json")
    # a worker's own (the controller starts them)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--way", default="layer", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.ways = [w for w in a.ways.split(",") if w]
    if bad := [w for w in a.ways if w not in WAYS]:
        p.error(f"--ways: {', '.join(bad)} (known: {', '.join(WAYS)})")
    a.policies = [x for x in a.policies.split(",") if x]
    if not a.worker:  # a worker runs in its own checkout, whose policies may differ
        from benchmarks.policy_eval import POLICIES

        if bad := [x for x in a.policies if x not in POLICIES]:
            p.error(f"--policies: not a scoring policy: {', '.join(bad)}")
    a.cpus = [int(x) for x in a.cpus.split(",") if x] or \
        sorted(os.sched_getaffinity(0))[-a.threads:]
    a.command = f"python -m benchmarks.{NAME} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    from benchmarks import bench_common as bc

    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = run(args)
    path = bc.save_json(report, args.out, NAME, args.results)
    print(table(report))
    print(f"wrote {path}, {args.results}")
    return report


if __name__ == "__main__":
    main()
