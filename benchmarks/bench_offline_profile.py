"""Where kvserve's decode step goes in `bench_offline`: the share of each step outside the
model forward (`step_overhead`, from the engine's StepStats), and with `--profile`
cProfile's and torch.profiler's view of decode steps at `--max-seqs` running
(`profile_decode`)."""

from __future__ import annotations

import cProfile
import os
import pstats

import torch

from benchmarks.bench_offline_systems import KVServe, Workload


def step_overhead(steps: list, max_seqs: int) -> dict[str, object]:
    """Share of engine step time outside the model forward (schedule + sample + advance).

    Reported for all steps and for the steady state the target is about: steps that
    only decode, with `max_seqs` sequences running.
    """
    def share(sel: list) -> dict[str, object]:
        total = sum(s.total_s for s in sel)
        if not sel or total == 0:
            return {"steps": len(sel)}
        fields = ("schedule_s", "forward_s", "sample_s", "total_s")
        return {"steps": len(sel), "outside_forward_share": 1 - sum(s.forward_s for s in sel) / total,
                "mean_step_ms": 1e3 * total / len(sel),
                **{f"mean_{f[:-2]}_ms": 1e3 * sum(getattr(s, f) for s in sel) / len(sel)
                   for f in fields[:3]}}

    full = [s for s in steps if s.num_seqs == max_seqs and s.num_prefill_tokens == 0]
    return {"all_steps": share(steps), f"decode_{max_seqs}_running": share(full)}


# cProfile entries worth naming in the report: (label, file suffix, function name).
_PROFILE_POINTS = (
    ("engine step", "scheduler/engine_core.py", "step"),
    ("schedule (plan + block allocation)", "scheduler/scheduler.py", "schedule"),
    ("runner.execute (input prep + forward + logits)", "engine/runner.py", "execute"),
    ("  build block-table groups", "engine/attention_groups.py", "build_group"),
    ("  model forward (decoder layers)", "engine/models/llama.py", "forward"),
    ("    attention callback (KV write + paged attention)", "engine/runner.py", "attn"),
    ("      paged_attention (gather + sdpa)", "attention/torch_attention.py", "paged_attention"),
    ("      paged_attention_cpu (decode kernel)", "attention/cpu_attention.py", "paged_attention_cpu"),
    ("sample", "engine/sampler.py", "sample"),
    ("advance (append tokens, stop checks, outputs)", "scheduler/step_complete.py", "_advance"),
)


def profile_decode(kv: KVServe, w: Workload, max_seqs: int, steps: int = 16,
                   plain_steps: int = 96) -> dict[str, object]:
    """Profile decode steps with exactly `max_seqs` requests running.

    The timed workload has that state only briefly (short requests finish while long
    prompts are still prefilling), so this drives the engine by hand: the same prompts,
    each asking for enough tokens to outlive the profile, stepped until all decode. Then
    `plain_steps` plain steps (StepStats: the table's share; many, because the share of
    a 15 ms step moves by ~1 pp between runs of 16), `steps` under cProfile (Python call
    tree) and `steps` under torch.profiler (which aten ops); the requests are aborted
    afterwards.
    """
    from engine.sampling import SamplingParams

    eng = kv.llm.engine
    n = plain_steps + 2 * steps + 64  # nobody finishes: prefill steps + three profiled runs
    ids = [f"profile-{i}" for i in range(max_seqs)]
    for rid, p in zip(ids, w.prompts[:max_seqs]):
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                               detokenize=False))
    kv.steps.clear()
    while not kv.steps or kv.steps[-1].num_prefill_tokens or kv.steps[-1].num_seqs < max_seqs:
        eng.step()
    kv.steps.clear()
    for _ in range(plain_steps):
        eng.step()
    plain = step_overhead(list(kv.steps), max_seqs)[f"decode_{max_seqs}_running"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    points = []
    for label, path, func in _PROFILE_POINTS:
        # max, not sum: nested modules share the name `forward`; the outermost is largest
        ct = max((v[3] for k, v in st.stats.items() if k[0].endswith(path) and k[2] == func),
                 default=0.0)
        points.append({"what": label, "ms_per_step": 1e3 * ct / steps, "share": ct / total})
    top_py = sorted(st.stats.items(), key=lambda kv_: -kv_[1][2])[:12]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            eng.step()
    ops = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)
    op_total = sum(e.self_cpu_time_total for e in ops)
    for rid in ids:
        eng.abort_request(rid)
    kv.steps.clear()
    return {
        "running": max_seqs, "steps_each": steps, "plain_steps_each": plain_steps,
        "plain_steps": plain,
        "cprofile_ms_per_step": 1e3 * total / steps, "cprofile_points": points,
        "cprofile_top_tottime": [
            {"func": f"{os.path.relpath(k[0]) if k[0].startswith('/') else k[0]}:{k[1]}({k[2]})",
             "ms_per_step": 1e3 * v[2] / steps, "calls_per_step": v[1] / steps}
            for k, v in top_py],
        "torch_ops_top_self_cpu": [
            {"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / op_total, "calls_per_step": e.count / steps}
            for e in ops[:15]],
    }
