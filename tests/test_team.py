"""kvserve's own intra-op thread team (native/csrc/team.h, issue 22): every index once,
exceptions back to the caller, nested jobs inline, one team a process across libraries, a
forked child that still works, an idle worker that goes to sleep, and a caller that takes
the share of a worker that has not turned up.

The team is compiled from tests/data/team_probe.cpp into two libraries of its own and
driven through ctypes: no op of the engine hides it."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest
import torch

from native import build as native

PROBE = Path(__file__).parent / "data" / "team_probe.cpp"


def _probe(name: str) -> ctypes.CDLL:
    from torch.utils.cpp_extension import _get_build_directory

    flags = ["-O2", native.headers_flag(PROBE)]
    if not native.build(name, PROBE, flags, []):
        pytest.skip("no C++ compiler")
    lib = ctypes.CDLL(str(Path(_get_build_directory(name, verbose=False)) / f"{name}.so"))
    lib.team_address.restype = ctypes.c_void_p
    lib.covers.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.rethrows.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    return lib


@pytest.fixture(scope="module")
def probe() -> ctypes.CDLL:
    return _probe("kvserve_team_probe_a")


@pytest.fixture(autouse=True)
def two_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("n", "grain", "chunks"),
                         [(1, 1, 1), (2, 1, 2), (3, 1, 2), (1000, 1, 2), (1000, 600, 2),
                          (1000, 1000, 1), (1000, 5000, 1), (7, 4, 2)])
def test_parallel_for_hands_out_every_index_once(probe: ctypes.CDLL, n: int, grain: int,
                                                 chunks: int) -> None:
    """at::parallel_for's contract: one contiguous chunk a thread, no thread with less
    than `grain` unless the range is shorter, every index once."""
    for _ in range(50):  # the team is reused job after job
        assert probe.covers(n, grain) == chunks


@pytest.mark.parametrize("tid", [0, 1])
def test_an_exception_reaches_the_caller(probe: ctypes.CDLL, tid: int) -> None:
    """Thrown by the caller's share or by the worker's: rethrown where the job was run
    (an op's TORCH_CHECK becomes a Python error), and the team still works after."""
    out = ctypes.create_string_buffer(64)
    assert probe.rethrows(tid, out, 64) == 1
    assert out.value.decode() == f"thrown by thread {tid}"
    assert probe.covers(1000, 1) == 2


def test_the_caller_takes_a_late_workers_share(probe: ctypes.CDLL) -> None:
    """A share is taken by whichever thread comes first: when the worker sleeps (its
    wake-up takes microseconds), the caller finishes its own share and takes the worker's
    too, instead of waiting. A job whose shares meet at a barrier (`together`) keeps one
    share a thread."""
    stolen = 0
    for _ in range(20):
        time.sleep(0.01)  # past the worker's poll: it sleeps
        stolen += probe.distinct_threads(0) == 1
        time.sleep(0.01)
        assert probe.distinct_threads(1) == 2
    assert stolen > 0


def test_a_job_inside_a_job_runs_on_its_thread(probe: ctypes.CDLL) -> None:
    assert probe.nested() == 2


def test_one_team_a_process_across_libraries(probe: ctypes.CDLL) -> None:
    """Each kvserve library compiles team.h in; its `get()` static is a GNU unique symbol,
    so all share one team (two would poll against each other on the same cores). The
    team has grown to the most threads any job asked for in this process (a test before
    this one may have asked for more than two)."""
    other = _probe("kvserve_team_probe_b")
    assert probe.covers(100, 1) == 2 and other.covers(100, 1) == 2
    assert probe.team_address() == other.team_address()
    assert probe.team_threads() == other.team_threads() >= 2
    assert len(_team_threads()) == probe.team_threads() - 1


def _team_threads() -> list[Path]:
    """The team's workers, by the name each gives itself when it starts (a worker whose
    first share the caller took may not have started yet: waited for, up to 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        named = [t for t in Path("/proc/self/task").iterdir()
                 if (t / "comm").read_text().strip() == "kvserve-team"]
        if named or time.monotonic() > deadline:
            return named
        time.sleep(0.01)


def _cpu_ticks(task: Path) -> int:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def test_an_idle_worker_sleeps(probe: ctypes.CDLL) -> None:
    """A worker polls for ~1 ms after its job (the gaps inside a decode step), then sleeps:
    an idle server burns no core. Over 0.5 s idle the workers used under 50 ms of CPU (one
    that never slept would use the whole 0.5 s)."""
    assert probe.covers(1000, 1) == 2
    workers = _team_threads()
    assert workers
    time.sleep(0.05)
    before = sum(_cpu_ticks(w) for w in workers)
    time.sleep(0.5)
    used = (sum(_cpu_ticks(w) for w in workers) - before) / os.sysconf("SC_CLK_TCK")
    assert used < 0.05, f"idle workers used {used:.3f} s of CPU in 0.5 s"
    for w in workers:
        assert (w / "stat").read_text().rsplit(")", 1)[1].split()[0] == "S"


def test_a_forked_child_builds_its_own_team(probe: ctypes.CDLL) -> None:
    """The parent's worker threads do not exist in a forked child: the child's first job
    starts a team of its own instead of waiting for them forever."""
    assert probe.covers(1000, 1) == 2
    pid = os.fork()
    if pid == 0:  # the child: exit at once, whatever happens
        try:
            os._exit(0 if probe.covers(1000, 1) == 2 and len(_team_threads()) >= 1 else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's job never finished")
