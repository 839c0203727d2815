"""A policy's decode step per kv head against per layer, measured step by step in pairs.

    python -m benchmarks.bench_heads_ab --policies knorm,keydiff,h2o,tova,pyramid

Why a benchmark of its own: the per-head layout's cost (issue 65) is a few percent of a
3m step, and this machine's speed moves by 20-30% from one minute to the next, so two
runs a minute apart (bench_policies' throughput part, its rounds) cannot resolve it. Here
one policy's two engines, a per-layer pool and a per-head pool of the same bytes
(bench_policies' `_engine`), live in one process with the same requests, and are stepped
in turn, the first of each pair alternating; each engine's step times are summed, so
both see the same minutes of the machine. Which engine is built first moved the ratio by
~3% (placement in memory, it seems), so every policy runs twice, built in either order,
and the table gives both and their geometric mean.

The steps timed are part 2's of bench_policies (`--overhead-batch` requests at the
budget, every step a plan for a scoring policy): `--batch` requests whose prompts exceed
the budget, `--warm` steps to reach it, then `--steps` steps each, decode only. Writes
JSON with the environment fingerprint and prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import tempfile
import time

from benchmarks import bench_common as bc
from benchmarks.bench_policies import _engine, _submit
from benchmarks.policy_eval import POLICIES, variant
from loadtest.random_models import MODEL_CONFIGS, build_model

NAME = "bench_heads_ab"


def pair(path: str, args: argparse.Namespace, policy: str, head_first: bool) -> dict:
    """One pass: the policy's per-layer and per-head engines stepped in turn."""
    cfg = MODEL_CONFIGS[args.model]
    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    budget = round(args.budget * (args.prompt + args.gen))
    prompt = max(args.prompt, budget + 1)
    blocks = args.batch * layers * (math.ceil((prompt + args.warm + args.steps) / 16) + 2)
    ways = ["head", "layer"] if head_first else ["layer", "head"]
    engines, steps = {}, {}
    for way in ways:
        layout, kv = variant(f"{policy}:head" if way == "head" else policy, budget)
        eng = _engine(path, blocks, args.batch, args, kv_layout=layout, default_kv_policy=kv)
        _submit(eng, prompt, [args.warm + args.steps + 1] * args.batch, vocab, kv, args.seed,
                way)
        for _ in range(args.warm):  # prefill, and every request to its budget
            eng.step()
        steps[way] = []
        eng.on_step = steps[way].append
        engines[way] = eng
    wall = dict.fromkeys(ways, 0.0)
    for i in range(args.steps):
        for way in ways if i % 2 == 0 else ways[::-1]:
            t = time.perf_counter()
            engines[way].step()
            wall[way] += time.perf_counter() - t
    out: dict = {"built_first": ways[0]}
    for way in ways:
        decode = [s for s in steps[way] if s.num_seqs == args.batch and s.num_prefill_tokens == 0]
        assert len(decode) == args.steps, f"{policy} {way}: a step was not all decode"
        out[way] = {"step_ms": 1e3 * wall[way] / args.steps,
                    "policy_ms": 1e3 * sum(s.policy_s for s in decode) / args.steps,
                    "forward_ms": 1e3 * sum(s.forward_s for s in decode) / args.steps}
    out["head_over_layer"] = out["head"]["step_ms"] / out["layer"]["step_ms"]
    return out


def run(args: argparse.Namespace) -> dict:
    report = bc.new_report(NAME, args, ("model", "policies", "batch", "prompt", "gen", "budget",
                                        "warm", "steps", "seed", "threads"))
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as path:
        report["params"] = build_model(args.model, path, max_positions=4096)
        report["policies"] = {}
        for policy in args.policies:
            passes = [pair(path, args, policy, head_first) for head_first in (False, True)]
            ratios = [p["head_over_layer"] for p in passes]
            report["policies"][policy] = {
                "passes": passes, "head_over_layer": statistics.geometric_mean(ratios)}
            print(f"[{policy}] per-head step / per-layer step: "
                  f"{', '.join(f'{r:.3f}' for r in ratios)} (layer built first, head first)",
                  flush=True)
    return report


def table(report: dict) -> str:
    lines = ["| policy | head / layer step, layer built first | head first | geometric mean "
             "| step ms, layer / head | policy ms, layer / head |", "|---|---|---|---|---|---|"]
    for policy, r in report["policies"].items():
        a, b = r["passes"]
        ms = [statistics.mean(p[w]["step_ms"] for p in (a, b)) for w in ("layer", "head")]
        pol = [statistics.mean(p[w]["policy_ms"] for p in (a, b)) for w in ("layer", "head")]
        lines.append(f"| {policy} | {a['head_over_layer']:.3f} | {b['head_over_layer']:.3f} "
                     f"| **{r['head_over_layer']:.3f}** | {ms[0]:.2f} / {ms[1]:.2f} "
                     f"| {pol[0]:.3f} / {pol[1]:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="3m", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--policies", default="knorm,keydiff,h2o,tova,pyramid",
                   help=f"comma list of {', '.join(sorted(POLICIES))}")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=512, help="with --prompt, sizes the budget")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--warm", type=int, default=30)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--out", default="runs")
    p.add_argument("--results", default=f"results/{NAME}.json")
    a = p.parse_args(argv)
    a.policies = [x for x in a.policies.split(",") if x]
    if bad := [x for x in a.policies if x not in POLICIES]:
        p.error(f"--policies: not a scoring policy: {', '.join(bad)}")
    a.command = f"python -m benchmarks.{NAME} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = run(args)
    path = bc.save_json(report, args.out, NAME, args.results)
    print(table(report))
    print(f"wrote {path}, {args.results}")
    return report


if __name__ == "__main__":
    main()
