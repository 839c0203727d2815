"""benchmarks/bench_kv_layout.py: `full` per layer vs per head, both in one run."""

from __future__ import annotations

import json

from benchmarks import bench_kv_layout as bench


def test_quick_run_measures_both_layouts(tmp_path, capsys) -> None:
    """Both layouts, each round, the same generated lengths; a per-head page size of its
    own (`--head-block-size`) reaches the per-head engines and the table says so."""
    out = tmp_path / "runs"
    report = bench.main(["--quick", "--rounds", "1", "--head-block-size", "8", "--no-progress",
                         "--out", str(out), "--results", str(tmp_path / "r.json"),
                         "--plot", str(tmp_path / "p.png")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["block_size"] == {"layer": 16, "head": 8} == report["block_size"]
    for r in saved["rounds"]:
        for layout in bench.LAYOUTS:
            assert r[layout]["offline"]["lengths_ok"] and r[layout]["offline"]["tok_s"] > 0
            assert r[layout]["step"]["4"]["step_ms"] > 0
    # the same bytes, in pages of one (layer, kv head)'s 8 tokens against a layer's 16
    layer, head = saved["pools"]["layer"], saved["pools"]["head"]
    assert head["page_bytes"] * 2 <= layer["page_bytes"]
    assert abs(head["bytes"] - layer["bytes"]) < layer["page_bytes"]
    assert "| offline: 8 requests, useful output tok/s |" in capsys.readouterr().out
    assert "Pages of 16 tokens per layer, 8 per head." in bench.render(report)
    assert (tmp_path / "p.png").stat().st_size > 0
