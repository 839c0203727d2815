"""The C++ ops' vector paths on this CPU (-march=native picks them; tests/test_isa.py
runs the AVX2 ones on an AVX-512 CPU)."""

from __future__ import annotations

import os

from native.cpu import cpuinfo

AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def cpu_has(*flags: str) -> bool:
    have = set(cpuinfo("flags").split())
    return all(f in have for f in flags)


def expected_path() -> str:
    """The vector path -march=native gives the decode kernel here (AVX2 under
    test_isa.py's -mno-avx512f)."""
    if cpu_has(*AVX512) and "-mno-avx512f" not in os.environ.get("KVSERVE_TEST_CFLAGS", "").split():
        return "avx512"
    return "avx2" if cpu_has("avx2", "fma", "f16c") else "portable"

