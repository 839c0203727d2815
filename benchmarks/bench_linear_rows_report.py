"""The docs/benchmarks.md block and the figure of `benchmarks.bench_linear_rows`: pure
functions of the report dict, kept apart from the measurement."""

from __future__ import annotations

from benchmarks import bench_common as bc

COMMAND = "python -m benchmarks.bench_linear_rows --model 160m --dtypes float32,bfloat16 --threads 2"


def table(report: dict) -> str:
    """Markdown: ms per pass by rows, and packed / panels where both ran."""
    lines = []
    for dtype, by_layout in report["seconds_by_rows"].items():
        names = list(by_layout)
        both = {"packed", "panels"} <= set(names)
        lines += [f"**{report['settings']['model']} {dtype}** (ms for all linear layers)", "",
                  "| rows | " + " | ".join(names) + (" | panels speed-up |" if both else " |"),
                  "|---" * (len(names) + 1 + both) + "|"]
        for m in by_layout[names[0]]:
            cells = [f"{by_layout[n][m] * 1e3:.1f}" for n in names]
            if both:
                cells.append(f"{by_layout['packed'][m] / by_layout['panels'][m]:.2f}x")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """The panels' speed-up over oneDNN's packed weight by rows, one line per dtype."""
    data = {dt: by for dt, by in report["seconds_by_rows"].items() if {"packed", "panels"} <= set(by)}
    if not data:
        return
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for dtype, by in data.items():
        rows = list(by["packed"])
        ax.plot(rows, [by["packed"][m] / by["panels"][m] for m in rows], marker="o", label=dtype)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the step")
    ax.set_ylabel("panels speed-up over oneDNN")
    ax.set_title(f"{report['settings']['model']}: all linear layers, "
                 f"{report['settings']['threads']} threads")
    ax.legend()
    bc.save_figure(fig, path)


def render(report: dict) -> str:
    return "\n".join([bc.environment_line(report, bc.links(report, "bench_linear_rows")[0]), "",
                       table(report), "```bash", COMMAND, "```", "",
                       f"![linear layouts]({bc.links(report, 'bench_linear_rows')[1]})"])
