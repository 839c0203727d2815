"""The C++ ops' AVX2 paths on an AVX-512 CPU. The ops are built with -march=native, so a
suite on an AVX-512 machine would never compile the AVX2 code that CPUs without AVX-512
(AMD Zen 1-3, older Xeons; this project's machines have been both kinds) run, and a suite
on an AVX2 machine runs that code alone. Here the test files of the ops with AVX2 paths
run once more, in one subprocess whose C++ builds add -mno-avx512f (tests/conftest.py,
KVSERVE_TEST_CFLAGS) in a build folder of their own, so the main builds stay cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.spawn import python_path
from tests import isa

ROOT = Path(__file__).parent.parent
# The test files of the ops with AVX2 paths, and a -k for the whole run: a keyword
# matches the module's name too, so "test_cpu_attention" takes that file whole.
FILES = ["tests/test_cpu_attention.py",  # the decode kernel (paged_decode_avx2.h)
         "tests/test_cpu_attention_mass.py",  # ... its mass for the policies
         "tests/test_attention_features.py",  # ... soft-capping and learned sinks
         "tests/test_sampler.py",  # greedy and the exponential race
         "tests/test_policy_select.py",  # the selection's live8 loops
         "tests/test_key_stats.py",  # KeyDiff's 8-lane tiles (key_diversity.h)
         "tests/test_policy_state.py",  # window_ring.h's AVX2 form, lazy_track
         "tests/test_cpu_linear_panels.py",  # the panels' 6-row AVX2 tile (linear_panels.h)
         "tests/test_causal_prefill.py"]  # SDPA where the prefill op has no AVX-512
SELECT = ("test_cpu_attention or test_attention_features or greedy_op or race_op "
          "or native or live_mask or layered or divisor "
          "or key_diversity_equals or returns_the_ops_key_diversity "
          "or window_ring_matches or lazy_track or ranks_by_torchs "
          "or panel_linear_matches or panel_op_refuses or measured_faster "
          "or test_causal_prefill")


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not isa.cpu_has(*isa.AVX512) or "KVSERVE_TEST_CFLAGS" in os.environ,
                    reason="no AVX-512 here: the files' own cases ran on the AVX2 paths")
def test_the_avx2_paths_on_an_avx512_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "KVSERVE_TEST_CFLAGS": "-mno-avx512f",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": python_path()}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *FILES, "-k", SELECT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
