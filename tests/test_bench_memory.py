"""The memory benchmark end to end in --quick mode: it runs, and what it writes adds up.

Speed is never asserted; the numbers come from `python -m benchmarks.bench_memory` and
live in docs/benchmarks.md. A subprocess, because the script pins the OpenMP thread
count in its environment before torch loads.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.bench_quick import run_quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("bench"))
    return out, run_quick("benchmarks.bench_memory", out, "--no-progress")


@pytest.mark.timeout(150)
def test_prefix_hits_and_misses(quick_run: tuple[str, dict]) -> None:
    out, report = quick_run
    with open(os.path.join(out, "bench_memory.json"), encoding="utf-8") as f:
        assert json.load(f) == report
    fp = report["fingerprint"]
    assert fp["torch_threads"] == 1 and "git_commit" in fp and "loadavg_at_end" in fp
    p = report["prefix"]
    n = report["settings"]["prefix_requests"]
    # every hit reused the whole (block-aligned) prefix; a salted miss reused nothing
    assert p["hit"]["prefix_hit_tokens"] == [p["prefix_tokens"]] * n
    assert p["miss"]["prefix_hit_tokens"] == [0] * n
    assert p["prefix_cache_hits_tokens"] == n * p["prefix_tokens"]
    assert p["mean_ratio"] == pytest.approx(p["miss"]["mean_ttft_s"] / p["hit"]["mean_ttft_s"])
    assert len(p["hit"]["ttft_s"]) == len(p["miss"]["ttft_s"]) == n


@pytest.mark.timeout(150)
def test_preemption_and_watermark_runs_add_up(quick_run: tuple[str, dict]) -> None:
    _, report = quick_run
    pr, st = report["pressure"], report["settings"]
    assert pr["num_blocks"] < pr["peak_blocks"]  # the pool really is short
    runs = {**{f"mode {k}": v for k, v in pr["modes"].items()},
            **{f"wm {k}": v for k, v in pr["watermark"].items()}}
    for name, r in runs.items():
        assert r["all_lengths_ok"], name
        assert r["output_tokens"] == pr["workload"]["output_tokens"]
        assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert 0 < r["p50_e2e_s"] <= r["p99_e2e_s"]
        assert 0 < r["max_running"] <= st["requests"]
        total = sum(r["preemptions"].values())
        assert r["preemptions_per_min"] == pytest.approx(total / (r["wall_s"] / 60))
    modes = pr["modes"]
    assert modes["swap"]["preemptions"]["recompute"] == 0 and modes["swap"]["preemptions"]["swap"] > 0
    assert modes["swap"]["swap_bytes"]["out"] > 0
    assert modes["recompute"]["preemptions"]["swap"] == 0
    assert modes["recompute"]["swap_bytes"] == {"out": 0, "in": 0}
    auto = pr["auto"]  # every auto preemption was a cost-model choice (swap space never full)
    assert sum(auto["choices"].values()) == sum(modes["auto"]["preemptions"].values())
    assert [t["tokens"] for t in auto["table"]] == [128, 512, 2048, 8192, 32768]
    assert list(pr["watermark"]) == [f"{w:.2f}" for w in st["watermarks"]]


def test_quick_writes_doc_and_plot_under_out(quick_run: tuple[str, dict]) -> None:
    out, _ = quick_run
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert "## Memory management (issue 4)" in doc and "0.10 (90%)" in doc
    assert "python -m benchmarks.bench_memory --quick" in doc
    with open(os.path.join(out, "bench_memory.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
