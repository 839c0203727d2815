"""benchmarks/bench_heads_ab.py: a policy's per-head and per-layer engines stepped in
turn in one process (issue 65's step cost, paired against the machine's drift)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_heads_ab as bench

TINY = ["--model", "tiny", "--batch", "2", "--prompt", "40", "--gen", "40", "--warm", "6",
        "--steps", "4", "--threads", "1"]


def test_both_orders_of_both_layouts_are_timed_and_saved(tmp_path, capsys) -> None:
    report = bench.main([*TINY, "--policies", "knorm,h2o", "--out", str(tmp_path),
                         "--results", str(tmp_path / "ab.json")])
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["policies"].keys() == {"knorm", "h2o"} and "fingerprint" in saved
    for r in report["policies"].values():
        first, second = r["passes"]
        assert (first["built_first"], second["built_first"]) == ("layer", "head")
        for p in (first, second):
            for way in ("layer", "head"):
                assert 0 < p[way]["forward_ms"] < p[way]["step_ms"]
                assert 0 < p[way]["policy_ms"] < p[way]["step_ms"]  # a plan every step
            assert p["head_over_layer"] == pytest.approx(p["head"]["step_ms"] / p["layer"]["step_ms"])
        assert r["head_over_layer"] == pytest.approx(
            (first["head_over_layer"] * second["head_over_layer"]) ** 0.5)
    assert "| knorm |" in capsys.readouterr().out


def test_a_policy_that_is_not_a_scoring_one_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--policies", "full"])
