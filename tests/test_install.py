"""What a CPU install pulls in and prints: serving never imports Triton (whose nanobind
extension prints ~30 lines of "leaked ..." at exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA serving uses Triton")
def test_cpu_serving_never_imports_triton(tmp_path: Path) -> None:
    """Load and run a model the way the server does (AsyncEngine, warm-up, a request),
    in a fresh process: Triton stays unimported and nothing is printed at exit."""
    model = make_tiny_model("llama", tmp_path / "llama")
    code = f"""
import asyncio, sys
import server.app, server.cli
from engine.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig

async def main():
    engine = AsyncEngine.from_config(EngineConfig(model={model!r}, num_blocks=64))
    await engine.start()
    async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=3)):
        pass
    await engine.shutdown()

asyncio.run(main())
print("triton imported:", sorted(m for m in sys.modules if m.split(".")[0] == "triton"))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "triton imported: []" in p.stdout, p.stdout
    assert "nanobind" not in p.stderr, p.stderr[-3000:]
