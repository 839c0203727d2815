"""The kept-sets gate (`benchmarks/kept_sets.py`) on a tiny config: a run records one hash
per request and layer after every step, two runs of the same code agree, and a changed
kept set is found (step, request, layer) and fails the comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kept_sets

ARGS = ["--model", "tiny", "--batch", "3", "--prompt", "32", "--gen", "64", "--steps", "12",
        "--policies", "streaming,h2o", "--kv-cache-dtype", "auto"]


@pytest.mark.timeout(300)
def test_runs_agree_and_a_change_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert kept_sets.main([*ARGS, "--out", str(a)]) == 0
    assert kept_sets.main([*ARGS, "--out", str(b)]) == 0
    run = json.loads(a.read_text())
    for name in ("streaming", "h2o"):
        steps = run["policies"][name]
        assert len(steps) == 12
        assert all(len(hashes) == 2 for s in steps for hashes in s.values())  # tiny: 2 layers
        assert len(steps[-1]) == 3  # every request still running
    assert kept_sets.main(["--compare", str(a), str(b)]) == 0
    assert "equal over 12 steps" in capsys.readouterr().out

    steps = run["policies"]["h2o"]
    rid = sorted(steps[7])[1]
    steps[7][rid][1] = "0" * 16
    b.write_text(json.dumps(run))
    assert kept_sets.main(["--compare", str(a), str(b)]) == 1
    assert f"h2o: DIFFERS from step 7 (first request, layer: ('{rid}', 1))" in capsys.readouterr().out
