"""Shared pytest setup."""

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.cpu_threads import ENV_VARS as _THREAD_VARS

# Triton kernels run on CPU through the interpreter; it must be chosen before anything
# imports triton (attention.triton_attention decorates its kernels at import time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Extra flags for every C++ op's build, e.g. -mno-avx512f: how tests/test_isa.py runs test
# files on the AVX2 paths of an AVX-512 CPU (in a subprocess with a build folder of its
# own). `load_ops` calls `build` through the module, so this holds whoever imports it.
if os.environ.get("KVSERVE_TEST_CFLAGS"):
    from native import build as native

    _build, _extra = native.build, os.environ["KVSERVE_TEST_CFLAGS"].split()
    native.build = lambda name, source, cflags, ldflags: _build(
        name, source, [*cflags, *_extra], ldflags)


def _quiet_triton_teardown() -> None:
    """Triton's nanobind extension prints ~30 lines of "nanobind: leaked ..." when the
    interpreter finalizes (a known Triton issue; Triton silences its own workers the same
    way). Tests import Triton (its interpreter tests, and torch's meta-device paths
    when transformers builds the tiny models); kvserve itself does not on CPU
    (tests/test_install.py). Runs after pytest's last line, so no test output is lost."""
    if "triton" in sys.modules:
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


atexit.register(_quiet_triton_teardown)

# The CPU kernel choices' cache (engine/kernel_cache.py) lives in a folder of this run's,
# never the user's ~/.cache, for this process and every server a test starts (they
# inherit the environment). And the choices follow the vendor rules unless a test asks
# for measurement (tests/test_linear_choice.py; or KVSERVE_KERNEL_CHOICE=measure for the
# whole run): a layout timed on a shared 2-core machine can differ from run to run, and
# the tests that compare outputs or name layouts want the same one every time.
_KERNEL_CACHE = tempfile.mkdtemp(prefix="kvserve-test-kernels-")
atexit.register(shutil.rmtree, _KERNEL_CACHE, True)
os.environ["KVSERVE_KERNEL_CACHE"] = os.path.join(_KERNEL_CACHE, "cpu_kernels.json")
os.environ.setdefault("KVSERVE_KERNEL_CHOICE", "vendor")

# Test models are tiny: a second OpenMP thread only adds synchronisation, and on a busy
# 2-core machine it makes every op wait for a descheduled thread.
torch.set_num_threads(1)


@pytest.fixture
def choice_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CPU kernel-choice cache of the test's own (in tmp_path), and measurement the
    default instead of the vendor rules (tests/test_linear_choice.py, test_moe_panels.py)."""
    path = tmp_path / "kernels" / "cpu_kernels.json"
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(path))
    monkeypatch.delenv("KVSERVE_KERNEL_CHOICE", raising=False)
    return path


@pytest.fixture(autouse=True)
def _threads_as_they_were() -> Iterator[None]:
    """Each test leaves torch's thread count, OpenMP's variables and the CPU affinity as
    it found them. Why: code under test sets them for the whole process
    (`cpu_threads.apply`, as `kvserve serve` and the benchmarks' `pin_threads` do), and
    a test that called it left its pytest worker on two spinning OpenMP threads beside
    the other worker's on 2 cores: every later test of that worker ran 4-8x slower
    (test_policies_engine.py's files took 70 s where they take 12)."""
    threads = torch.get_num_threads()
    env = {k: os.environ.get(k) for k in _THREAD_VARS}
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        elif os.environ.get(k) != v:
            os.environ[k] = v
    if affinity is not None and os.sched_getaffinity(0) != affinity:
        os.sched_setaffinity(0, affinity)
