"""benchmarks/bench_step_host.py: the decode step's host share, alone and against a base
checkout (issue 18's "outside the forward" figure)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import bench_step_host as bench
from benchmarks.bench_common import run_in_checkout

TINY = ["--model", "tiny", "--running", "4", "--steps", "5", "--threads", "1"]


def test_run_writes_json_and_a_table(tmp_path, capsys) -> None:
    report = bench.main([*TINY, "--rounds", "1", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("bench_step_host-*.json")
    saved = json.loads(path.read_text())
    assert saved["rounds"] == report["rounds"] and "fingerprint" in saved
    got = saved["rounds"][0]["this"]
    assert 0 < got["outside_share"] < 1 and 0 < got["forward_ms"] < got["step_ms"]
    # the step's phases account for all of it: outside = planning/advance + sampling + policies
    parts = got["schedule_advance_ms"] + got["sample_ms"] + got["policy_ms"]
    assert abs(parts - got["outside_ms"]) < 1e-3 * got["step_ms"]
    # the runner's preparation is host work inside the forward's time
    assert 0 < got["prepare_ms"] < got["forward_ms"]
    assert got["host_share"] == pytest.approx(
        (got["outside_ms"] + got["prepare_ms"]) / got["step_ms"])
    out = capsys.readouterr().out
    assert "| outside share | " in out and "| host share | " in out


def test_worker_measures_once_into_a_file(tmp_path) -> None:
    out = tmp_path / "w.json"
    assert bench.main([*TINY, "--worker", str(out)]) == {}
    assert set(json.loads(out.read_text())) == {"step_ms", "outside_share", "host_share",
                                                *bench.PARTS}
    assert bench.main([*TINY, "--detokenize", "--worker", str(out)]) == {}  # served requests
    assert 0 < json.loads(out.read_text())["outside_share"] < 1


def test_table_reports_base_over_this() -> None:
    this = dict.fromkeys(("step_ms", *bench.PARTS), 1.0) | {"outside_ms": 0.5, "outside_share": 0.05}
    base = this | {"outside_ms": 1.0, "outside_share": 0.1}
    text = bench.table({"rounds": [{"this": this, "base": base}] * 2})
    assert "| outside ms | 0.500 / 0.500 | 1.000 / 1.000 | 2.00× |" in text
    assert "| outside share | 5.0% / 5.0% | 10.0% / 10.0% | 2.00× |" in text
    older = {k: v for k, v in base.items() if k != "prepare_ms"}  # a checkout without it
    text = bench.table({"rounds": [{"this": this, "base": older}] * 2})
    assert "| prepare ms | 1.000 / 1.000 | — | — |" in text


def test_run_in_checkout_runs_the_script_there(tmp_path, monkeypatch) -> None:
    """The A/B plumbing: the script runs with the other checkout as its working
    directory and first import path, its own extension build directory, and hands back
    the JSON its --worker wrote."""
    base = tmp_path / "base"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "__init__.py").write_text("WHERE = 'base'\n")
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\nimport pkg\n"
        "json.dump({'argv': sys.argv[1:-2], 'where': pkg.WHERE, 'cwd': os.getcwd(),"
        " 'ext': os.environ['TORCH_EXTENSIONS_DIR']}, open(sys.argv[-1], 'w'))\n")
    got = run_in_checkout(str(base), str(script), ["--a", "1"])
    assert got == {"argv": ["--a", "1"], "where": "base", "cwd": str(base),
                   "ext": os.path.join(str(base), ".torch_extensions_bench")}
    # this checkout's side (ab_rounds with a base): a worker too, with the usual build
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "usual"))
    got = run_in_checkout(str(base), str(script), [], own_build=False)
    assert got["ext"] == str(tmp_path / "usual") and got["where"] == "base"
