"""Where a GPU decode step's time goes, kernel by kernel, and the Triton decode attention
against torch's SDPA (flash) on the same shape (issue 23, item 4). Part `kernels` of
`benchmarks.bench_gpu`, in the same run:

- `step_kernels`: torch.profiler over eager decode steps at N running (eager, because a
  profiler does not see every kernel of a replayed graph): each kernel's CUDA ms per
  step and launches per step, the largest first. What a graph replay runs is the same
  list, minus the launch gaps.
- `decode_attention`: one layer's decode attention at the benchmark's shape (N
  sequences of C cached tokens, bf16, blocks shuffled over the pool as a served pool's
  are), for the model's heads and for a GQA 4:1 shape (Llama-3.2-1B's 32/8 heads),
  timed with CUDA events: the general kernel (`decode=False`, what decode steps ran
  before `_decode_kernel`), the decode kernel at its defaults, at other tiles
  (BLOCK_N, warps, stages) and forced splits, with the mass
  pass, and SDPA over the same K/V laid out dense (what the flash kernel costs without
  a block table: a floor, not a drop-in, since it reads no pool). Tile choices are made
  from this table.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.bench_decode_kernel import decode_case

# the decode kernel's sweep: (BLOCK_N, num_warps, num_stages)
TILES = [(64, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2)]
GQA_TILES = [(32, 4, 2), (64, 4, 3), (128, 4, 2)]
GQA_HEADS = (32, 8, 64)  # Llama-3.2-1B: 32 query heads, 8 kv heads, head_dim 64


def step_kernels(engine: Any, steps: int = 5, top: int = 15) -> list[dict]:
    """The largest CUDA kernels of `steps` engine steps: name, ms and launches per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            t = per.setdefault(e.name, [0.0, 0])
            t[0] += e.device_time_total / 1e3
            t[1] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in per.values()) / steps
    return [{"kernel": name[:90], "ms_per_step": ms / steps, "launches_per_step": n / steps,
             "share": ms / steps / total if total else 0.0} for name, (ms, n) in rows[:top]]


def _time(fn: Any, reps: int = 20) -> float:
    """GPU milliseconds a call: `reps` calls captured in one CUDA graph, replayed and
    timed with CUDA events. Timing eager calls measured the host instead (the first
    H200 run of commit 65b60e2: every paged call read ~0.1 ms, the wrapper's and Triton
    launcher's host time, while SDPA read 0.03), and a decode step replays these kernels
    from a graph."""
    fn()
    fn()  # compiled, and every lazy allocation made, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def decode_attention(b: int, ctx: int, hq: int, hkv: int, d: int) -> list[dict]:
    """One layer's decode attention at (b sequences × ctx slots): the kernels, their
    tiles and splits, the mass pass, and SDPA over dense K/V."""
    from attention.triton_attention import paged_attention_triton

    case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in decode_case(b, ctx, hq, hkv, d, torch.bfloat16, 0).items()}
    q = case["q"].to(torch.bfloat16)
    case["q"] = q
    shape = f"{hq}/{hkv}x{d}"
    runs: list[tuple[str, dict]] = [("general kernel (decode=False)", {"decode": False}),
                                    ("decode kernel", {})]
    runs += [(f"decode kernel {t}", {"tiles": t}) for t in (TILES if hq == hkv else GQA_TILES)]
    runs += [(f"decode kernel, {n} splits", {"num_splits": n}) for n in (2, 4)]
    runs += [("decode kernel + mass summed over heads", {"return_probs": True, "sum_heads": True}),
             ("general kernel + mass summed over heads",
              {"return_probs": True, "sum_heads": True, "decode": False})]
    out: list[dict] = []
    for label, kw in runs:
        try:
            ms = _time(lambda kw=kw: paged_attention_triton(**case, **kw))
            out.append({"shape": shape, "kernel": label, "ms": ms})
        except Exception as e:  # a tile the GPU cannot hold: say so, keep the rest
            out.append({"shape": shape, "kernel": label, "error": repr(e)[:200]})
    qd = q.view(b, hq, 1, d)  # dense K/V [b, hkv, ctx, d]: the same bytes, no table
    kd = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out.append({"shape": shape, "kernel": "torch SDPA, dense K/V", "ms": _time(
        lambda: sdpa(qd, kd, vd, enable_gqa=hq != hkv))})
    kv_bytes = 2 * b * ctx * hkv * d * 2
    for r in out:
        if "ms" in r:
            r["GB_s"] = kv_bytes / r["ms"] / 1e6
    return out


def run(path: str, prompts: list[list[int]], heads: tuple[int, int, int]) -> dict:
    """Both parts on the benchmark's model and prompts (eager engine, N running)."""
    from engine.sampling import SamplingParams
    from scheduler.engine_core import EngineConfig, EngineCore

    n, prompt = len(prompts), len(prompts[0])
    eng = EngineCore(EngineConfig(model=path, dtype="bfloat16", kv_cache_dtype="bfloat16",
                                  max_num_seqs=n, max_num_batched_tokens=8192,
                                  enable_prefix_caching=False, enforce_eager=True,
                                  kv_cache_memory="8GiB"))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"k{i}", p, params)
    t = time.perf_counter()
    for _ in range(20):  # the prompts and some decode steps: every kernel compiled
        eng.step()
    kernels = step_kernels(eng)
    while eng.has_unfinished():
        eng.step()
    del eng
    torch.cuda.empty_cache()
    attn = [r for h in dict.fromkeys([heads, GQA_HEADS])
            for r in decode_attention(n, prompt + 128, *h)]
    return {"step_kernels": kernels, "decode_attention": attn,
            "seconds": time.perf_counter() - t}


def table(k: dict) -> str:
    rows = ["| kernel | ms per step | launches per step | share |", "|---|---|---|---|"]
    rows += [f"| `{r['kernel'][:60]}` | {r['ms_per_step']:.3f} | {r['launches_per_step']:.0f} | "
             f"{r['share']:.0%} |" for r in k["step_kernels"]]
    rows += ["", "| decode attention, one layer | heads | GPU ms | K/V GB/s |",
             "|---|---|---|---|"]
    rows += [f"| {r['kernel']} | {r.get('shape', '')} | {r['ms']:.4f} | {r['GB_s']:,.0f} |"
             if "ms" in r else f"| {r['kernel']} | {r.get('shape', '')} | failed: "
             f"{r['error'][:60]} | |" for r in k["decode_attention"]]
    return "\n".join(rows)
