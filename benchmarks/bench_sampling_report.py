"""The docs/benchmarks.md block and the figure of `benchmarks.bench_sampling`: pure
functions of the report dict, kept apart from the measurement."""

from __future__ import annotations

from benchmarks import bench_common as bc


def render(report: dict) -> str:
    s = report["settings"]
    lines = [bc.environment_line(report, bc.links(report, "bench_sampling")[0]), "",
             f"Command: `{report['command']}`", "",
             f"Model {s['model']}, prompts of {s['prompt']} tokens, {s['gen']} generated "
             f"each; median of {s['rounds']} rounds of each variant's mean decode step.", "",
             "| variant | what | requests | step (ms) | × greedy | sampling part (ms) | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['variant']} | {r['what']} | {r['requests']} | {1e3 * r['mean_step_s']:.2f} | "
                     f"{r['vs_greedy']:.2f}× | {1e3 * r['sample_s']:.2f} | {r['tok_per_s']:.0f} |")
    if report.get("truncate"):
        lines += ["", "**Top-p alone** (top_p 0.95; the C++ op against the torch form's sort, "
                  "alternated call by call; median):", "",
                  "| vocabulary | rows | distribution | op (ms) | torch sort (ms) | speed-up |",
                  "|---|---|---|---|---|---|"]
        for r in report["truncate"]:
            lines.append(f"| {r['vocab']} | {r['rows']} | {r['shape']} | {1e3 * r['op_s']:.2f} | "
                         f"{1e3 * r['torch_s']:.2f} | {r['speedup']:.1f}× |")
    if report.get("skipped"):
        lines += ["", report["skipped"]]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    sizes = sorted({r["requests"] for r in report["rows"]})
    names = list(dict.fromkeys(r["variant"] for r in report["rows"]))
    width = 0.8 / max(1, len(sizes))
    for i, n in enumerate(sizes):
        by = {r["variant"]: r["vs_greedy"] for r in report["rows"] if r["requests"] == n}
        ax.bar([j + i * width for j in range(len(names))], [by.get(v, 0) for v in names],
               width=width, label=f"{n} requests")
    ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))],
                  names, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("decode step × greedy")
    ax.legend()
    bc.save_figure(fig, path)
