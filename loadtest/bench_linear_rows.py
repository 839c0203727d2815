"""oneDNN-packed linear layers at small row counts: which bucket is fastest on this CPU.

    python -m loadtest.bench_linear_rows --threads 2 --dtypes float32,bfloat16

Why: `engine.cpu_linear.padded_rows` pads fewer than `MIN_ROWS` rows up to it, because
oneDNN's kernels for one or two rows were slower than its six-row one on the AMD EPYC
this repo runs on. Whether that holds is a property of the CPU and of oneDNN's version:
this measures one pass over a model's linear layers (every layer's own weights, so they
stream from DRAM as in a decode step, plus the output head) at each row count, and
writes JSON with the environment fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from loadtest.bench_common import MODEL_CONFIGS


def shapes(model: str) -> list[tuple[int, int, int]]:
    """(in, out, copies): each layer's stacked qkv, o, gate_up, down; the head once."""
    c = MODEL_CONFIGS[model]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    qkv = h + 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    return [(h, qkv, layers), (h, h, layers), (h, 2 * inter, layers), (inter, h, layers),
            (h, c["vocab_size"], 1)]


def measure(model: str, dtype: torch.dtype, rows: list[int], reps: int) -> dict[int, float]:
    """Median seconds of one pass over every weight, per row count."""
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i).to(dtype), 64)
               for i, o, n in shapes(model) for _ in range(n)]
    out = {}
    with torch.inference_mode():
        for m in rows:
            xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=dtype) for w in weights}
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                for w in weights:
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")
                times.append(time.perf_counter() - t)
            out[m] = statistics.median(times[1:])  # the first pass builds oneDNN's state
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_linear_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="160m", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,12,16,24,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="runs/")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from loadtest.fingerprint import fingerprint

    torch.set_num_threads(a.threads)
    rows = [int(x) for x in a.rows.split(",")]
    report: dict = {"benchmark": "bench_linear_rows", "settings": vars(a),
                    "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
                    "seconds_by_rows": {}}
    for name in a.dtypes.split(","):
        got = measure(a.model, getattr(torch, name), rows, a.reps)
        report["seconds_by_rows"][name] = got
        print(f"{name}: " + " ".join(f"{m}:{s * 1e3:.2f}ms" for m, s in got.items()), flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"bench_linear_rows-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
