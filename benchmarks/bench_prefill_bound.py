"""Peak KV memory of one long prompt under each `kv_policy` (issue 20, bounded prefill).

A policy that evicts between prompt chunks (every one but snapkv and pyramid) holds its
bound plus one chunk from the first prompt token on; snapkv and pyramid, which compress
the prompt at its end with a window of its last queries, hold the prompt. This runs a
16k-token prompt (and a few generated tokens) through the engine once per policy, every
policy at the same budget, and reports the peak live tokens per layer, the peak blocks
and the time. The rope-shift rows run on a model whose `max_position_embeddings` is far
below the prompt: the prompt itself is longer than the context. Peaks are counts, not
timings: they do not depend on machine noise.

    python -m benchmarks.bench_prefill_bound --prompt 16384 --budget 1024

Writes runs/bench_prefill_bound-<stamp>.json, results/bench_prefill_bound.json,
the "## Bounded prefill (issue 20)" block of docs/benchmarks.md and
docs/img/bench_prefill_bound.png (`--quick`: a tiny model, everything under --out).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks import bench_common as bc
from benchmarks.bench_prefill_bound_report import plot, render
from loadtest.random_models import FIRST_TOKEN_ID, build_model

NAME = "bench_prefill_bound"
DOC_HEADING = "## Bounded prefill (issue 20)"


def policies(budget: int) -> dict[str, dict[str, Any]]:
    """Every policy at one budget (streaming: sink 4 + window budget - 4)."""
    window = {"sink": 4, "window": budget - 4}
    return {
        "full": {"name": "full"},
        "streaming": {"name": "streaming", **window},
        "lazy_streaming": {"name": "lazy_streaming", **window},
        "knorm": {"name": "knorm", "budget": budget},
        "paged_eviction": {"name": "paged_eviction", "budget": budget},
        "keydiff": {"name": "keydiff", "budget": budget},
        "h2o": {"name": "h2o", "budget": budget},
        "tova": {"name": "tova", "budget": budget},
        "snapkv": {"name": "snapkv", "budget": budget},
        "pyramid": {"name": "pyramid", "budget": budget},
        "lazy_eviction": {"name": "lazy_eviction", "budget": budget},
        "streaming+shift": {"name": "streaming", **window, "rope": "shift"},
        "lazy_streaming+shift": {"name": "lazy_streaming", **window, "rope": "shift"},
    }


def run_one(model: str, prompt_len: int, kv_policy: dict[str, Any], args) -> dict[str, Any]:
    from engine.sampling import SamplingParams
    from scheduler.engine_core import EngineConfig, EngineCore
    from scheduler.resolve import resolve_request

    core = EngineCore(EngineConfig(model=model, kv_cache_memory=args.kv_memory,
                                   max_num_batched_tokens=args.max_batched_tokens,
                                   enable_prefix_caching=False))
    words = core.model_config.vocab_size - FIRST_TOKEN_ID
    prompt = [FIRST_TOKEN_ID + (7 * i) % words for i in range(prompt_len)]
    core.add_request("r", prompt, SamplingParams(max_tokens=args.gen, temperature=0.0,
                                                 ignore_eos=True, detokenize=False),
                     kv_policy=resolve_request(core.limits, kv_policy).kv_policy)
    chunk = core.requests["r"].max_chunk
    t0 = time.perf_counter()
    steps, kv = 0, None
    while core.has_unfinished():
        for out in core.step():
            kv = out.kv or kv
        steps += 1
    assert kv is not None
    wall, context = time.perf_counter() - t0, core.max_model_len
    del core  # each run's pool goes before the next is allocated
    gc.collect()
    return {"kv_policy": kv_policy, "peak_live_tokens": kv.peak_live_tokens,
            "peak_blocks": kv.peak_blocks, "evicted_tokens": kv.evicted_tokens,
            "chunk": min(chunk, args.max_batched_tokens), "steps": steps,
            "wall_s": wall, "context": context}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="3m")
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--short-context", type=int, default=2048,
                   help="positions of the model the rope-shift rows run on")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-memory", default="512MiB")
    bc.add_run_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.prompt, a.budget, a.gen, a.short_context = "tiny", 1200, 64, 4, 512
        a.kv_memory = "16MiB"  # ~30x the tiny model's 1,204 tokens; zeroing 512MiB took seconds
    a.command = f"python -m benchmarks.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    bc.default_paths(a, NAME)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = bc.new_report(NAME, args, ("model", "prompt", "budget", "gen", "short_context",
                                        "max_batched_tokens", "kv_memory", "threads"))
    report["model"] = args.model
    report["runs"] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as tmp:
        long_ctx, short_ctx = os.path.join(tmp, "long"), os.path.join(tmp, "short")
        build_model(args.model, long_ctx, max_positions=args.prompt + args.gen + 64)
        build_model(args.model, short_ctx, max_positions=args.short_context)
        for name, cfg in policies(args.budget).items():
            model = short_ctx if name.endswith("+shift") else long_ctx
            r = run_one(model, args.prompt, cfg, args)
            report["runs"][name] = r
            print(f"{name}: peak {r['peak_live_tokens']} live tokens/layer, "
                  f"{r['peak_blocks']} blocks, chunk {r['chunk']}, {r['wall_s']:.1f} s", flush=True)
    bc.publish(report, args, NAME, DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
