"""A model's linear layers at the row counts a server runs, in each CPU layout side by side.

    python -m benchmarks.bench_linear_rows --threads 2 --dtypes float32,bfloat16

Why: engine/cpu_linear.py picks a layout per CPU. oneDNN's prepacked weight
(`PackedLinear`; fewer than `MIN_ROWS` rows padded up to it, because oneDNN's kernels for
one or two rows were slower than its six-row one on an AMD EPYC) or kvserve's 16-column
panels (`PanelLinear`, on CPUs with AVX2 but no AVX-512). Which is faster is a property of
the CPU and of oneDNN's version. This measures one pass over a model's linear layers
(every layer's own weights, so they stream from DRAM as in a step, plus the output
head) per row count and layout, the layouts alternating pass by pass so that drift falls
on both, with the threads waiting as `kvserve serve`'s do (`--cpu-wait poll`: the module
re-executes itself to set them), and writes JSON with the environment fingerprint and a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks import bench_common as bc
from benchmarks.bench_linear_rows_report import plot, render
from loadtest.random_models import MODEL_CONFIGS

NAME = "bench_linear_rows"
DOC_HEADING = "## CPU linear layouts: oneDNN's packed weight and kvserve's panels (issue 22)"


def shapes(model: str) -> list[tuple[int, int, int]]:
    """(in, out, copies): each layer's stacked qkv, o, gate_up, down; the head once."""
    c = MODEL_CONFIGS[model]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    qkv = h + 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    return [(h, qkv, layers), (h, h, layers), (h, 2 * inter, layers), (inter, h, layers),
            (h, c["vocab_size"], 1)]


def layers(model: str, dtype: torch.dtype, layout: str) -> list[torch.nn.Module]:
    """The model's linear layers (random weights) laid out as `layout`: "packed",
    "panels", or "widened-panels" (bf16 panels widened as read, where "panels" would
    hold pairs for bf16 dot products)."""
    from engine.cpu_linear import PackedLinear, PanelLinear

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        if layout == "packed":
            return PackedLinear(linear)
        return PanelLinear(linear, pairs=False) if layout == "widened-panels" else PanelLinear(linear)

    return [make(torch.nn.Linear(i, o, bias=False, dtype=dtype))
            for i, o, n in shapes(model) for _ in range(n)]


def measure(model: str, dtype: torch.dtype, rows: list[int], reps: int,
            layouts: list[str]) -> dict[str, dict[int, float]]:
    """Median seconds of one pass over every layer, per layout and row count."""
    laid = {name: layers(model, dtype, name) for name in layouts}
    out: dict[str, dict[int, float]] = {name: {} for name in layouts}
    with torch.inference_mode():
        for m in rows:
            xs = {i: torch.randn(m, i, dtype=dtype) for i, _, _ in shapes(model)}
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for _ in range(reps + 1):
                for name, mods in laid.items():
                    t = time.perf_counter()
                    for mod in mods:
                        mod(xs[mod.in_features])
                    times[name].append(time.perf_counter() - t)
            for name in layouts:  # the first pass builds oneDNN's state
                out[name][m] = statistics.median(times[name][1:])
    return out


def available_layouts() -> list[str]:
    from engine.cpu_linear import packing_available, panels_available

    return ([*(["packed"] if packing_available(torch.float32) else []),
             *(["panels"] if panels_available() else [])])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_linear_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="160m", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="1,2,4,6,8,12,16,24,32,48,64,128,256,1024")
    p.add_argument("--layouts", default=None,
                   help="packed,panels,widened-panels (default: packed and panels where "
                        "this CPU and torch build have them)")
    p.add_argument("--reps", type=int, default=5)
    bc.add_run_args(p)
    p.set_defaults(threads=2)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.quick:
        a.model, a.rows, a.reps = "tiny", "1,6", 1
    bc.default_paths(a, NAME)
    from loadtest.fingerprint import fingerprint

    # the threads wait as `kvserve serve`'s do (torch's OpenMP sleeps, kvserve's team polls):
    # with OpenMP's own default spin, a oneDNN pass left its threads spinning against the
    # panels' next pass (a 768 x 2,304 bf16 layer at 1-24 rows ran on one core's worth)
    threads = bc.pin_threads(f"benchmarks.{NAME}", a.threads, argv)
    rows = [int(x) for x in a.rows.split(",")]
    layouts = a.layouts.split(",") if a.layouts else available_layouts()
    report: dict = {"benchmark": NAME, "settings": vars(a), "threads": threads,
                    "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
                    "seconds_by_rows": {}}
    for name in a.dtypes.split(","):
        got = measure(a.model, getattr(torch, name), rows, a.reps, layouts)
        report["seconds_by_rows"][name] = got
        for layout, by_rows in got.items():
            print(f"{name} {layout}: " + " ".join(f"{m}:{s * 1e3:.2f}ms"
                                                  for m, s in by_rows.items()), flush=True)
    bc.publish(report, a, NAME, DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
