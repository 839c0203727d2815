"""Where a benchmark number was measured, stored next to the number.

Throughput on CPU depends on the processor, the thread count and the library versions
far more than on anything in the code under test; a result without these cannot be
compared with a later one. Every benchmark in `loadtest/` records this dict in its JSON.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from datetime import datetime, timezone

import torch
import transformers

from engine.cpu_threads import allowed_cpus, physical_cores
from native.cpu import cpuinfo

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_model() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def _simd_flags() -> list[str]:
    """The vector extensions torch's CPU kernels dispatch on (the model name is often
    a generic "Intel Xeon Processor" on virtual machines)."""
    return sorted(set(cpuinfo("flags").split()) & {
        "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def fingerprint() -> dict[str, object]:
    """CPU, core count, thread settings, library versions, git commit and UTC date.

    `git_dirty` matters: a benchmark run from an uncommitted tree measures code that
    the commit hash alone does not identify; `git_diff_sha256` (of `git diff HEAD`)
    then tells two such trees apart.
    """
    status = _git("status", "--porcelain", "--untracked-files=no")
    diff = _git("diff", "HEAD") if status else None
    return {
        "cpu": _cpu_model(),
        "cpu_simd": _simd_flags(),
        "cpu_count": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy_env": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount_env": os.environ.get("GOMP_SPINCOUNT"),
        # what `kvserve serve` picks without --cpu-threads (engine/cpu_threads.py)
        "physical_cores": physical_cores(allowed_cpus()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "git_dirty_files": status.splitlines() if status else [],
        "git_diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
