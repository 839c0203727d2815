"""benchmarks/bench_base_ab.py: engines of a base checkout and of this tree, each in a
process of its own, stepped in turn over pipes (issue 65's policy share against the
commit before per-head pages). The base side runs as bench_common.checkout_process runs
any checkout (tests/test_bench_step_host.py); here this tree's two layouts stand in for
two sides, since a base checkout would build every C++ op again (minutes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import bench_base_ab as bench

TINY = ["--model", "tiny", "--batch", "2", "--prompt", "40", "--gen", "40", "--warm", "6",
        "--steps", "4", "--threads", "1"]


def test_engines_in_processes_of_their_own_are_stepped_in_turn(tmp_path, capsys) -> None:
    report = bench.main([*TINY, "--ways", "layer,head", "--passes", "2", "--policies", "knorm",
                         "--out", str(tmp_path), "--results", str(tmp_path / "ab.json")])
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["policies"].keys() == {"knorm"} and "fingerprint" in saved
    r = report["policies"]["knorm"]
    assert [p["first"] for p in r["passes"]] == ["layer", "head"]  # the first rotates
    for p in r["passes"]:
        for way in ("layer", "head"):
            assert p[way]["decode_steps"] == 4
            assert 0 < p[way]["forward_ms"] < p[way]["step_ms"]
            assert 0 < p[way]["policy_ms"] < p[way]["step_ms"]  # a plan every step
            assert p[way]["share"] == pytest.approx(p[way]["policy_ms"] / p[way]["step_ms"])
    ratios = [p["head"]["share"] / p["layer"]["share"] for p in r["passes"]]
    assert r["head"]["share_ratio"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    assert "| knorm |" in capsys.readouterr().out


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(bench.ROOT), *args], capture_output=True, text=True,
                          check=True).stdout


def test_a_commit_is_checked_out_in_a_worktree_and_dropped_after(tmp_path) -> None:
    if subprocess.run(["git", "-C", str(bench.ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no commit to check out")
    before = _git("worktree", "list")
    tree = bench._worktree("HEAD", tmp_path)
    try:
        assert _git("-C", tree, "rev-parse", "HEAD") == _git("rev-parse", "HEAD")
        assert (Path(tree) / "pyproject.toml").is_file()
    finally:
        bench._drop_worktree(tree)
    assert _git("worktree", "list") == before and not Path(tree).exists()


def test_an_unknown_way_or_a_policy_that_does_not_score_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--ways", "base,gpu"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--policies", "full"])  # per head it needs a config to set heads in
