"""The ratio plot at the top of docs/benchmarks.md is redrawn from the runs it cites."""

from __future__ import annotations

from pathlib import Path

from benchmarks import plot_peer_ratios


def test_every_cited_run_gives_its_ratios_and_the_plot_is_drawn(tmp_path: Path) -> None:
    rows = plot_peer_ratios.ratios()
    assert len(rows) == len(plot_peer_ratios.ROWS)
    for label, values in rows:
        assert all(v is None or v > 0 for v in values), label
        assert values[1] is not None and values[2] is not None  # every row has its HTTP run
    zen4_fp32_defaults = dict(rows)["AMD Zen 4\nfp32, defaults"]
    assert zen4_fp32_defaults[0] is None and 1.1 < zen4_fp32_defaults[2] < 1.3
    out = tmp_path / "ratios.png"
    plot_peer_ratios.main(["--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
