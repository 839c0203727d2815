"""loadtest/bench_gpu.py off the GPU: it refuses to run without CUDA, and its doc block
renders from a real run's JSON (session 23's H200 run, docs/results/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from loadtest import bench_gpu

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "bench_gpu_160m_s23.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs for real on CUDA")
def test_refuses_without_cuda() -> None:
    with pytest.raises(SystemExit, match="CUDA"):
        bench_gpu.main(["--quick"])


def test_renders_the_doc_block_from_a_run() -> None:
    report = json.loads(RESULTS.read_text())
    text = bench_gpu.render(report)
    assert "NVIDIA H200" in text and report["command"] in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| kvserve") or line.startswith("| pressure")}
    assert "| 3.5× |" in rows["kvserve full graphs"]  # against HF generate
    assert "| 4.0× |" in rows["pressure streaming 128"]  # against pressure full
    assert "| 18,316 |" in rows["kvserve full graphs"]  # 64 / step time


def test_torch_layer_ops_row_switches_the_kernels_off_and_back(monkeypatch) -> None:
    from engine import layer_ops

    monkeypatch.delenv("KVSERVE_TRITON_LAYER_OPS", raising=False)
    seen = bench_gpu.torch_layer_ops(lambda: {"ops": layer_ops._triton_ops()})
    assert seen["ops"] is None  # the torch path inside the run
    assert "KVSERVE_TRITON_LAYER_OPS" not in os.environ
    assert layer_ops._triton_ops.cache_info().currsize == 0  # asked again afterwards
