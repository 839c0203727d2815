"""benchmarks/bench_team_wake.py: small ops on one thread against the team, alone and
against a base checkout (native/csrc/team.h, issue 22)."""

from __future__ import annotations

import json

from attention import cpu_attention
from benchmarks import bench_team_wake as bench
from engine.cpu_linear import panels_available


def test_run_writes_json_and_a_table(tmp_path, capsys) -> None:
    report = bench.main(["--rounds", "1", "--cycle-mb", "1", "--threads", "2",
                         "--out", str(tmp_path)])
    (path,) = tmp_path.glob("bench_team_wake-*.json")
    saved = json.loads(path.read_text())
    assert saved["rounds"] == report["rounds"] and "fingerprint" in saved
    got = saved["rounds"][0]["this"]
    want = (2 * len(bench.LINEARS) if panels_available() else 0) + \
        (len(bench.DECODES) if cpu_attention.kernel_available() else 0)
    assert len(got) == want
    for case, times in got.items():
        assert set(times) == {"1", "2"} and all(t > 0 for t in times.values()), case
    out = capsys.readouterr().out
    assert "| op (us a call) | 1 thread | 2 threads |" in out
    assert sum(line.startswith(("| linear ", "| paged decode ")) for line in out.splitlines()) == want


def test_table_reports_base_over_this() -> None:
    this = {"linear 256x384, 1 row": {"1": 50.0, "2": 50.0}}
    base = {"linear 256x384, 1 row": {"1": 50.0, "2": 75.0}}
    text = bench.table({"threads": {"threads": 2},
                        "rounds": [{"this": this, "base": base}] * 3})
    assert "| op (us a call) | 1 thread | 2 threads | 2 threads, base | base / this |" in text
    assert "| linear 256x384, 1 row | 50.0 | 50.0 | 75.0 | 1.50× |" in text
