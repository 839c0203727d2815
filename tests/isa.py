"""The C++ ops' vector paths on this CPU, and running a test file on the AVX2 paths of
an AVX-512 CPU: the ops are built with -march=native, so a suite on an AVX-512 machine
would never compile the AVX2 code that CPUs without AVX-512 (AMD Zen 1-3, older Xeons;
this project's machines have been both) run, and one on an AVX2 machine runs it alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.native import cpuinfo

AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
ROOT = Path(__file__).parent.parent


def cpu_has(*flags: str) -> bool:
    have = set(cpuinfo("flags").split())
    return all(f in have for f in flags)


def expected_path() -> str:
    """The vector path -march=native gives the decode kernel here (under the extra flags
    of a `without_avx512` run)."""
    if cpu_has(*AVX512) and "-mno-avx512f" not in os.environ.get("KVSERVE_TEST_CFLAGS", "").split():
        return "avx512"
    return "avx2" if cpu_has("avx2", "fma", "f16c") else "portable"


without_avx512 = pytest.mark.skipif(
    not cpu_has(*AVX512) or "KVSERVE_TEST_CFLAGS" in os.environ,
    reason="no AVX-512 here: the file's own cases ran on the AVX2 paths")


def run_without_avx512(test_file: str, tmp_path: Path, *select: str) -> None:
    """Run `test_file` (its tests matching the -k `select`, if any) in a subprocess whose
    C++ ops are built with -mno-avx512f into a folder of their own (the main builds stay
    cached); fails with the output's tail if any test fails."""
    env = {**os.environ, "KVSERVE_TEST_CFLAGS": "-mno-avx512f",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file]
    if select:
        cmd += ["-k", " or ".join(select)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
