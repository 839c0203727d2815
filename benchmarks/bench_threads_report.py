"""The docs/benchmarks.md block of `benchmarks.bench_threads`: a pure function of the
report dict, kept apart from the measurement."""

from __future__ import annotations

from typing import Any


def render(report: dict[str, Any]) -> str:
    fp, st = report["fingerprint"], report["settings"]
    lines = ["| variant | one request, quiet (s) | four at once, quiet (s) | four / one "
             "| one, busy core (s) | four, busy core (s) | four / one (≤ 1.5×) |",
             "|---|---|---|---|---|---|---|"]
    for label, r in report["variants"].items():
        q, b = r["quiet"], r["busy core"]
        lines.append(f"| {label} | {q['one_best_s']:.3f} | {q['four_best_s']:.3f} "
                     f"| {q['ratio']:.2f}× | {b['one_best_s']:.3f} | {b['four_best_s']:.3f} "
                     f"| {b['ratio']:.2f}× |")
    from server.cli import DEMO_MODEL

    model = "the demo model" if st["model"] == str(DEMO_MODEL) else st["model"]
    lines += ["", f"{model}, {st['max_tokens']} tokens per request, "
              f"greedy; best of {st['repeats']} after a warm-up. Default here: "
              f"{fp['physical_cores']} thread(s), one per physical core, `--cpu-wait poll`. "
              f"Measured {fp['date_utc']} on {fp['cpu']} ({fp['cpu_count']} CPUs), commit "
              f"{str(fp['git_commit'])[:10]}{' (dirty)' if fp['git_dirty'] else ''}; load "
              f"average {fp['loadavg_at_start'][0]:.2f} at start, "
              f"{fp['loadavg_at_end'][0]:.2f} at end.", "", "```bash", report["command"], "```"]
    return "\n".join(lines)
