"""The docs/benchmarks.md block of `benchmarks.bench_gpu` ("GPU: CUDA graphs (issue 23)"):
pure functions of the report dict, kept apart from the measurement, so a run's JSON
renders off the GPU too."""

from __future__ import annotations

from typing import Any


def table(report: dict) -> str:
    rows = ["| run | output tok/s | × HF generate (pressure: × full) | decode tok/s at N | "
            "step ms at N | forward | schedule | sample | policy share | GPU busy | "
            "replay GPU ms | overlapped | prefill tok/s (share of the run) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    n = report["settings"]["requests"]
    runs = report["runs"]
    hf = runs.get("hf_generate", {}).get("tok_s")
    pressure = runs.get("pressure full", {}).get("tok_s")

    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return fmt.format(x) if isinstance(x, int | float) else "–"

    for label, r in report["runs"].items():
        if "error" in r:
            rows.append(f"| {label} | failed: {r['error'][:60]} | | | | | | | | | | | |")
            continue
        base = pressure if label.startswith("pressure") else hf  # like against like
        ratio = r["tok_s"] / base if base else None
        decode = n / r["step_ms"] * 1e3 if "step_ms" in r else None
        rows.append(f"| {label} | {r['tok_s']:,.0f} | {f(ratio, '{:.1f}×')} | "
                    f"{f(decode, '{:,.0f}')} | {f(r.get('step_ms'))} | {f(r.get('forward_ms'))} | "
                    f"{f(r.get('schedule_ms'))} | {f(r.get('sample_ms'))} | "
                    f"{f(r.get('policy_share'), '{:.0%}')} | {f(r.get('gpu_busy'), '{:.0%}')} | "
                    f"{f(r.get('replay_ms'))}{replay_host(r)} | {overlapped(r)} | "
                    f"{prefill_rate(r)} |")
    return "\n".join(rows)


def overlapped(r: dict) -> str:
    """The share of the run's steps planned and launched while the one before them ran
    on the GPU (async scheduling); – where the run predates it."""
    if "overlapped_steps" not in r or not r.get("steps"):
        return "–"
    return f"{r['overlapped_steps'] / r['steps']:.0%}"


def prefill_rate(r: dict) -> str:
    """Prompt tokens a second over the steps that prefilled, and their share of the
    run's wall time; – where the run predates it."""
    if "prefill_tok_s" not in r:
        return "–"
    return f"{r['prefill_tok_s']:,.0f} ({r['prefill_share']:.0%})"


def replay_host(r: dict) -> str:
    """' (host x.xx)': a replay() call's host time, where the run measured it."""
    return f" (host {r['replay_host_ms']:.2f})" if "replay_host_ms" in r else ""


def render(report: dict) -> str:
    """The doc's block: where and how it was measured, the command, the table."""
    fp, s = report["fingerprint"], report["settings"]
    head = (f"{fp['gpu']}, torch {fp['torch']}, transformers {fp['transformers']}, "
            f"commit {str(fp['git_commit'])[:10]}{' + local changes' if fp['git_dirty'] else ''}, "
            f"{fp['date_utc']}. {s['requests']} requests × {s['prompt']}/{s['gen']} tokens, "
            f"{s['model']} bf16, greedy. `{report['command']}`")
    if "pressure" in report:
        p = report["pressure"]
        head += (f"; pressure: {p['num_blocks']} blocks (fits {p['fits_full']} full "
                 f"requests), {s['requests']} × {s['prompt']}/{p['gen']}")
    text = head + ".\n\n" + table(report)
    k = report.get("kernels")
    if k and "error" not in k:
        from benchmarks.bench_gpu_kernels import table as kernel_table

        text += "\n\n" + kernel_table(k)
    return text
