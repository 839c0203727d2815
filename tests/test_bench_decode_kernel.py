"""benchmarks/bench_decode_kernel.py: the kernel's A/B benchmark measures and reports."""

from __future__ import annotations

import json

import pytest
import torch

from attention import cpu_attention
from attention.torch_attention import paged_attention
from benchmarks import bench_decode_kernel as bench

needs_kernel = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                  reason="no C++ compiler for the decode kernel")


def test_decode_case_is_a_valid_decode_batch() -> None:
    """The benchmark's pools are what the engine hands the kernel: every sequence's n
    tokens visible, blocks shuffled; the torch path and the kernel agree on it."""
    case = bench.decode_case(3, 37, 4, 2, 16, torch.float32, seed=0)
    assert case["table"].unique().numel() == case["table"].numel()  # no block twice
    assert (case["slot_pos"] >= 0).sum(dim=1).tolist() == [37, 37, 37]
    if cpu_attention.kernel_available():
        want, _ = paged_attention(**case)
        got, _ = cpu_attention.paged_attention_cpu(**case)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_run_writes_json_and_a_table(tmp_path, capsys) -> None:
    report = bench.main(["--shapes", "2x40,3x20", "--layers", "2", "--calls", "1",
                         "--rounds", "1", "--model", "3m", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("bench_decode_kernel-*.json")
    saved = json.loads(path.read_text())
    assert saved["rounds"] == report["rounds"] and "fingerprint" in saved
    rows = saved["rounds"][0]["this"]
    assert [(r["seqs"], r["tokens"]) for r in rows] == [(2, 40), (3, 20)]
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in rows)
    assert "| 2 × 40 |" in capsys.readouterr().out


@needs_kernel
def test_key_diversity_columns(tmp_path, capsys) -> None:
    """`--key-diversity`: the kernel with KeyDiff's scores and the pool's op alone, timed
    in the same rounds as attention alone, each a column of the table."""
    report = bench.main(["--shapes", "2x40", "--layers", "2", "--calls", "2", "--rounds", "1",
                         "--model", "3m", "--key-diversity", "--out", str(tmp_path)])
    (row,) = report["rounds"][0]["this"]
    assert row["kd_median_ms"] > 0 and row["op_median_ms"] > 0
    out = capsys.readouterr().out
    assert "KeyDiff op alone" in out and "| 2 × 40 |" in out


def test_table_reports_base_over_this() -> None:
    row = {"seqs": 8, "tokens": 400, "mib_per_layer": 9.4, "min_ms": 1.0}
    report = {"rounds": [{"this": [{**row, "median_ms": 2.0}], "base": [{**row, "median_ms": 3.0}]},
                         {"this": [{**row, "median_ms": 2.0}], "base": [{**row, "median_ms": 3.0}]}]}
    assert "| 8 × 400 | 9.4 | 2.000 / 2.000 | 3.000 / 3.000 | 1.50× |" in bench.table(report)


def test_linear_rows_benchmark_measures_every_row_count(tmp_path) -> None:
    """benchmarks/bench_linear_rows.py (the measurement behind cpu_linear's layouts and
    MIN_ROWS): one pass over the model's weights per row count and layout, JSON with the
    fingerprint, a markdown table with the ratio where both layouts ran."""
    from benchmarks import bench_linear_rows

    layouts = bench_linear_rows.available_layouts()
    if not layouts:
        pytest.skip("neither oneDNN prepacking nor the panel kernel here")
    assert bench_linear_rows.shapes("3m") == [(256, 384, 4), (256, 256, 4), (256, 1376, 4),
                                              (688, 256, 4), (256, 4096, 1)]
    report = bench_linear_rows.main(["--quick", "--dtypes", "float32", "--threads", "1",
                                     "--out", str(tmp_path)])
    got = report["seconds_by_rows"]["float32"]
    assert list(got) == layouts
    assert all(set(by) == {1, 6} and all(t > 0 for t in by.values()) for by in got.values())
    md = (tmp_path / "benchmarks.md").read_text()
    assert md.count("\n| 6 |") == 1 and ("speed-up" in md) == (len(layouts) == 2)
    assert (tmp_path / "bench_linear_rows.png").exists() == (len(layouts) == 2)
    path = tmp_path / "bench_linear_rows.json"
    assert "fingerprint" in json.loads(path.read_text())


@pytest.mark.parametrize("prefix", [0, 37])
def test_prefill_attention_benchmark_times_both_ways(tmp_path, prefix: int) -> None:
    """benchmarks/bench_prefill_attention.py: the op and the torch path per prompt length,
    over the chunk's own keys or after a cached prefix (its own doc block and files),
    GFLOP/s and the ratio in the table, JSON with the fingerprint, the plot."""
    from attention.cpu_attention import vector_path
    from benchmarks import bench_prefill_attention

    if vector_path() != "avx512":
        pytest.skip("the causal_prefill op runs on AVX-512 builds only")
    report = bench_prefill_attention.main(["--quick", "--dtypes", "float32,bfloat16",
                                           "--threads", "1", "--out", str(tmp_path),
                                           "--prefix", str(prefix)])
    for by_way in report["seconds_by_length"].values():
        assert all(set(by) == {17, 40} and all(t > 0 for t in by.values()) for by in by_way.values())
    name = "bench_prefill_attention" + ("_prefix" if prefix else "")
    md = (tmp_path / "benchmarks.md").read_text()
    assert md.count("\n| 40 |") == 2 and "speed-up" in md
    assert (f"after {prefix} cached tokens" in md) == bool(prefix)
    assert ("gather + SDPA" in md) == bool(prefix)
    assert (tmp_path / f"{name}.png").exists()
    assert "fingerprint" in json.loads((tmp_path / f"{name}.json").read_text())


def test_linear_rows_lays_bf16_out_widened_or_in_pairs() -> None:
    """bench_linear_rows' layouts: "widened-panels" keeps bf16 panels widened as read
    where "panels" holds pairs (on a CPU with bf16 dot products)."""
    from benchmarks import bench_linear_rows
    from engine import cpu_linear

    if not cpu_linear.panels_available():
        pytest.skip("no vector panel kernel here")
    widened = bench_linear_rows.layers("tiny", torch.bfloat16, "widened-panels")
    laid = bench_linear_rows.layers("tiny", torch.bfloat16, "panels")
    assert len(widened) == len(laid) == 9 and not any(m.pairs for m in widened)
    assert all(m.pairs == (cpu_linear.panels_isa() == "avx512_bf16") for m in laid)


def test_per_head_case_is_the_same_attention() -> None:
    """`--per-head`: the same queries over a per-head pool (a page one kv head's tokens,
    kv head h of sequence b the sequence h·B + b), its pages filled with the per-layer
    pool's K/V, give the per-layer case's output regrouped as the runner's `heads_out`."""
    from engine.attention_groups import heads_out

    case = bench.decode_case(3, 37, 4, 2, 16, torch.float32, seed=0)
    head = bench.per_head_case(case, 2, 8, seed=1)
    assert head["q"].shape == (6, 1, 2, 16) and head["table"].shape == (6, 5)
    for kv in ("k_cache", "v_cache"):
        for row in range(6):
            h, b = divmod(row, 3)
            for j in range(37):
                page, o = head["table"][row, j // 8], j % 8
                src = case["table"][b, j // 16]
                head[kv][page, o, 0] = case[kv][src, j % 16, h]
    want, _ = paged_attention(**case)
    got, _ = paged_attention(**head)
    torch.testing.assert_close(heads_out(got, 2), want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_per_head_columns(tmp_path, capsys) -> None:
    report = bench.main(["--shapes", "2x40", "--layers", "2", "--calls", "1", "--rounds", "1",
                         "--model", "3m", "--per-head", "16,32", "--out", str(tmp_path)])
    (row,) = report["rounds"][0]["this"]
    assert row["head16_median_ms"] > 0 and row["head32_median_ms"] > 0
    assert "per head, 32-token pages" in capsys.readouterr().out
