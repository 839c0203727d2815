"""The kept-sets gate: which tokens every policy keeps, step by step, as hashes to compare.

Why: a change that makes a policy's step cheaper must not change what it keeps, and the
overhead benchmark (`benchmarks.bench_policies --parts overhead`) only reports time. This
tool runs the same workload (16 requests of budget + 1 prompt tokens, greedy, the
random-weight model, 1 thread) for `--steps` engine steps per policy and, after every
step, hashes each running request's kept positions per layer (its row of the shared
slot tables, the positions of the live slots in slot order). Run it on two commits
(e.g. a `git worktree` of the base) and `--compare` the two JSONs: the first step,
request and layer whose kept set differs is reported, and the exit status is 1.

    python -m benchmarks.kept_sets --policies h2o,tova --steps 200 --out runs/kept_new.json
    python -m benchmarks.kept_sets --compare runs/kept_base.json runs/kept_new.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import tempfile

import torch

from benchmarks import bench_common as bc
from benchmarks.policy_eval import POLICIES, policy_config
from engine.sampling import SamplingParams
from loadtest.random_models import FIRST_TOKEN_ID, MODEL_CONFIGS, build_model
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.resolve import resolve_request


def kept_hashes(eng: EngineCore) -> dict[str, list[str]]:
    """Per running request (by id), per layer: a short hash of the positions its live
    slots hold, in slot order (the kept set and its order in the cache)."""
    out: dict[str, list[str]] = {}
    for r in eng.scheduler.running:
        if r.cache is None:
            continue
        pos = r.cache.slot_pos  # [L, W]
        out[r.request_id] = [
            hashlib.sha1(p[p >= 0].to(torch.int64).numpy().tobytes()).hexdigest()[:16]
            for p in pos]
    return dict(sorted(out.items()))


def run_policy(path: str, name: str, args: argparse.Namespace) -> list[dict[str, list[str]]]:
    """The overhead workload for `name`, `args.steps` steps: the hashes after each."""
    cfg = MODEL_CONFIGS[args.model]
    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    budget = round(args.budget * (args.prompt + args.gen))
    prompt = max(args.prompt, budget + 1)
    blocks = args.batch * layers * (math.ceil((prompt + args.steps) / 16) + 2)
    eng = EngineCore(EngineConfig(model=path, num_blocks=blocks, max_num_seqs=args.batch,
                                  max_num_batched_tokens=2048, enable_prefix_caching=False,
                                  kv_cache_dtype=args.kv_cache_dtype))
    rng = random.Random(args.seed)
    kv = resolve_request(eng.limits, policy_config(name, budget)).kv_policy
    for i in range(args.batch):
        eng.add_request(f"{name}-{i}", [rng.randrange(FIRST_TOKEN_ID, vocab)
                                        for _ in range(prompt)],
                        SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True,
                                       detokenize=False), kv_policy=kv)
    steps = []
    for _ in range(args.steps):
        if not eng.has_unfinished():
            break
        eng.step()
        steps.append(kept_hashes(eng))
    return steps


def _first_diff(x: dict[str, list[str]], y: dict[str, list[str]]) -> tuple[str, int] | None:
    """The first (request, layer) whose hash differs between two steps' records."""
    for r in sorted(set(x) | set(y)):
        hx, hy = x.get(r, []), y.get(r, [])
        for layer in range(max(len(hx), len(hy))):
            if hx[layer:layer + 1] != hy[layer:layer + 1]:
                return r, layer
    return None


def compare(a_path: str, b_path: str) -> int:
    """Print where two runs' kept sets first differ, per policy; 1 if any does."""
    with open(a_path, encoding="utf-8") as f:
        a = json.load(f)["policies"]
    with open(b_path, encoding="utf-8") as f:
        b = json.load(f)["policies"]
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'the first' if name in a else 'the second'} run")
            bad = 1
            continue
        sa, sb = a[name], b[name]
        diff = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), None)
        if diff is None and len(sa) != len(sb):
            diff = min(len(sa), len(sb))
        if diff is None:
            print(f"{name}: equal over {len(sa)} steps")
            continue
        bad = 1
        x, y = (sa[diff] if diff < len(sa) else {}), (sb[diff] if diff < len(sb) else {})
        print(f"{name}: DIFFERS from step {diff} (first request, layer: {_first_diff(x, y)})")
    return bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=200, help="engine steps per policy")
    p.add_argument("--model", default="3m", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--batch", type=int, default=16, help="requests (bench_policies' "
                   "--overhead-batch)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=3584, help="with --prompt and --budget, sets "
                   "the budget as bench_policies does")
    p.add_argument("--budget", type=float, default=0.25, help="of prompt + gen")
    p.add_argument("--kv-cache-dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="JSON to write the hashes to")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two written runs instead of running (exit 1 if they differ)")
    a = p.parse_args(argv)
    a.policies = [x for x in a.policies.split(",") if x]
    bad = [x for x in a.policies if x not in POLICIES]
    if bad:
        p.error(f"--policies: unknown {', '.join(bad)}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if argv is None:  # a command line: threads pinned as the benchmarks pin them
        bc.pin_threads("benchmarks.kept_sets", args.threads, argv)
    else:  # in process (tests): torch's interop threads can be set only once
        torch.set_num_threads(args.threads)
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "compare"},
                    "policies": {}}
    with tempfile.TemporaryDirectory(prefix="kept-sets-") as path:
        build_model(args.model, path, max_positions=4096)
        for name in args.policies:
            report["policies"][name] = run_policy(path, name, args)
            last = report["policies"][name][-1] if report["policies"][name] else {}
            digest = hashlib.sha1(json.dumps(report["policies"][name]).encode()).hexdigest()[:12]
            print(f"[kept_sets] {name}: {len(report['policies'][name])} steps, "
                  f"{len(last)} running at the end, digest {digest}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
