"""Where a GPU decode step's time goes, kernel by kernel, and the Triton decode attention
against torch's SDPA (flash) on the same shape (issue 23, item 4). Part `kernels` of
`loadtest.bench_gpu`, in the same run:

- `step_kernels`: torch.profiler over eager decode steps at N running (eager, because a
  profiler does not see every kernel of a replayed graph): each kernel's CUDA ms per
  step and launches per step, the largest first. What a graph replay runs is the same
  list, minus the launch gaps.
- `decode_attention`: one layer's decode attention at the benchmark's shape (N
  sequences of C cached tokens, the model's heads, bf16, blocks shuffled over the pool
  as a served pool's are), timed with CUDA events: `paged_attention_triton` at its
  default tiles and a few others (BLOCK_N, warps, stages), and SDPA over the same
  K/V laid out dense (what the flash kernel costs without a block table: a floor, not
  a drop-in, since it reads no pool). Tile choices are made from this table.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from loadtest.bench_decode_kernel import decode_case

TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3)]


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


def _time(fn: Any, reps: int = 50) -> float:
    """GPU milliseconds a call (CUDA events, after two warm calls)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def decode_attention(b: int, ctx: int, hq: int, hkv: int, d: int) -> list[dict]:
    """One layer's decode attention at (b sequences × ctx slots), Triton tiles and SDPA."""
    from kvpool.triton_attention import paged_attention_triton

    case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in decode_case(b, ctx, hq, hkv, d, torch.bfloat16, 0).items()}
    q = case["q"].to(torch.bfloat16)
    case["q"] = q
    out: list[dict] = []
    for tiles in [None, *TILES]:
        try:
            ms = _time(lambda t=tiles: paged_attention_triton(**case, tiles=t))
            out.append({"kernel": f"triton {tiles or 'default'}", "ms": ms})
        except Exception as e:  # a tile the GPU cannot hold: say so, keep the rest
            out.append({"kernel": f"triton {tiles}", "error": repr(e)[:200]})
    ms = _time(lambda: paged_attention_triton(**case, return_probs=True, sum_heads=True))
    out.append({"kernel": "triton default + mass summed over heads", "ms": ms})
    # the alternative: the mass pass per kv head (a program per head: more parallel,
    # the same keys read), then torch's sum over heads
    ms = _time(lambda: paged_attention_triton(**case, return_probs=True)[1].sum(dim=2))
    out.append({"kernel": "triton default + mass per kv head, torch sum", "ms": ms})
    qd = q.view(b, hq, 1, d)  # dense K/V [b, hkv, ctx, d]: the same bytes, no table
    kd = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out.append({"kernel": "torch SDPA, dense K/V", "ms": _time(
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
    hq, hkv, d = heads
    return {"step_kernels": kernels, "decode_attention": decode_attention(
        n, prompt + 128, hq, hkv, d), "seconds": time.perf_counter() - t}


def table(k: dict) -> str:
    rows = ["| kernel | ms per step | launches per step | share |", "|---|---|---|---|"]
    rows += [f"| `{r['kernel'][:60]}` | {r['ms_per_step']:.3f} | {r['launches_per_step']:.0f} | "
             f"{r['share']:.0%} |" for r in k["step_kernels"]]
    rows += ["", "| decode attention, one layer | GPU ms | K/V GB/s |", "|---|---|---|"]
    rows += [f"| {r['kernel']} | {r['ms']:.4f} | {r['GB_s']:,.0f} |" if "ms" in r
             else f"| {r['kernel']} | failed: {r['error'][:60]} | |" for r in k["decode_attention"]]
    return "\n".join(rows)
