"""The docs/benchmarks.md block and the figure of `benchmarks.bench_prefill_bound`: pure
functions of the report dict, kept apart from the measurement."""

from __future__ import annotations

from typing import Any

from benchmarks import bench_common as bc


def render(report: dict[str, Any]) -> str:
    results_link, plot_link = bc.links(report, "bench_prefill_bound")
    s = report["settings"]
    rows = ["| policy | context | chunk | peak live tokens / layer | × budget | peak blocks | evicted | time (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        rows.append(f"| {name} | {r['context']} | {r['chunk']} | {r['peak_live_tokens']} | "
                    f"{r['peak_live_tokens'] / s['budget']:.2f} | {r['peak_blocks']} | "
                    f"{r['evicted_tokens']} | {r['wall_s']:.1f} |")
    return "\n".join([
        f"One {s['prompt']}-token prompt + {s['gen']} generated tokens, every policy at budget "
        f"{s['budget']} ({report['model']} model; `+shift` rows on a model of {s['short_context']} "
        f"positions, the prompt {s['prompt'] / s['short_context']:.0f}× its context).",
        "", f"`{report['command']}`", "", *rows, "",
        f"![peak live tokens]({plot_link})", "", bc.environment_line(report, results_link)])


def plot(report: dict[str, Any], path: str) -> None:
    plt = bc.pyplot()
    names = list(report["runs"])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(names, [report["runs"][n]["peak_live_tokens"] for n in names], color="tab:blue")
    ax.axhline(report["settings"]["budget"], color="tab:red", ls="--", lw=1, label="budget")
    ax.set_yscale("log")
    ax.set_ylabel("peak live tokens per layer")
    ax.set_title(f"{report['settings']['prompt']}-token prompt")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=35, ha="right")
    bc.save_figure(fig, path)
