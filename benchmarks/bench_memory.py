"""Memory management under load: prefix caching, preemption modes, watermark (issue 4).

Why: the mechanisms of docs/memory.md (after 003_12df107fdefa535c.txt) each trade
memory for latency or throughput, and the paper's numbers are for a 70B model on a GPU.
This measures the same trade-offs on this machine, through the offline EngineCore:

1. prefix caching (`--prefix-model`, default the ~160M shape): TTFT of requests sharing
   a 1,024-token prefix + a distinct 16-token suffix, one at a time after one warm-up
   request — hits vs misses (the same prompts with a per-request `cache_salt`, which
   changes every block key); target ≥ 5× lower TTFT on hits.
2. preemption (`--pressure-model`): one workload of long, varying outputs, all
   submitted at once, in a pool of `--pool-fraction` (1/3) of its peak need; swap vs
   recompute vs auto: output tokens/s, p50/p99 end-to-end latency, preemptions; for
   auto the cost model's choices and the crossover context length it measured
   (`CostModel.crossover_tokens`), set against 003's swap/recompute table.
3. watermark sweep: the same workload with `--watermark` 0.30 … 0.02 (003's 70 … 98 %
   usable): throughput, preemptions per minute, p99 latency, max concurrent requests.

Latency is per request, end to end: RequestOutput.arrival_time (time.monotonic at
submission) to the moment the final output is seen; TTFT from first_token_time.

    python -m benchmarks.bench_memory --out runs/
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time

from tqdm import tqdm

from benchmarks import bench_common as bc
from engine.sampling import SamplingParams
from loadtest.random_models import FIRST_TOKEN_ID, MODEL_CONFIGS, build_model
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.preemption import CostModel

NAME = "bench_memory"
DOC_HEADING = "## Memory management (issue 4)"
MODES = ("swap", "recompute", "auto")
# 003, "Swap vs Recompute Breakeven (Llama 3 70B)", PCIe Gen4 x16: (prompt tokens, swap
# ms, recompute ms) — swap wins at every length.
PAPER_SWAP_TABLE = ((128, 0.2, 15), (512, 0.8, 55), (2048, 3.2, 210), (8192, 12.4, 830),
                    (32768, 50.0, 3300))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)


def part_prefix(path: str, args: argparse.Namespace) -> dict:
    cfg = MODEL_CONFIGS[args.prefix_model]
    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    rng = random.Random(args.seed)
    prefix = _ids(rng, args.prefix_tokens, vocab)
    per_req = layers * math.ceil((args.prefix_tokens + args.suffix_tokens) / 16)
    # Room for a few requests: misses park their own (salted) blocks and the LRU reuses
    # the oldest of them first; the shared prefix, touched by every hit, stays.
    eng = EngineCore(EngineConfig(model=path, num_blocks=4 * per_req, max_num_seqs=4))
    eng.add_request("warm", prefix + _ids(rng, args.suffix_tokens, vocab), _greedy(1))
    bc.drive(eng, "warm-up", progress=False)
    out: dict = {"prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                 "requests_each": args.prefix_requests, "hit": {}, "miss": {}}
    hits0 = eng.stats().prefix_cache_hits_total
    recs: dict[str, list[dict]] = {"hit": [], "miss": []}
    for i in tqdm(range(args.prefix_requests), desc="prefix hit/miss", unit="pair",
                     disable=args.no_progress):
        for kind in ("hit", "miss"):  # alternate, so machine noise hits both alike
            eng.add_request(f"{kind}-{i}", prefix + _ids(rng, args.suffix_tokens, vocab),
                            _greedy(1), cache_salt=f"salt-{i}" if kind == "miss" else None)
            recs[kind] += bc.drive(eng, kind, progress=False).requests.values()
    for kind, rs in recs.items():
        ttft = [r["ttft_s"] for r in rs]
        out[kind] = {"ttft_s": ttft, "mean_ttft_s": sum(ttft) / len(ttft),
                     "p50_ttft_s": bc.pct(ttft, 50),
                     "prefix_hit_tokens": [r["prefix_hit_tokens"] for r in rs]}
    out["prefix_cache_hits_tokens"] = eng.stats().prefix_cache_hits_total - hits0
    out["mean_ratio"] = out["miss"]["mean_ttft_s"] / out["hit"]["mean_ttft_s"]
    out["p50_ratio"] = out["miss"]["p50_ttft_s"] / out["hit"]["p50_ttft_s"]
    print(f"[prefix] TTFT hit {1e3 * out['hit']['mean_ttft_s']:.1f} ms, miss "
          f"{1e3 * out['miss']['mean_ttft_s']:.1f} ms: {out['mean_ratio']:.1f}×", flush=True)
    return out


def _workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [(_ids(rng, rng.randint(*args.prompt_range), vocab), rng.randint(*args.output_range))
            for _ in range(args.requests)]


def _pressure_run(path: str, args: argparse.Namespace, work: list, num_blocks: int,
                  desc: str, **config: object) -> tuple[dict, EngineCore]:
    eng = EngineCore(EngineConfig(model=path, num_blocks=num_blocks, max_num_seqs=len(work),
                                  enable_prefix_caching=False, **config))  # type: ignore[arg-type]
    cost0 = None
    if eng.cost_model is not None:
        c = eng.cost_model
        cost0 = {"copy_bytes_per_s": c.copy_bytes_per_s, "prefill_s_per_token": c.prefill_s_per_token,
                 "swap_latency_s": c.swap_latency_s}
    for i, (prompt, n) in enumerate(work):
        eng.add_request(f"{desc}-{i}", prompt, _greedy(n))
    d = bc.drive(eng, desc, progress=not args.no_progress)
    st = eng.stats()
    e2e = d.latencies()
    r = {"wall_s": d.wall_s, "output_tokens": d.output_tokens, "tok_s": d.output_tokens / d.wall_s,
         "mean_e2e_s": sum(e2e) / len(e2e), "p50_e2e_s": bc.pct(e2e, 50), "p99_e2e_s": bc.pct(e2e, 99),
         "preemptions": dict(st.preemptions_total),
         "preemptions_per_min": sum(st.preemptions_total.values()) / (d.wall_s / 60),
         "swap_bytes": dict(st.swap_bytes_total), "max_running": d.max_running,
         "mean_running": d.mean_running,
         "all_lengths_ok": sorted(int(x["output_tokens"]) for x in d.requests.values())
         == sorted(n for _, n in work)}
    if cost0 is not None:
        r["cost_model_at_start"] = cost0
    print(f"[{desc}] {r['tok_s']:.1f} tok/s, p99 {r['p99_e2e_s']:.1f} s, preemptions "
          f"{r['preemptions']}, max running {r['max_running']}", flush=True)
    return r, eng


def _crossover(eng: EngineCore, at_start: dict) -> dict:
    """The auto cost model after the run (rates refined online): choices, crossover, 003's
    table on this machine; and the crossover of the start-up calibration alone."""
    c, layers, bs = eng.cost_model, eng.model_config.num_layers, eng.pool.block_size
    assert c is not None and eng.swap is not None
    bpt = eng.swap.bytes_per_block * layers / bs  # K+V bytes of one token, all layers
    x, x0 = c.crossover_tokens(bpt), CostModel(**at_start).crossover_tokens(bpt)
    return {"choices": dict(c.choices or {}), "bytes_per_token": bpt,
            "crossover_tokens_at_start": None if math.isinf(x0) else x0,
            "copy_bytes_per_s": c.copy_bytes_per_s, "prefill_s_per_token": c.prefill_s_per_token,
            "swap_latency_s": c.swap_latency_s, "crossover_tokens": None if math.isinf(x) else x,
            "table": [{"tokens": n, "paper_swap_ms": ps, "paper_recompute_ms": pr,
                       "swap_ms": 1e3 * c.swap_cost(int(n * bpt)),
                       "recompute_ms": 1e3 * c.recompute_cost(n)} for n, ps, pr in PAPER_SWAP_TABLE]}


def part_pressure(path: str, args: argparse.Namespace) -> dict:
    cfg = MODEL_CONFIGS[args.pressure_model]
    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    work = _workload(args, vocab)
    need = [layers * math.ceil((len(p) + n) / 16) for p, n in work]
    blocks = max(math.ceil(args.pool_fraction * sum(need)), 2 * max(need))
    out: dict = {"peak_blocks": sum(need), "num_blocks": blocks, "pool_fraction": blocks / sum(need),
                 "workload": {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                              "output_tokens": sum(n for _, n in work)}}
    swap_space = sum(need) * 2 * 16 * int(cfg["num_key_value_heads"]) * (
        int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])) * 4  # all of it, fp32
    if "preemption" in args.parts:
        out["modes"] = {}
        for mode in MODES:
            out["modes"][mode], eng = _pressure_run(path, args, work, blocks, f"preempt {mode}",
                                                    preemption_mode=mode, swap_space=swap_space)
            if mode == "auto":
                out["auto"] = _crossover(eng, out["modes"][mode]["cost_model_at_start"])
    if "watermark" in args.parts:
        out["watermark"] = {}
        for wm in args.watermarks:
            out["watermark"][f"{wm:.2f}"], _ = _pressure_run(
                path, args, work, blocks, f"watermark {wm:.2f}", watermark=wm,
                preemption_mode=args.watermark_mode, swap_space=swap_space)
    return out


# ---- main --------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="prefix,preemption,watermark")
    p.add_argument("--prefix-model", default="160m")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--prefix-requests", type=int, default=8, help="hits, and as many misses")
    p.add_argument("--pressure-model", default="3m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-range", default="32,256")
    p.add_argument("--output-range", default="128,1024")
    p.add_argument("--pool-fraction", type=float, default=1 / 3)
    p.add_argument("--watermarks", default="0.30,0.15,0.10,0.05,0.02")
    p.add_argument("--watermark-mode", default="recompute", choices=MODES)
    bc.add_run_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.prefix_model = a.pressure_model = "tiny"
        a.prefix_tokens, a.prefix_requests, a.requests = 256, 2, 8
        a.prompt_range, a.output_range = "8,32", "16,64"
    a.command = f"python -m benchmarks.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    a.parts = a.parts.split(",")
    a.prompt_range = tuple(int(x) for x in a.prompt_range.split(","))
    a.output_range = tuple(int(x) for x in a.output_range.split(","))
    a.watermarks = [float(x) for x in a.watermarks.split(",")]
    bc.default_paths(a, NAME)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = bc.new_report(NAME, args, (
                        "parts", "prefix_model", "prefix_tokens", "suffix_tokens",
                        "prefix_requests", "pressure_model", "requests", "prompt_range",
                        "output_range", "pool_fraction", "watermarks", "watermark_mode",
                        "seed", "threads"))
    t0 = time.perf_counter()
    models = {args.prefix_model: "prefix" in args.parts,
              args.pressure_model: bool({"preemption", "watermark"} & set(args.parts))}
    report["params"] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        paths = {}
        for m, used in models.items():
            if used:
                paths[m] = os.path.join(tmp, m)
                report["params"][m] = build_model(m, paths[m], max_positions=max(
                    2048, args.prefix_tokens + args.suffix_tokens))
        if "prefix" in args.parts:
            report["prefix"] = part_prefix(paths[args.prefix_model], args)
        if {"preemption", "watermark"} & set(args.parts):
            report["pressure"] = part_pressure(paths[args.pressure_model], args)
    report["bench_wall_s"] = time.perf_counter() - t0
    from benchmarks.bench_memory_report import plot, render

    bc.publish(report, args, NAME, DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
