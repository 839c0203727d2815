"""The docs/benchmarks.md blocks and the figures of `benchmarks.bench_prefill_attention`
(over the chunk's own keys, or after a cached prefix): pure functions of the report
dict, kept apart from the measurement."""

from __future__ import annotations

from benchmarks import bench_common as bc
from loadtest.random_models import MODEL_CONFIGS

COMMAND = "python -m benchmarks.bench_prefill_attention --model 160m --lengths 128,512,1024,2048"


def flops(model: str, t: int, prefix: int = 0) -> float:
    c = MODEL_CONFIGS[model]
    hq = c["num_attention_heads"]
    d = c["hidden_size"] // hq
    return 2.0 * 2 * hq * d * t * (prefix + (t + 1) / 2)  # QK^T and PV: the prefix, the causal half


def table(report: dict) -> str:
    model, prefix = report["settings"]["model"], report["settings"].get("prefix", 0)
    after = f", after {prefix} cached tokens" if prefix else ""
    torch_way = "gather + SDPA" if prefix else "SDPA"
    lines = []
    for dtype, by_way in report["seconds_by_length"].items():
        lines += [f"**{model} {dtype}**, one layer{after} (ms; GFLOP/s)", "",
                  f"| prompt tokens | kvserve | {torch_way} | kvserve speed-up |", "|---|---|---|---|"]
        for t, s in by_way["kvserve"].items():
            sd = by_way["sdpa"][t]
            g = flops(model, int(t), prefix) / 1e9
            lines.append(f"| {t} | {s * 1e3:.2f} ({g / s:.0f}) | {sd * 1e3:.2f} ({g / sd:.0f}) "
                         f"| {sd / s:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for dtype, by in report["seconds_by_length"].items():
        ts = list(by["kvserve"])
        ax.plot([int(t) for t in ts], [by["sdpa"][t] / by["kvserve"][t] for t in ts],
                marker="o", label=dtype)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    prefix = report["settings"].get("prefix", 0)
    ax.set_xlabel("prompt tokens" + (f" after {prefix} cached" if prefix else ""))
    ax.set_ylabel("speed-up over the torch path")
    ax.set_title(f"{report['settings']['model']}: causal prefill attention, one layer")
    ax.legend()
    bc.save_figure(fig, path)


def render(report: dict) -> str:
    prefix = report["settings"].get("prefix", 0)
    results, img = bc.links(report, "bench_prefill_attention" + ("_prefix" if prefix else ""))
    command = (f"python -m benchmarks.bench_prefill_attention --model 160m --lengths 128,512,1024 "
               f"--prefix {prefix}") if prefix else COMMAND
    return "\n".join([bc.environment_line(report, results), "", table(report), "```bash",
                      command, "```", "", f"![prefill attention]({img})"])
