"""The sampling-features benchmark end to end in --quick mode: it runs every variant at
every batch size and what it writes adds up. Its timings are never asserted here; they
come from `python -m benchmarks.bench_sampling` and live in docs/benchmarks.md."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.bench_sampling import DOC_HEADING, VARIANTS
from tests.bench_quick import run_quick


@pytest.mark.timeout(300)
def test_every_variant_at_every_size(tmp_path) -> None:
    out = str(tmp_path)
    report = run_quick("benchmarks.bench_sampling", out, "--no-progress")
    with open(os.path.join(out, "bench_sampling.json"), encoding="utf-8") as f:
        assert json.load(f) == report
    assert "git_commit" in report["fingerprint"]
    names = [v for v in VARIANTS if v != "grammar" or not report.get("skipped")]
    assert [(r["variant"], r["requests"]) for r in report["rows"]] == [
        (v, n) for n in (2, 4) for v in names]
    for r in report["rows"]:
        assert r["steps"] > 0 and r["tok_per_s"] > 0
        if r["variant"] == "greedy":
            assert r["vs_greedy"] == 1.0
    if report["truncate"]:  # without a compiler there is no op to compare
        assert [(r["vocab"], r["shape"]) for r in report["truncate"]] == [
            (300, "flat"), (300, "peaked")]
        assert all(r["op_s"] > 0 and r["torch_s"] > 0 for r in report["truncate"])
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert DOC_HEADING in doc and "| penalties |" in doc
    assert os.path.exists(os.path.join(out, "bench_sampling.png"))
