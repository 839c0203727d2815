"""The quantized-KV benchmark end to end in --quick mode: it runs, and what it writes adds
up. Speed and quality numbers are never asserted here; they come from
`python -m benchmarks.bench_kv_quant` and live in docs/benchmarks.md. One run of every part,
shared by the tests (a run costs a process and a model before any part)."""

from __future__ import annotations

import json
import os

import pytest

from tests.bench_quick import run_quick

DTYPES = ["bfloat16", "int8", "fp8_e4m3", "int4"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("kv_quant"))
    return out, run_quick("benchmarks.bench_kv_quant", out, "--no-progress", "--parts",
                          "capacity,decode,quality")


@pytest.mark.timeout(300)
def test_capacity_and_decode_cover_every_dtype(quick_run: tuple[str, dict]) -> None:
    out, report = quick_run
    with open(os.path.join(out, "bench_kv_quant.json"), encoding="utf-8") as f:
        assert json.load(f) == report
    assert "git_commit" in report["fingerprint"] and "loadavg_at_end" in report["fingerprint"]
    cap = report["capacity"]
    assert [(r["policy"], r["dtype"]) for r in cap["rows"]] == [
        (p, d) for p in ("full", report["settings"]["policy"]) for d in DTYPES]
    for r in cap["rows"]:
        assert r["pool_bytes"] <= cap["pool_bytes"] and r["output_tokens"] > 0
        assert r["capacity"] == r["num_blocks"] // r["request_peak_blocks"]
    by = {(r["policy"], r["dtype"]): r for r in cap["rows"]}
    # the same bytes hold more blocks as the format narrows (scales counted)
    assert by["full", "int4"]["num_blocks"] > by["full", "int8"]["num_blocks"] \
        > by["full", "bfloat16"]["num_blocks"]
    assert by["full", "int8"]["num_blocks"] == by["full", "fp8_e4m3"]["num_blocks"]
    assert [r["dtype"] for r in report["decode"]["rows"]] == DTYPES
    assert all(r["steps"] > 0 for r in report["decode"]["rows"])
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert "## Quantized KV cache (issue 21)" in doc and "| full | int4 |" in doc


@pytest.mark.timeout(300)
def test_quality_covers_every_dtype(quick_run: tuple[str, dict]) -> None:
    _, report = quick_run
    qual = report["quality"]
    if "skipped" in qual:
        pytest.skip(qual["skipped"])
    assert list(qual["by_dtype"]) == DTYPES
    for dt, q in qual["by_dtype"].items():
        assert q["kv_cache_dtype"] == dt
        assert [r["policy"] for r in q["rows"]] == ["full", *report["settings"]["quality_policies"]]
        assert all(r["ppl"] > 1 for r in q["rows"])
    assert all(r["ppl_vs_bf16"] == 1 for r in qual["by_dtype"]["bfloat16"]["rows"])
