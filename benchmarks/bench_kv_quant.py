"""Quantized KV cache: capacity, quality and decode cost per `--kv-cache-dtype` (issue 21).

Why: 003_12df107fdefa535c.txt lists KV quantization beside paging and eviction (INT8
halves a 16-bit cache, INT4 quarters it) and the two multiply: a 25% budget in INT8 is
an eighth of a full bf16 cache. This measures what that buys and costs, side by side, in
one run through the engine's own paths:

1. capacity (`--model`, random weights): one pool of fixed bytes — `--fit` full bf16
   requests of `--prompt` + `--gen` tokens (issue 5's 512 + 3584: with a short
   generation a policy's peak is the prefilled prompt, not its budget) — per dtype
   (bfloat16, int8, fp8_e4m3, int4), for `full` and for `--policy` at `--budget` of
   the context; `--requests` are submitted at once. *Capacity* = pool blocks ÷ a request's measured peak blocks (how many run
   together without preemption); beside it what the scheduler reached (peak running:
   `full` is admitted optimistically, so it may exceed the capacity and then preempt),
   preemptions and output tokens/s. Targets: int8 ≥ 1.9× bf16's requests, int4 ≥ 3.5×,
   int8 + policy ≥ 7× `full` bf16.
2. quality (the demo model, `benchmarks/policy_eval.py`'s protocol): perplexity and needle
   accuracy per dtype for `full` and `--quality-policies` at `--quality-budgets`.
   Targets: int8/fp8 within 1% of bf16's perplexity, int4 within 5%.
3. decode step time per dtype (`--model`): `--decode-batch` sequences of `--decode-prompt`
   tokens decoding `--decode-steps` tokens; mean time of the decode-only steps, which
   shows what dequantization costs on this CPU.

    python -m benchmarks.bench_kv_quant --out runs/
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

from attention.storage import KVStorage
from benchmarks import bench_common as bc
from benchmarks.bench_kv_quant_report import plot, render
from benchmarks.policy_eval import policy_config, run_quality
from engine.sampling import SamplingParams
from loadtest.random_models import FIRST_TOKEN_ID, MODEL_CONFIGS, build_model
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.resolve import resolve_request

NAME = "bench_kv_quant"
DOC_HEADING = "## Quantized KV cache (issue 21)"
DTYPES = ("bfloat16", "int8", "fp8_e4m3", "int4")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)


def _prompts(seed: int, length: int, vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)] for _ in range(n)]


def part_capacity(path: str, args: argparse.Namespace, vocab: int) -> dict:
    cfg = MODEL_CONFIGS[args.model]
    layers, hkv = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    d = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    per_req_blocks = layers * -(-(args.prompt + args.gen) // args.block_size)
    pool_bytes = args.fit * per_req_blocks * KVStorage.bytes_per_block(
        args.block_size, hkv, d, torch.bfloat16)
    budget = round(args.budget * (args.prompt + args.gen))
    prompts = _prompts(args.seed, args.prompt, vocab, args.requests)
    rows = []
    for policy in ("full", args.policy):
        kv_policy = "full" if policy == "full" else policy_config(policy, budget)
        for dt in DTYPES:
            eng = EngineCore(EngineConfig(model=path, kv_cache_dtype=dt, kv_cache_memory=pool_bytes,
                                          block_size=args.block_size, max_num_seqs=args.requests,
                                          enable_prefix_caching=False))
            config = resolve_request(eng.limits, kv_policy).kv_policy
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, _greedy(args.gen), kv_policy=config)
            run = bc.drive(eng, f"capacity {policy} {dt}", progress=not args.no_progress)
            peak = max(int(r["peak_blocks"]) for r in run.requests.values())
            rows.append({
                "policy": policy, "kv_policy": kv_policy, "dtype": dt,
                "num_blocks": eng.pool.num_blocks, "block_bytes": eng.pool.storage.block_bytes,
                "pool_bytes": eng.pool.storage.nbytes, "request_peak_blocks": peak,
                "capacity": eng.pool.num_blocks // peak, "max_running": run.max_running,
                "mean_running": run.mean_running,
                "preemptions": sum(int(r["preemptions"]) for r in run.requests.values()),
                "output_tokens": run.output_tokens, "wall_s": run.wall_s,
                "tok_per_s": run.output_tokens / run.wall_s})
    base = next(r for r in rows if r["policy"] == "full" and r["dtype"] == "bfloat16")
    for r in rows:
        r["capacity_vs_full_bf16"] = r["capacity"] / base["capacity"]
        same = next(x for x in rows if x["policy"] == r["policy"] and x["dtype"] == "bfloat16")
        r["capacity_vs_bf16"] = r["capacity"] / same["capacity"]
    return {"pool_bytes": pool_bytes, "budget_tokens": budget, "rows": rows}


def part_decode(path: str, args: argparse.Namespace, vocab: int) -> dict:
    prompts = _prompts(args.seed, args.decode_prompt, vocab, args.decode_batch)
    rows = []
    # A pool of the batch's whole cache, not the default 512 MiB: zeroing that, once a
    # dtype, took longer than the quick run's decode steps.
    per_request = -(-(args.decode_prompt + args.decode_steps) // args.block_size) + 1
    layers = int(MODEL_CONFIGS[args.model]["num_hidden_layers"])
    for dt in DTYPES:
        eng = EngineCore(EngineConfig(model=path, kv_cache_dtype=dt, block_size=args.block_size,
                                      num_blocks=layers * args.decode_batch * per_request,
                                      max_num_seqs=args.decode_batch,
                                      max_num_batched_tokens=args.decode_prompt * args.decode_batch,
                                      enable_prefix_caching=False))
        for i, p in enumerate(prompts):
            eng.add_request(f"d{i}", p, _greedy(args.decode_steps))
        run = bc.drive(eng, f"decode {dt}", progress=False)
        dec = [s.total_s for s in run.steps if s.num_prefill_tokens == 0
               and s.num_decode_tokens == args.decode_batch]
        rows.append({"dtype": dt, "steps": len(dec), "mean_step_s": sum(dec) / len(dec),
                     "min_step_s": min(dec)})
    base = rows[0]["mean_step_s"]
    for r in rows:
        r["vs_bf16"] = r["mean_step_s"] / base
    return {"batch": args.decode_batch, "context": args.decode_prompt, "rows": rows}


def part_quality(args: argparse.Namespace) -> dict:
    out: dict = {"by_dtype": {}}
    for dt in DTYPES:
        # Policies one request at a time (the same plans as grouped), as this quality
        # protocol has always run them.
        q = run_quality(argparse.Namespace(**{**vars(args), "quality_kv_cache_dtype": dt,
                                              "policies": args.quality_policies,
                                              "quality_batch_policies": False}))
        if "skipped" in q:
            return q
        out["by_dtype"][dt] = q
    base = {r["policy"] + str(r["budget"]): r["ppl"] for r in out["by_dtype"]["bfloat16"]["rows"]}
    for q in out["by_dtype"].values():
        for r in q["rows"]:
            r["ppl_vs_bf16"] = r["ppl"] / base[r["policy"] + str(r["budget"])]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="capacity,quality,decode")
    p.add_argument("--model", default="3m")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fit", type=int, default=8, help="full bf16 requests the pool holds")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=3584,
                   help="issue 5's 512 + 3584: a policy's peak is its budget, not the prompt")
    p.add_argument("--policy", default="lazy_eviction")
    p.add_argument("--budget", type=float, default=0.25, help="of prompt + gen")
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--decode-prompt", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--quality-policies", default="lazy_eviction,snapkv")
    bc.add_quality_args(p, budgets="0.25")
    bc.add_run_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.fit, a.requests, a.prompt, a.gen, a.block_size = "tiny", 2, 12, 32, 32, 4
        a.decode_batch, a.decode_prompt, a.decode_steps = 4, 32, 8
        a.ppl_windows, a.quality_policies = 1, "snapkv"
    a.command = f"python -m benchmarks.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    a.parts = a.parts.split(",")
    a.quality_policies = a.quality_policies.split(",")
    bc.parse_quality_args(a)
    bc.default_paths(a, NAME)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = bc.new_report(NAME, args, (
        "parts", "model", "block_size", "fit", "requests", "prompt", "gen", "policy", "budget",
        "decode_batch", "decode_prompt", "decode_steps", "quality_policies", "quality_budgets", "ppl_windows",
        "ppl_window", "ppl_prompt", "needle_trials", "needle_lengths", "needle_tasks",
        "demo_model", "seed", "threads"))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-kv-quant-") as tmp:
        path = os.path.join(tmp, args.model)
        if {"capacity", "decode"} & set(args.parts):
            report["params"] = build_model(args.model, path, max_positions=max(
                2048, args.prompt + args.gen))
        vocab = int(MODEL_CONFIGS[args.model]["vocab_size"])
        if "capacity" in args.parts:
            report["capacity"] = part_capacity(path, args, vocab)
        if "decode" in args.parts:
            report["decode"] = part_decode(path, args, vocab)
    if "quality" in args.parts:
        report["quality"] = part_quality(args)
    report["bench_wall_s"] = time.perf_counter() - t0
    bc.publish(report, args, NAME, DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
