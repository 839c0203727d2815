"""`kvserve serve` picks its CPU threads itself (engine/cpu_threads.py): the choice is
logged, `--cpu-threads` / `--cpu-bind` override it, bad values exit 2, and with no
thread variables in the environment 4 concurrent requests take little longer than one,
also beside a process that keeps a core busy (issue 22)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engine import cpu_threads
from engine.cpu_threads import (
    allowed_cpus,
    cpu_quota,
    format_cpu_list,
    parse_cpu_list,
    physical_cores,
)
from loadtest.spawn import free_port, python_path
from server.cli import main
from tests.live_server import wait_ready

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("The os module", "import sys", "def read(path):", "class Path:")
# Four concurrent requests against one. The defaults keep this near 1.3x on a quiet
# machine and under 1.5x beside a busy core (benchmarks/bench_threads.py measures it,
# docs/benchmarks.md reports it); OpenMP's spinning threads gave 1.8-2.1x quiet and 5-7x
# busy. The test catches that regression, not the benchmark's figure: a CI run beside
# the busy process spent all its pairs at 1.53x (one 55 ms, four 84 ms).
BOUND = 1.6
BUSY_BOUND = 3.0
THREAD_VARS = cpu_threads.ENV_VARS


def test_cpu_lists_round_trip() -> None:
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5,1, 2") == [1, 2, 5]
    assert format_cpu_list([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    for bad in ("", "a", "3-1", "1-", "-2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_a_container_cpu_limit_caps_the_default(tmp_path: Path) -> None:
    """A pod limited to 2.5 CPUs still sees every CPU of its node in its affinity."""
    limit = tmp_path / "cpu.max"
    limit.write_text("250000 100000\n")
    assert cpu_quota(limit) == 3
    limit.write_text("max 100000\n")
    assert cpu_quota(limit) is None
    assert cpu_quota(tmp_path / "missing") is None


@pytest.mark.parametrize("args, message", [
    (["--cpu-threads", "0"], "--cpu-threads 0: must be at least 1"),
    (["--cpu-bind", "4096"], "CPU(s) [4096] are not available"),
    (["--cpu-bind", "0-x"], "is not a CPU list"),
    (["--cpu-wait", "sometimes"], "invalid choice: 'sometimes'"),
])
def test_bad_thread_options_exit_2_before_loading(args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent/model", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@contextmanager
def served(tmp_path: Path, *args: str) -> Iterator[tuple[str, list[dict], int]]:
    """The demo model from the CLI, as a user starts it: no thread variables at all.
    Yields the URL, the start-up log lines (JSON) read once it is ready and its pid."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / f"server-{port}.log"
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--port", str(port),
             "--no-request-log", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**env, "PYTHONPATH": python_path()})
        try:
            wait_ready(proc, url, log_path)
            lines = [json.loads(x) for x in log_path.read_text().splitlines()
                     if x.startswith("{")]
            yield url, lines, proc.pid
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _completions(url: str, n: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(prompt: str) -> None:
            r = await c.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 32

        t0 = time.perf_counter()
        await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(n)))
        return time.perf_counter() - t0


def _four_over_one(url: str, bound: float, least: int = 5,
                   most: int = 40) -> tuple[float, float]:
    """Best time of one request alone and of four at once (after a warm-up), taking
    pairs until the bests are within the bound or `most` pairs ran: the best is what
    the server can do, the rest is whatever else ran on the (shared) machine. Slow
    spells beside the busy process have outlasted 15 pairs, so up to 40: a passing run
    stops at 5."""
    asyncio.run(_completions(url, 4))
    one, four = [], []
    for i in range(most):
        one.append(asyncio.run(_completions(url, 1)))
        four.append(asyncio.run(_completions(url, 4)))
        if i + 1 >= least and min(four) <= bound * min(one):
            break
    return min(one), min(four)


@contextmanager
def busy_core() -> Iterator[None]:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.serial  # a latency bound: `make test` runs it alone
def test_default_threads_share_the_cpu_with_http(tmp_path: Path) -> None:
    """Issue 22: with OpenMP's defaults (spinning intra-op threads) 4 concurrent
    32-token requests took 1.8-2.1x the time of one, 5-7x beside a busy process; the
    chosen default stays clear of both (the figures themselves: bench_threads)."""
    with served(tmp_path) as (url, lines, _):
        cpu = next(x for x in lines if x.get("msg") == "cpu threads")
        assert cpu["source"] == "default" and cpu["applied_before_torch"], cpu
        assert cpu["threads"] == physical_cores(allowed_cpus()), cpu
        assert cpu["wait"] == "poll" and cpu["bind"] is None, cpu
        one, four = _four_over_one(url, BOUND)
        assert four <= BOUND * one, f"quiet: one {one:.3f} s, four {four:.3f} s"
        with busy_core():
            one, four = _four_over_one(url, BUSY_BOUND)
        assert four <= BUSY_BOUND * one, f"beside a busy process: one {one:.3f} s, four {four:.3f} s"


def test_thread_options_override_the_default(tmp_path: Path) -> None:
    cpus = allowed_cpus()
    with served(tmp_path, "--cpu-threads", "1", "--cpu-bind", str(cpus[0]),
                "--cpu-wait", "spin") as (url, lines, pid):
        cpu = next(x for x in lines if x.get("msg") == "cpu threads")
        assert (cpu["threads"], cpu["source"], cpu["bind"]) == (1, "--cpu-threads", [cpus[0]])
        assert cpu["wait"] == "spin"
        status = Path(f"/proc/{pid}/status").read_text()
        assert f"Cpus_allowed_list:\t{cpus[0]}\n" in status  # every thread inherited it
        for task in Path(f"/proc/{pid}/task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == {cpus[0]}, task.name
        r = httpx.post(url + "/v1/completions", json={"prompt": "import os", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text


def test_the_wait_sets_openmp_and_honours_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """poll (the default): OpenMP's threads sleep at once, kvserve's team polls;
    passive: both sleep at once; spin: GNU OpenMP's spin count bounded (it wins over
    OMP_WAIT_POLICY) and the team polls; a wait variable the user exported is theirs,
    unless it is what kvserve itself sets (a re-executed benchmark, a child server)."""
    for k in THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    poll = cpu_threads.plan(2, None)
    assert poll.wait == "poll"
    sleep = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
             "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
    assert cpu_threads.environment(poll) == {
        **sleep, "KVSERVE_TEAM_SPIN_US": str(cpu_threads.TEAM_POLL_US)}
    passive = cpu_threads.plan(2, None, "passive")
    assert cpu_threads.environment(passive) == {**sleep, "KVSERVE_TEAM_SPIN_US": "0"}
    spin = cpu_threads.plan(2, None, "spin")
    env = cpu_threads.environment(spin)
    assert (env["GOMP_SPINCOUNT"], env["KMP_BLOCKTIME"]) == (str(cpu_threads.SPIN_COUNT), "1")
    assert env["KVSERVE_TEAM_SPIN_US"] == str(cpu_threads.TEAM_POLL_US)
    assert "OMP_WAIT_POLICY" not in env
    for wait in ("poll", "passive"):  # a child started with what the parent's wait set
        with monkeypatch.context() as m:
            for k, v in cpu_threads.environment(cpu_threads.plan(2, None, wait)).items():
                m.setenv(k, v)
            assert cpu_threads.plan(2, None, default_wait="spin").wait == wait
    monkeypatch.setenv("GOMP_SPINCOUNT", str(cpu_threads.SPIN_COUNT))  # a child of ours
    assert cpu_threads.plan(2, None).wait == "spin"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    mine = cpu_threads.plan(2, None)
    assert mine.wait == "environment"
    assert set(cpu_threads.environment(mine)) == {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    assert cpu_threads.plan(2, None, "passive").wait == "passive"  # the option wins


def test_an_offline_run_spins_by_default_and_a_server_sleeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvserve generate` has no HTTP side for the threads to spin against: its default
    is the bounded spin (what GNU OpenMP would do anyway, for 10x longer); `serve`
    polls. The option and the user's variables win over both."""
    from server import cli

    for k in THREAD_VARS:  # recorded, so the test's changes to os.environ are undone
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert cli.threads(args, "spin").wait == "spin"
    assert os.environ["GOMP_SPINCOUNT"] == str(cpu_threads.SPIN_COUNT)
    for k in THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    assert cpu_threads.plan(2, None).wait == "poll"  # serve's default
    assert cli.threads(cli.build_parser().parse_args(["serve"])).wait == "poll"
    for k in THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    assert cpu_threads.plan(2, None, "passive", default_wait="spin").wait == "passive"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cpu_threads.plan(2, None, default_wait="spin").wait == "passive"
