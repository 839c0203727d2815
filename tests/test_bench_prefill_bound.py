"""benchmarks/bench_prefill_bound.py --quick: the numbers it publishes hold together."""

from __future__ import annotations

import pytest

from kvpool.manager import MIN_PREFILL_CHUNK
from tests.bench_quick import run_quick


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_quick("benchmarks.bench_prefill_bound", str(tmp_path_factory.mktemp("pb")), "--no-progress")


def test_bounded_policies_hold_bound_plus_one_chunk(report: dict) -> None:
    s, runs = report["settings"], report["runs"]
    assert runs["full"]["peak_live_tokens"] == s["prompt"] + s["gen"] - 1
    for name in ("streaming", "lazy_streaming", "knorm", "paged_eviction", "keydiff", "h2o",
                 "tova", "lazy_eviction", "streaming+shift", "lazy_streaming+shift"):
        r = runs[name]
        assert r["chunk"] == MIN_PREFILL_CHUNK and r["evicted_tokens"] > 0, name
        assert r["peak_live_tokens"] <= 2 * s["budget"] + r["chunk"] < s["prompt"] / 3, name
    for name in ("snapkv", "pyramid"):  # compress the prompt at its end
        assert runs[name]["peak_live_tokens"] >= s["prompt"], name


def test_shift_rows_run_a_prompt_longer_than_their_context(report: dict) -> None:
    s, runs = report["settings"], report["runs"]
    assert runs["streaming+shift"]["context"] == s["short_context"] < s["prompt"]
    assert runs["streaming"]["context"] > s["prompt"]
