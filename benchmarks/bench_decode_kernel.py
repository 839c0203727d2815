"""The CPU decode-attention kernel alone, and against another checkout's build of it.

    python -m benchmarks.bench_decode_kernel --shapes 8x400,32x200,64x400 --threads 1
    python -m benchmarks.bench_decode_kernel --base /tmp/base-checkout --rounds 2
    python -m benchmarks.bench_decode_kernel --model 3m --key-diversity --shapes 16x1025

Why a benchmark of its own: a change to `attention/csrc/paged_decode_cpu.cpp` moves a
decode step by a few percent, under the noise of an engine run on this 2-core machine,
and the kernel's speed depends on whether a layer's K/V come from cache or DRAM. So the
calls here cycle over `--layers` pools, as a model's layers do (the same pool called
back to back would stay in L3 and flatter any prefetching), and `--base` runs another
checkout's build (its own TORCH_EXTENSIONS_DIR: the op has one name) in a subprocess,
interleaved with this one round by round, so the machine's drift hits both alike.
`--key-diversity` also times, in the same rounds, the kernel returning KeyDiff's scores
(`paged_decode_key_diversity`) and the pool's separate op over the same rows
(`kvserve_storage.key_diversity`), the two ways a KeyDiff step gets them.
`--per-head 16,64` also times the same attention over a per-head pool (`--kv-layout
head`: a page holds one kv head's `block` tokens, each kv head of a sequence is a
sequence of its own, engine/attention_groups.by_head), pages of each listed size
shuffled over the pool: what a per-head pool's page size costs the kernel at this head
dim. Writes JSON with the environment fingerprint; prints a markdown table of medians.

    python -m benchmarks.bench_decode_kernel --model 3m --dtype float32 --layers 4 \
        --shapes 64x512 --per-head 16,32,64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch

NAME = "bench_decode_kernel"
# The 160M model's attention (MHA, 12 heads of 64), the 3m model's (GQA 8:2, d 32) and
# Llama-3-8B's (GQA 32:8, d 128).
HEADS = {"160m": (12, 12, 64), "3m": (8, 2, 32), "8b": (32, 8, 128)}


def decode_case(b: int, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
                seed: int, bs: int = 16, q_dtype: torch.dtype = torch.float32) -> dict:
    """`b` sequences of `n` cached tokens each decoding one, their blocks shuffled over
    the pool as a served pool's are, on 2 MiB pages as a served pool is
    (native/huge_pages.py); the kwargs of `paged_attention_cpu`. `q_dtype`: the
    model's (a bf16 model's queries over its bf16 pool take the kernel's bf16 dot
    products; an fp32 model's over a bf16 pool, `--kv-cache-dtype bfloat16`, do not)."""
    from native.huge_pages import huge_page_empty

    g = torch.Generator().manual_seed(seed)
    per = -(-n // bs)
    ids = torch.randperm(b * per, generator=g)
    slot_pos = torch.full((b, per * bs), -1, dtype=torch.int64)
    slot_pos[:, :n] = torch.arange(n)
    kv = huge_page_empty((2, b * per, bs, hkv, d), dtype)
    kv.copy_(torch.randn(2, b * per, bs, hkv, d, generator=g))
    return {"q": torch.randn(b, 1, hq, d, generator=g).to(q_dtype), "k_cache": kv[0], "v_cache": kv[1],
            "table": ids.view(b, per), "slot_pos": slot_pos,
            "q_pos": torch.full((b, 1), n - 1, dtype=torch.int64), "scale": d**-0.5}


def per_head_case(case: dict, hkv: int, bs: int, seed: int) -> dict:
    """`case`'s attention over a per-head pool: pages of one kv head's `bs` tokens,
    shuffled over the pool; kv head h of sequence b is sequence h·B + b with the query
    heads of its group (the runner's `heads_q`), its own table and positions."""
    from native.huge_pages import huge_page_empty

    q, n = case["q"], int(case["q_pos"][0, 0]) + 1
    b, _, hq, d = q.shape
    per, rows = -(-n // bs), hkv * b
    g = torch.Generator().manual_seed(seed)
    slot_pos = torch.full((rows, per * bs), -1, dtype=torch.int64)
    slot_pos[:, :n] = torch.arange(n)
    kv = huge_page_empty((2, rows * per, bs, 1, d), case["k_cache"].dtype)
    kv.copy_(torch.randn(2, rows * per, bs, 1, d, generator=g))
    return {"q": q.view(b, 1, hkv, hq // hkv, d).permute(2, 0, 1, 3, 4).reshape(rows, 1, hq // hkv, d),
            "k_cache": kv[0], "v_cache": kv[1], "slot_pos": slot_pos,
            "table": torch.randperm(rows * per, generator=g).view(rows, per),
            "q_pos": case["q_pos"].repeat(hkv, 1), "scale": case["scale"]}


def measure(shapes: list[tuple[int, int]], heads: tuple[int, int, int], layers: int,
            dtype: torch.dtype, calls: int, threads: int,
            key_diversity: bool = False, q_dtype: torch.dtype = torch.float32,
            per_head: tuple[int, ...] = ()) -> list[dict[str, float]]:
    """Median and min ms per layer call for each (sequences, tokens) shape; with
    `key_diversity` also the medians of the kernel returning KeyDiff's scores and of
    the pool's op computing them alone; with `per_head` the median over a per-head pool
    of each page size (`head<bs>_median_ms`)."""
    from attention.cpu_attention import kernel_available, paged_attention_cpu

    if not kernel_available():
        raise SystemExit("the C++ decode kernel did not build")
    torch.set_num_threads(threads)
    hq, hkv, d = heads
    rows = []
    for b, n in shapes:
        pools = []
        for layer in range(layers):
            pools.append(decode_case(b, n, hq, hkv, d, dtype, seed=layer, q_dtype=q_dtype))
        # way -> (function, its case for each layer)
        ways = {"": (paged_attention_cpu, pools)}
        for bs in per_head:
            ways[f"head{bs}_"] = (paged_attention_cpu, [per_head_case(c, hkv, bs, seed=i)
                                                       for i, c in enumerate(pools)])
        if key_diversity:
            from attention.cpu_attention import paged_decode_key_diversity
            from attention.key_stats import key_diversity as pool_op
            from attention.key_stats import load_storage_ops

            load_storage_ops()
            ways["kd_"] = (paged_decode_key_diversity, pools)
            ways["op_"] = (lambda **c: pool_op(c["k_cache"], c["table"], c["slot_pos"]), pools)
        for fn, cases in ways.values():  # warm: first-touch page faults, the op's first call
            for case in cases:
                fn(**case)
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(calls):
            for layer in range(layers):
                for w, (fn, cases) in ways.items():  # interleaved: the same cache state
                    t = time.perf_counter()
                    fn(**cases[layer])
                    times[w].append(time.perf_counter() - t)
        mib = 2 * b * n * hkv * d * pools[0]["k_cache"].element_size() / 2**20
        row = {"seqs": b, "tokens": n, "mib_per_layer": round(mib, 1),
               "median_ms": statistics.median(times[""]) * 1e3, "min_ms": min(times[""]) * 1e3}
        for w in ways:
            if w:
                row[f"{w}median_ms"] = statistics.median(times[w]) * 1e3
        rows.append(row)
        del pools, ways
    return rows


def table(report: dict) -> str:
    rounds = report["rounds"]
    has_base = "base" in rounds[0]
    head = "| sequences × tokens | MiB a layer | ms a call, this checkout |"
    sep = "|---|---|---|"
    if has_base:
        head += " ms a call, base | base / this |"
        sep += "---|---|"
    kd = "kd_median_ms" in rounds[0]["this"][0]
    if kd:
        head += " with KeyDiff's scores | + KeyDiff | KeyDiff op alone |"
        sep += "---|---|---|"
        if has_base:
            head += " with KeyDiff's scores, base | KeyDiff op alone, base |"
            sep += "---|---|"
    sizes = sorted(int(k[4:-10]) for k in rounds[0]["this"][0] if k.startswith("head"))
    for bs in sizes:
        head += f" per head, {bs}-token pages | per head / per layer |"
        sep += "---|---|"
    lines = [head, sep]
    for i, row in enumerate(rounds[0]["this"]):
        new = [r["this"][i]["median_ms"] for r in rounds]
        line = (f"| {row['seqs']} × {row['tokens']} | {row['mib_per_layer']} | "
                f"{' / '.join(f'{x:.3f}' for x in new)} |")
        if has_base:
            old = [r["base"][i]["median_ms"] for r in rounds]
            line += (f" {' / '.join(f'{x:.3f}' for x in old)} | "
                     f"{statistics.median(old) / statistics.median(new):.2f}× |")
        if kd:
            fused = statistics.median([r["this"][i]["kd_median_ms"] for r in rounds])
            op = statistics.median([r["this"][i]["op_median_ms"] for r in rounds])
            line += (f" {fused:.3f} | {fused - statistics.median(new):+.3f} | {op:.3f} |")
            if has_base:
                line += "".join(
                    f" {statistics.median([r['base'][i][k] for r in rounds]):.3f} |"
                    for k in ("kd_median_ms", "op_median_ms"))
        for bs in sizes:
            ph = statistics.median([r["this"][i][f"head{bs}_median_ms"] for r in rounds])
            line += f" {ph:.3f} | {ph / statistics.median(new):.2f}× |"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(HEADS), default="160m",
                   help="attention shape (heads, kv heads, head dim)")
    p.add_argument("--shapes", default="4x400,8x400,16x300,32x200,64x400",
                   help="SEQUENCESxTOKENS, comma-separated")
    p.add_argument("--layers", type=int, default=12, help="pools cycled, one per layer")
    p.add_argument("--dtype", default="bfloat16", help="the pool's dtype")
    p.add_argument("--q-dtype", default=None,
                   help="the queries' dtype (the model's); default: the pool's")
    p.add_argument("--calls", type=int, default=8, help="calls per layer per shape")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--key-diversity", action="store_true",
                   help="also time the kernel with KeyDiff's scores, and the pool's op alone")
    p.add_argument("--per-head", default="", help="page sizes (tokens, comma-separated) to "
                   "also time over a per-head pool")
    p.add_argument("--base", help="another checkout to build and run the same way, interleaved")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each: this, then base)")
    p.add_argument("--out", default="runs/")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # measure once, JSON to this path
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    per_head = tuple(int(x) for x in a.per_head.split(",") if x)
    args = (shapes, HEADS[a.model], a.layers, getattr(torch, a.dtype), a.calls, a.threads,
            a.key_diversity, getattr(torch, a.q_dtype or a.dtype), per_head)
    if a.worker:
        with open(a.worker, "w", encoding="utf-8") as f:
            json.dump(measure(*args), f)  # type: ignore[arg-type]
        return {}
    from loadtest.fingerprint import fingerprint

    torch.set_num_threads(a.threads)
    report: dict = {"benchmark": NAME, "command": f"python -m benchmarks.{NAME} " + shlex.join(argv),
                    "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
                    "settings": vars(a), "rounds": []}
    same = ["--model", a.model, "--shapes", a.shapes, "--layers", str(a.layers),
            "--dtype", a.dtype, "--q-dtype", a.q_dtype or a.dtype, "--calls", str(a.calls),
            "--threads", str(a.threads),
            *(["--key-diversity"] if a.key_diversity else []),
            *(["--per-head", a.per_head] if a.per_head else [])]
    # imported here, not in the worker: a base checkout may lack it
    from benchmarks.bench_common import ab_rounds

    return ab_rounds(NAME, report, a.out, a.rounds, a.base, __file__, same,
                     lambda: measure(*args), table)  # type: ignore[arg-type]

if __name__ == "__main__":
    main()
