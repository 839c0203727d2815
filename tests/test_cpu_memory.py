"""engine/cpu_memory.py: once an engine is built on the CPU, a large buffer freed and
allocated again comes back with its pages mapped (no page faults), and a process whose
malloc the user configured is left alone. Each case runs in a child: mallopt is for the
whole process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import resource, sys, torch
from engine.cpu_memory import keep_freed_memory

def faults():  # minor page faults of writing a fresh 64 MiB buffer
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

faults()
before = faults()
if sys.argv[1] == "engine":
    from scheduler.engine_core import EngineCore, EngineConfig
    from tests.tiny_models import make_tiny_model
    from engine import cpu_memory
    EngineCore(EngineConfig(model=make_tiny_model("llama", sys.argv[2]), num_blocks=64))
    kept = cpu_memory._kept  # the engine's own call, not this child's
else:
    kept = keep_freed_memory()
for _ in range(16):  # the heap grows until it holds it (here 1-9 times)
    faults()
print(before, kept, max(faults() for _ in range(3)))
"""


def _run(mode: str, tmp_path: Path, **env: str) -> tuple[int, bool, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(tmp_path / "m")], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    before, kept, after = out.split()[-3:]
    return int(before), kept == "True", int(after)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
@pytest.mark.parametrize("mode", ["direct", "engine"])
def test_freed_buffers_come_back_mapped(mode: str, tmp_path: Path) -> None:
    before, kept, after = _run(mode, tmp_path)
    assert before > 8000  # 16,384 pages: glibc mapped it afresh each time
    assert kept and after < 500


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_users_malloc_settings_win(tmp_path: Path) -> None:
    before, kept, after = _run("direct", tmp_path, MALLOC_TRIM_THRESHOLD_="1000000")
    assert not kept and before > 8000 and after > 8000
