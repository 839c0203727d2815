"""kvserve on a GPU against HF transformers on the same GPU, in one run (issue 23).

The workload is shared/gpu/gpu_probe.py's, the first GPU measurement: a random-weight
model (`random_models.build_model`), bf16 weights and KV, N requests of P random prompt
tokens generating G each, greedy, EOS ignored, all submitted at once, `max_num_seqs=N`,
no prefix caching. Runs, each on a fresh engine after a warm-up:

- kvserve `full` with CUDA graphs (engine/cuda_graphs.py), the same without async
  scheduling (each step's tokens on the host before the next is planned), with decode steps
  on the general attention kernel instead of `_decode_kernel`, the same with torch's
  layer ops instead of the Triton kernels (engine/layer_ops_triton.py), and
  `enforce_eager`;
- kvserve policies at their budget inside graphs (streaming; h2o, whose attention mass
  the statistics graphs' Triton pass computes; knorm, whose key norms they keep), and
  h2o eagerly beside them: the step and its policy share;
- HF `generate` (dynamic cache; static cache) on the same prompts as one batch;
- kernels (benchmarks/bench_gpu_kernels.py): an eager decode step's CUDA kernels, and the
  Triton decode attention at a few tile sizes against SDPA on the same shape;
- pressure: a pool that fits `--pressure-fit` full requests, N requests of P + 2G
  tokens, `full` against streaming and h2o.

Each kvserve run reports output tok/s, the mean decode step at N running (total,
forward, schedule, sample, policy), the GPU's busy share over 10 such steps
(torch.profiler: CUDA kernel and copy time over wall time), the share of its steps
planned while the one before ran (async scheduling) and the prompts' prefill rate. Writes JSON with the
environment fingerprint (GPU included) and a markdown table to docs/benchmarks.md.

    python -m benchmarks.bench_gpu --model 160m          # the issue's run (about 3 min)
    python -m benchmarks.bench_gpu --model 1b            # Llama-3.2-1B's shape, GQA 4:1
    python -m benchmarks.bench_gpu --model 160m --parts kvserve,hf --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.bench_gpu_report import render

PROFILE_AT, PROFILE_STEPS = 40, 10  # decode steps into the run, and how many


def build(model: str, out_dir: str) -> str:
    from loadtest.random_models import build_model

    path = os.path.join(out_dir, model)
    if not os.path.exists(os.path.join(path, "config.json")):
        build_model(model, path)
    return path


def gpu_busy(steps: int, engine: Any) -> float:
    """CUDA time (kernels and copies) over wall time across `steps` engine steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    busy = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy / 1e6 / wall


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> tuple[float, float]:
    """(GPU milliseconds of one replay, CUDA events; host milliseconds of one
    `replay()` call, each after a synchronize: what launching costs the step's host
    thread, ~1 ms under cProfile on an H200, commit 128b3d1). The buffers hold the last step."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    host = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host / reps * 1e3


def run_kvserve(path: str, prompts: list[list[int]], gen: int, *, policy: Any = None,
                eager: bool = False, memory: str = "8GiB", num_blocks: int | None = None,
                profile: bool = True, overlap: bool = True) -> dict:
    from engine.sampling import SamplingParams
    from scheduler.engine_core import EngineConfig, EngineCore
    from scheduler.resolve import resolve_request
    from scheduler.warmup import warm_up

    n = len(prompts)
    stats: list = []
    kw: dict[str, Any] = ({"num_blocks": num_blocks} if num_blocks else
                          {"kv_cache_memory": memory})
    eng = EngineCore(EngineConfig(model=path, dtype="bfloat16", kv_cache_dtype="bfloat16",
                                  max_num_seqs=n, max_num_batched_tokens=8192,
                                  enable_prefix_caching=False, enforce_eager=eager,
                                  async_scheduling=overlap, **kw),
                     on_step=stats.append)
    t0 = time.perf_counter()
    warm_up(eng)  # as the server does: native ops, every graph bucket captured
    warmup_s = time.perf_counter() - t0
    policy = resolve_request(eng.limits, policy).kv_policy

    def params(g: int) -> SamplingParams:
        return SamplingParams(max_tokens=g, temperature=0, ignore_eos=True, detokenize=False)

    # and this run's policy and shapes, every prompt (the timed run's prefill steps: in
    # the H200 run of commit 17f0a9a Triton's first compiles at 8,192-token steps took
    # ~2.5 s of it)
    for i, p in enumerate(prompts):
        eng.add_request(f"w{i}", p, params(8), kv_policy=policy)
    while eng.has_unfinished():
        eng.step()
    stats.clear()
    graph_steps0 = eng.runner.graphs.steps if eng.runner.graphs else 0
    overlapped0 = eng.overlapped_steps
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params(gen), kv_policy=policy)
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    full = [s for s in stats if s.num_prefill_tokens == 0 and s.num_seqs == n]
    r: dict[str, Any] = dict(tok_s=n * gen / wall, wall_s=wall, steps=len(stats),
                             warmup_s=warmup_s,
                             graph_steps=(eng.runner.graphs.steps - graph_steps0
                                          if eng.runner.graphs else 0),
                             overlapped_steps=eng.overlapped_steps - overlapped0)
    if profile:  # after the timed run: the profiler's start-up took seconds inside it (s23)
        for i, p in enumerate(prompts):
            eng.add_request(f"p{i}", p, params(PROFILE_AT + PROFILE_STEPS), kv_policy=policy)
        for _ in range(PROFILE_AT):
            eng.step()
        r["gpu_busy"] = gpu_busy(PROFILE_STEPS, eng)
        while eng.has_unfinished():
            eng.step()
    prefill = [s for s in stats if s.num_prefill_tokens]
    if prefill:  # the prompts' steps: eager, thousands of tokens each
        r["prefill_steps"] = len(prefill)
        r["prefill_tok_s"] = (sum(s.num_prefill_tokens for s in prefill)
                              / sum(s.total_s for s in prefill))
        r["prefill_share"] = sum(s.total_s for s in prefill) / wall
    if full:
        for key, field in (("step_ms", "total_s"), ("forward_ms", "forward_s"),
                           ("schedule_ms", "schedule_s"), ("sample_ms", "sample_s"),
                           ("policy_ms", "policy_s")):
            r[key] = sum(getattr(s, field) for s in full) / len(full) * 1e3
        r["decode_steps_at_n"] = len(full)
        r["policy_share"] = r["policy_ms"] / r["step_ms"]
        r["decode_tok_s"] = n / r["step_ms"] * 1e3  # the decode phase's rate at N running
    graphs = eng.runner.graphs
    if graphs is not None:  # the forward's GPU time alone, in the graph the steps at N used
        used = [k for k in graphs.replays if k[0] == n and k in graphs.graphs]
        if used:
            key = max(used, key=graphs.replays.__getitem__)
            r["replay_ms"], r["replay_host_ms"] = replay_ms(graphs.graphs[key])
    del eng
    torch.cuda.empty_cache()
    return r


def torch_layer_ops(run: Any) -> dict:
    """`run()` with RMSNorm, SiLU-and-mul and RoPE in torch's ops instead of the Triton
    kernels (KVSERVE_TRITON_LAYER_OPS=0): what the fused kernels buy, in the same run."""
    from engine import layer_ops

    os.environ["KVSERVE_TRITON_LAYER_OPS"] = "0"
    layer_ops._triton_ops.cache_clear()
    try:
        return run()
    finally:
        del os.environ["KVSERVE_TRITON_LAYER_OPS"]
        layer_ops._triton_ops.cache_clear()


def general_attention(run: Any) -> dict:
    """`run()` with decode steps on the general Triton kernel (`_attn_kernel`) instead of
    `_decode_kernel` (attention.triton_attention.DECODE_KERNEL): what the decode kernel
    buys end to end, in the same run."""
    from attention import triton_attention

    triton_attention.DECODE_KERNEL = False
    try:
        return run()
    finally:
        triton_attention.DECODE_KERNEL = True


def run_hf(path: str, prompts: list[list[int]], gen: int, cache: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = {"cache_implementation": cache} if cache else {}
    m.generate(ids[:4, :64], max_new_tokens=8, do_sample=False, eos_token_id=None,
               pad_token_id=0, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen,
               min_new_tokens=gen, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    del m
    torch.cuda.empty_cache()
    return dict(tok_s=len(prompts) * gen / wall, wall_s=wall)


def pressure_blocks(path: str, fit: int, tokens: int, block_size: int = 16) -> int:
    from engine.model_config import load_model_config

    layers = load_model_config(path).num_layers
    return fit * layers * -(-tokens // block_size)


def kernels_part(path: str, prompts: list[list[int]]) -> dict:
    from benchmarks import bench_gpu_kernels
    from engine.model_config import load_model_config

    cfg = load_model_config(path)
    return bench_gpu_kernels.run(path, prompts, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="160m")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--parts", default="kvserve,policies,hf,pressure,kernels")
    p.add_argument("--pressure-fit", type=int, default=8)
    p.add_argument("--models-dir", default=None, help="where the random models are built")
    p.add_argument("--out", default="runs/")
    p.add_argument("--doc", default="", help="a markdown file to write the generated table into")
    p.add_argument("--quick", action="store_true", help="8 requests of 32/32")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device")
    if a.quick:
        a.requests, a.prompt, a.gen = 8, 32, 32
    from loadtest.fingerprint import fingerprint

    path = build(a.model, a.models_dir or tempfile.mkdtemp(prefix="bench-gpu-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 32000) for _ in range(a.prompt)] for _ in range(a.requests)]
    parts = a.parts.split(",")
    report: dict[str, Any] = {
        "benchmark": "bench_gpu", "command": "python -m benchmarks.bench_gpu " + " ".join(argv or sys.argv[1:]),
        "fingerprint": {**fingerprint(), "gpu": torch.cuda.get_device_name()},
        "settings": vars(a), "runs": {}}
    plan: list[tuple[str, Any]] = []
    if "kvserve" in parts:
        plan += [("kvserve full graphs", lambda: run_kvserve(path, prompts, a.gen)),
                 ("kvserve full graphs, no async scheduling", lambda: run_kvserve(
                     path, prompts, a.gen, overlap=False)),
                 ("kvserve full graphs, general attention kernel", lambda: general_attention(
                     lambda: run_kvserve(path, prompts, a.gen))),
                 ("kvserve full graphs, torch layer ops", lambda: torch_layer_ops(
                     lambda: run_kvserve(path, prompts, a.gen))),
                 ("kvserve full eager", lambda: run_kvserve(path, prompts, a.gen, eager=True))]
    if "policies" in parts:
        plan += [("kvserve streaming 128 graphs", lambda: run_kvserve(
                     path, prompts, a.gen, policy={"name": "streaming", "sink": 4, "window": 124})),
                 ("kvserve h2o 128 graphs", lambda: run_kvserve(
                     path, prompts, a.gen, policy={"name": "h2o", "budget": 128})),
                 ("kvserve h2o 128 eager", lambda: run_kvserve(
                     path, prompts, a.gen, policy={"name": "h2o", "budget": 128}, eager=True)),
                 ("kvserve knorm 128 graphs", lambda: run_kvserve(
                     path, prompts, a.gen, policy={"name": "knorm", "budget": 128}))]
    if "hf" in parts:
        plan += [("hf_generate", lambda: run_hf(path, prompts, a.gen, None)),
                 ("hf_generate static cache", lambda: run_hf(path, prompts, a.gen, "static"))]
    if "pressure" in parts:
        long = a.prompt + 2 * a.gen
        blocks = pressure_blocks(path, a.pressure_fit, long)
        report["pressure"] = {"num_blocks": blocks, "fits_full": a.pressure_fit, "gen": 2 * a.gen}
        plan += [(f"pressure {label}", lambda pol=pol: run_kvserve(
                     path, prompts, 2 * a.gen, policy=pol, num_blocks=blocks, profile=False))
                 for label, pol in (("full", None), ("streaming 128", {
                     "name": "streaming", "sink": 4, "window": 124}),
                     ("h2o 128", {"name": "h2o", "budget": 128}))]
    if "kernels" in parts:
        plan.append(("kernels", lambda: kernels_part(path, prompts)))
    os.makedirs(a.out, exist_ok=True)
    out_path = os.path.join(a.out, f"bench_gpu_{a.model}.json")
    for i, (label, fn) in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] {label} ...", flush=True)
        try:
            result = fn()
        except Exception as e:  # one failed run must not cost the others (a lent GPU's minutes)
            result = {"error": repr(e)[:500]}
        if label == "kernels":
            report["kernels"] = result
        else:
            report["runs"][label] = result
        print(f"    {json.dumps(result)}", flush=True)
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print(render(report), flush=True)
    if a.doc:
        from benchmarks.bench_common import markers
        from loadtest.report import update_doc

        update_doc(a.doc, render(report), "## GPU: CUDA graphs (issue 23)", *markers("bench_gpu"))
    print(f"wrote {out_path}", flush=True)
    return report


if __name__ == "__main__":
    main()
