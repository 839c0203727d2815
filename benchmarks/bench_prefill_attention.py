"""A prompt chunk's causal attention on the CPU: kvserve's op against torch's SDPA.

    python -m benchmarks.bench_prefill_attention --model 160m --lengths 128,512,1024,2048
    python -m benchmarks.bench_prefill_attention --model 160m --lengths 128,512 --prefix 1000

Why: a prompt with nothing cached attends over its own keys once per layer, and torch's
CPU SDPA (`is_causal`) ran it at ~44 GFLOP/s in bf16 and ~90 in fp32 on torch's OpenMP
threads, which sleep in a server. `attention/csrc/causal_prefill.h` runs it on kvserve's
thread team. This times one layer's call for each prompt length, the two alternating
call by call so that drift falls on both, with the threads waiting as `kvserve serve`'s
do (`--cpu-wait poll`, re-executing itself to set them), and reports medians, GFLOP/s
(causal: half the products) and the ratio; JSON with the environment fingerprint, a
markdown table and a plot.

`--prefix N`: each chunk follows N tokens cached in a pool's blocks (scattered, as a
server's are): the op reads them in place (`prefix_prefill_cpu`), the torch path gathers
the blocks and runs SDPA under a mask (`paged_attention`), the two ways a runner attends
a chunk after a prefix-cache hit or a long prompt's first chunk. Its own doc block.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks import bench_common as bc
from benchmarks.bench_prefill_attention_report import plot, render
from loadtest.random_models import MODEL_CONFIGS

NAME = "bench_prefill_attention"
DOC_HEADING = "## Prefill attention on the CPU (issue 22)"
PREFIX_HEADING = "## Prefill attention after a cached prefix on the CPU (issue 22)"
WAYS = ("kvserve", "sdpa")
BLOCK = 16  # the pool's block size in --prefix runs (the engine's default)


def heads(model: str) -> tuple[int, int, int]:
    c = MODEL_CONFIGS[model]
    hq = c["num_attention_heads"]
    return hq, c.get("num_key_value_heads", hq), c["hidden_size"] // hq


def calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> dict[str, Callable]:
    """Each way's call on one layer's chunk: over its own keys, or after `prefix` tokens
    cached in a pool's scattered blocks (the chunk's own K/V written there after them, as
    the runner writes a layer's before attending)."""
    from attention.cpu_attention import causal_prefill_cpu, prefix_prefill_cpu
    from attention.torch_attention import causal_self_attention, paged_attention

    t, hkv, d = k.shape
    scale = d ** -0.5
    if not prefix:
        return {"kvserve": lambda: causal_prefill_cpu(q, k, v, scale),  # the op, as the runner calls it
                "sdpa": lambda: causal_self_attention(q, k, v, scale)}
    nb = -(-(prefix + t) // BLOCK)
    table = torch.randperm(2 * nb)[:nb]
    k_cache = torch.randn(2 * nb, BLOCK, hkv, d).to(k.dtype)
    v_cache = torch.randn(2 * nb, BLOCK, hkv, d).to(k.dtype)
    pos = torch.full((nb * BLOCK,), -1)  # slot s holds position s; the last block's tail empty
    pos[: prefix + t] = torch.arange(prefix + t)
    chunk = pos[prefix : prefix + t]
    rows = table[chunk // BLOCK] * BLOCK + chunk % BLOCK
    k_cache.view(-1, hkv, d)[rows], v_cache.view(-1, hkv, d)[rows] = k, v
    return {"kvserve": lambda: prefix_prefill_cpu(q, k_cache, v_cache, k, v, table, pos, prefix,
                                                  scale),
            "sdpa": lambda: paged_attention(q[None], k_cache, v_cache, table[None], pos[None],
                                            chunk[None], scale)}


def measure(model: str, dtype: torch.dtype, lengths: list[int], reps: int,
            prefix: int = 0) -> dict[str, dict[int, float]]:
    """Median seconds of one layer's call per prompt length, per way."""
    hq, hkv, d = heads(model)
    out: dict[str, dict[int, float]] = {w: {} for w in WAYS}
    for t in lengths:
        qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)  # the views a model makes
        q, k, v = qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
        ways = calls(q, k, v, prefix)
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for _ in range(reps + 1):
            for w in WAYS:
                # an untimed call first, as a layer's qkv projection runs just before it in
                # a step: its threads awake (kvserve's team polls 1 ms, then sleeps; torch's
                # OpenMP threads likewise) and q, k, v in cache. Without it a fast call's
                # second share was at times taken by the caller before the woken worker
                # turned up (the other way's call had run in between): twice the time.
                ways[w]()
                t0 = time.perf_counter()
                ways[w]()
                times[w].append(time.perf_counter() - t0)
        for w in WAYS:  # the first call warms both
            out[w][t] = statistics.median(times[w][1:])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="160m", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--lengths", default="128,512,1024,2048")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--prefix", type=int, default=0,
                   help="tokens cached in the pool before each chunk (0: a fresh prompt)")
    bc.add_run_args(p)
    p.set_defaults(threads=2)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.quick:
        a.model, a.lengths, a.reps = "tiny", "17,40", 1
    name = f"{NAME}_prefix" if a.prefix else NAME
    bc.default_paths(a, name)
    threads = bc.pin_threads(f"benchmarks.{NAME}", a.threads, argv)
    from attention.cpu_attention import vector_path
    from engine.cpu_memory import keep_freed_memory
    from loadtest.fingerprint import fingerprint

    if vector_path() != "avx512":
        raise SystemExit("the causal_prefill op runs on AVX-512 builds only")
    # as an engine runs: the op's fp32 copies of K and V (12 MB at 2,048 tokens of the 160M
    # model) otherwise come from a fresh mmap, faulted in, every call; the first dtype
    # measured read up to 1.3x slower than the same dtype measured second
    keep_freed_memory()
    report: dict = {"benchmark": NAME, "settings": vars(a), "threads": threads,
                    "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
                    "seconds_by_length": {}}
    lengths = [int(x) for x in a.lengths.split(",")]
    for dtype in a.dtypes.split(","):
        got = measure(a.model, getattr(torch, dtype), lengths, a.reps, a.prefix)
        report["seconds_by_length"][dtype] = got
        print(f"{dtype}: " + " ".join(f"{t}: {got['kvserve'][t] * 1e3:.2f} vs {got['sdpa'][t] * 1e3:.2f} ms"
                                      for t in lengths), flush=True)
    bc.publish(report, a, name, PREFIX_HEADING if a.prefix else DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
