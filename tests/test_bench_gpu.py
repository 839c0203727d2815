"""benchmarks/bench_gpu.py off the GPU: it refuses to run without CUDA, and its doc block
renders from real runs' JSON (two H200 runs, results/bench_gpu_160m_s23.json and _s26.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import bench_gpu, bench_gpu_report

RESULTS = Path(__file__).resolve().parent.parent / "results" / "bench_gpu_160m_s23.json"
S26 = RESULTS.with_name("bench_gpu_160m_s26.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs for real on CUDA")
def test_refuses_without_cuda() -> None:
    with pytest.raises(SystemExit, match="CUDA"):
        bench_gpu.main(["--quick"])


def test_renders_the_doc_block_from_a_run() -> None:
    report = json.loads(RESULTS.read_text())
    text = bench_gpu_report.render(report)
    assert "NVIDIA H200" in text and report["command"] in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| kvserve") or line.startswith("| pressure")}
    assert "| 3.5× |" in rows["kvserve full graphs"]  # against HF generate
    assert "| 4.0× |" in rows["pressure streaming 128"]  # against pressure full
    assert "| 18,316 |" in rows["kvserve full graphs"]  # 64 / step time
    assert rows["kvserve full graphs"].endswith("| – |")  # before async scheduling
    report["runs"]["kvserve full graphs"].update(overlapped_steps=225, steps=250,
                                                 prefill_tok_s=81234.5, prefill_share=0.41)
    text = bench_gpu_report.render(report)
    assert text.count("| 90% | 81,234 (41%) |") == 1  # overlapped share; prompts' rate


def test_renders_the_kernels_part_and_a_failed_run() -> None:
    """`S26`'s run: the kernels part's two tables follow the runs' table, and a run
    that failed keeps its row with the error (the other rows measured alike)."""
    text = bench_gpu_report.render(json.loads(S26.read_text()))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| ")}
    assert "| 12.0× |" in rows["kvserve full graphs, torch layer ops"]
    assert "| 4.3× |" in rows["pressure streaming 128"]
    assert "failed: NotImplementedError" in rows["kvserve knorm 128 graphs"]
    assert "| 0.511 | 12 | 49% |" in rows["`_attn_kernel`"]
    assert "| 0.0293 | 2,577 |" in rows["torch SDPA, dense K/V"]
    assert text.index("| run |") < text.index("| kernel |") < text.index("| decode attention")
    report = json.loads(S26.read_text())  # a run that timed the replay call's host side
    report["runs"]["kvserve full graphs"]["replay_host_ms"] = 0.042
    assert "| 0.96 (host 0.04) |" in bench_gpu_report.render(report)


def test_torch_layer_ops_row_switches_the_kernels_off_and_back(monkeypatch) -> None:
    from engine import layer_ops

    monkeypatch.delenv("KVSERVE_TRITON_LAYER_OPS", raising=False)
    seen = bench_gpu.torch_layer_ops(lambda: {"ops": layer_ops._triton_ops()})
    assert seen["ops"] is None  # the torch path inside the run
    assert "KVSERVE_TRITON_LAYER_OPS" not in os.environ
    assert layer_ops._triton_ops.cache_info().currsize == 0  # asked again afterwards


def test_general_attention_row_runs_decode_on_the_general_kernel_and_back() -> None:
    """The row's run sees one-token rows routed to `_attn_kernel` (the same call's
    result as `decode=False`), and the decode kernel is the default again after it,
    also when the run fails."""
    pytest.importorskip("triton")
    from attention import triton_attention
    from tests.attention_cases import make_case

    case = make_case([40, 9], [1, 1], bs=8, hq=2, hkv=2)
    general, _ = triton_attention.paged_attention_triton(**case, decode=False)
    seen = bench_gpu.general_attention(lambda: {
        "flag": triton_attention.DECODE_KERNEL,
        "out": triton_attention.paged_attention_triton(**case)[0]})
    assert seen["flag"] is False and torch.equal(seen["out"], general)
    with pytest.raises(RuntimeError):
        bench_gpu.general_attention(lambda: (_ for _ in ()).throw(RuntimeError("run failed")))
    assert triton_attention.DECODE_KERNEL is True
