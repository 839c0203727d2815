"""What every engine benchmark shares (`benchmarks/bench_common.py`): where a run's
outputs go, and waiting for a quiet machine between the systems measured."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from benchmarks import bench_common as bc


@pytest.mark.parametrize("doc", [None, "", "page.md"])
def test_publish_writes_a_doc_only_where_told(tmp_path, monkeypatch, doc: str | None) -> None:
    """A benchmark driver's outputs: the JSON under results/ and the plot under docs/img/
    always; the generated block only into the doc `--doc` names (docs/benchmarks.md is
    the current results page, written from the runs, not a log they append to)."""
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(doc=doc, results=None, plot=None, out="runs", quick=False)
    bc.default_paths(args, "bench_x")
    drawn: list[str] = []
    report = {"benchmark": "bench_x", "fingerprint": {}}
    bc.publish(report, args, "bench_x", "## X", lambda r: "the table",
               lambda r, path: drawn.append(path))
    assert (tmp_path / "results/bench_x.json").is_file()
    assert drawn == ["docs/img/bench_x.png"]
    assert not (tmp_path / "docs/benchmarks.md").exists()
    if doc:
        assert "the table" in (tmp_path / doc).read_text(encoding="utf-8")


def test_settle_waits_while_another_process_holds_a_core() -> None:
    """A system measured right after a peer that still spins (vLLM's OpenMP threads)
    would start on fewer cores: `settle` waits until the CPUs are idle again."""
    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nt = time.time() + 1.0\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.2)  # started and spinning
        # One busy core of N: a share of 1/N, above half of it. At most 2 s: the spinner's
        # second is over by then, and beside another test worker's load the machine is
        # never that quiet, so a longer bound was only waited out in full
        waited = bc.settle(max_s=2.0, window_s=0.1, busy=0.5 / (os.cpu_count() or 1))
    finally:
        busy.wait()
    assert waited >= 0.4
