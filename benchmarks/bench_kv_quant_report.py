"""The docs/benchmarks.md block and the figure of `benchmarks.bench_kv_quant`: pure
functions of the report dict, kept apart from the measurement."""

from __future__ import annotations

from benchmarks import bench_common as bc


def render(report: dict) -> str:
    """The generated block of docs/benchmarks.md."""
    lines = [bc.environment_line(report, bc.links(report, "bench_kv_quant")[0]), "",
             f"Command: `{report['command']}`", ""]
    cap = report.get("capacity")
    if cap:
        lines += [f"**Capacity**: one pool of {cap['pool_bytes'] / 2**20:.2f} MiB "
                  f"(= {report['settings']['fit']} full bf16 requests of "
                  f"{report['settings']['prompt']} + {report['settings']['gen']} tokens); "
                  f"policy budget {cap['budget_tokens']} tokens.", "",
                  "| policy | dtype | block bytes | blocks | capacity | vs same policy bf16 | "
                  "vs full bf16 | peak running | preemptions | tok/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in cap["rows"]:
            lines.append(f"| {r['policy']} | {r['dtype']} | {r['block_bytes']} | {r['num_blocks']} "
                         f"| {r['capacity']} | {r['capacity_vs_bf16']:.2f}× | "
                         f"{r['capacity_vs_full_bf16']:.2f}× | {r['max_running']} | "
                         f"{r['preemptions']} | {r['tok_per_s']:.1f} |")
        lines.append("")
    qual = report.get("quality")
    if qual and "by_dtype" in qual:
        lines += ["**Quality** (demo model; perplexity and needle accuracy):", "",
                  "| dtype | policy | budget | ppl | vs bf16 | needle |", "|---|---|---|---|---|---|"]
        for dt, q in qual["by_dtype"].items():
            for r in q["rows"]:
                lines.append(f"| {dt} | {r['policy']} | {r['budget']:.0%} | {r['ppl']:.3f} | "
                             f"{r['ppl_vs_bf16']:.4f} | {r['needle_mean']:.0%} |")
        lines.append("")
    elif qual:
        lines += [f"Quality: {qual.get('skipped')}", ""]
    dec = report.get("decode")
    if dec:
        lines += [f"**Decode step** ({dec['batch']} sequences of ~{dec['context']} tokens):", "",
                  "| dtype | mean step (ms) | min (ms) | vs bf16 |", "|---|---|---|---|"]
        for r in dec["rows"]:
            lines.append(f"| {r['dtype']} | {1e3 * r['mean_step_s']:.2f} | "
                         f"{1e3 * r['min_step_s']:.2f} | {r['vs_bf16']:.2f}× |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    cap = report.get("capacity")
    if not cap:
        return
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in cap["rows"])):
        rs = [r for r in cap["rows"] if r["policy"] == policy]
        xs = [j + 0.4 * i for j in range(len(rs))]
        ax.bar(xs, [r["capacity"] for r in rs], width=0.4, label=policy)
        ax.set_xticks([j + 0.2 for j in range(len(rs))], [r["dtype"] for r in rs])
    ax.set_ylabel("requests held at once")
    ax.legend()
    bc.save_figure(fig, path)
