"""How many CPU threads the model's ops use, and how they wait: chosen before torch loads.

A server process has two busy Python threads besides torch's own: the event loop (HTTP,
SSE) and the engine worker that steps the model. One intra-op thread per physical core
is the fastest count we measured (docs/benchmarks.md, "CPU threads"); in a container it
is capped by the cgroup's CPU limit.

How a thread waits after its share of an op is the trade-off. OpenMP's default spins
for ~15 ms (GOMP_SPINCOUNT 300,000), so an idle server keeps every core busy and a
request beside another busy process took seconds (a spinning thread holds its core
while the partner it waits for has no core at all). Passive waiting (sleep at once)
is safe there but costs a futex wake-up at each of a decode step's ~60 parallel
regions, which on a VM whose idle vCPUs halt is also a host wake-up: 10-20% of a 160M
model's decode step. Every kernel of kvserve's own (the linear layers' panels, decode
attention, the layer ops, sampling) runs on kvserve's own team (native/csrc/team.h),
whose threads poll for `TEAM_POLL_US` (1 ms) after a job, yielding their core to any
thread that wants it, then sleep. `poll`, serve's default, is that team with torch's
own OpenMP threads (oneDNN's GEMMs, prefill attention) sleeping at once; `passive`
makes the team sleep at once too (as every thread did before commit 67e5891); `spin` adds
OpenMP's spin for GOMP_SPINCOUNT `SPIN_COUNT` (~1.5 ms), which helps where torch's
ops matter (bf16 layers on oneDNN) but beside another CPU-bound process made a request
3.6x slower than passive waiting. An offline run (`kvserve generate`) has no HTTP side
and usually owns its cores, so spin is its default (`plan(default_wait=...)`): ~190%
CPU on 2 cores against 150-170% passive, 10-25% more tokens per second on the 160M
model. Where the team sleeps at once, the kernels keep small calls on the calling
thread (team.h reads the same environment).

Pinning each intra-op thread to one core was slower as soon as another process used
that core (a pinned thread cannot move away), so pinning is opt-in (`--cpu-bind`).

OpenMP reads its settings when torch loads it, so `apply` must run before `import
torch`; if torch is already loaded (kvserve used as a library), the thread count still
takes effect through torch, OpenMP's wait does not (kvserve's team reads its own at its
first job).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")
# GNU OpenMP's spin before a waiting thread sleeps, in its unit (one `pause` loop: ~50 ns
# on the Xeons measured). OpenMP's own default is 300,000.
SPIN_COUNT = 30_000
# How long kvserve's own team (native/csrc/team.h) polls for its next job before it sleeps,
# in microseconds, for `poll` and `spin`: longer than the gaps between a decode step's ops.
TEAM_POLL_US = 1000
WAITS = ("poll", "spin", "passive")
# Every variable `environment` may set: what a child that must start as a user's would
# (a benchmark's server, a peer with settings of its own) has removed.
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
            "KMP_BLOCKTIME", "KVSERVE_TEAM_SPIN_US")


@dataclass(frozen=True)
class CpuThreads:
    """The choice, as the start-up log and the benchmark fingerprint record it."""

    threads: int
    source: str  # "default" (physical cores), "--cpu-threads", "OMP_NUM_THREADS"
    bind: list[int] | None  # CPUs the process is confined to; None: left as it was
    physical_cores: int  # in the CPUs the process may run on, at most its cgroup's limit
    # "poll" (kvserve's team polls TEAM_POLL_US yielding its core, OpenMP's sleeps at
    # once), "spin" (both spin: GOMP_SPINCOUNT=SPIN_COUNT, then sleep), "passive" (both
    # sleep at once), or "environment" (the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT)
    wait: str
    applied_before_torch: bool = True

    def fields(self) -> dict[str, object]:
        return asdict(self)


def allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int:
    """Distinct (package, core) pairs among `cpus`: SMT siblings share one core's
    arithmetic units, so a second intra-op thread on a sibling mostly adds waiting."""
    cores = set()
    for cpu in cpus:
        topo = _SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology (containers, non-Linux): one each
    return max(1, len(cores))


def cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """The CPUs a cgroup v2 limit allows, rounded up (a container's CPU limit: its
    affinity still lists every CPU of the node), or None without a limit."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, -(-int(quota) // int(period)))


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (the format of taskset -c and /sys cpulists)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like 0-3,6")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{part.strip()!r}: the range runs backwards")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def plan(threads: int | None, bind: str | None, wait: str | None = None,
         default_wait: str = "poll") -> CpuThreads:
    """The choice for `--cpu-threads` / `--cpu-bind` / `--cpu-wait` (None: not given);
    ValueError with a message for the user on a bad value. `default_wait` is the wait
    when neither the option nor the environment says: poll for a server, spin for an
    offline run (`kvserve generate`), which has no HTTP side to spin against."""
    cpus = allowed_cpus()
    chosen: list[int] | None = None
    if bind is not None and bind.strip().lower() != "none":
        chosen = parse_cpu_list(bind)
        missing = sorted(set(chosen) - set(cpus))
        if missing:
            raise ValueError(f"--cpu-bind {bind}: CPU(s) {missing} are not available to "
                             f"this process (it may use {format_cpu_list(cpus)})")
        cpus = chosen
    cores = physical_cores(cpus)
    quota = cpu_quota()
    cores = min(cores, quota) if quota else cores
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--cpu-threads {threads}: must be at least 1")
        n, source = threads, "--cpu-threads"
    elif env.isdigit() and int(env) >= 1:
        n, source = int(env), "OMP_NUM_THREADS"
    else:
        n, source = cores, "default"
    if wait is not None and wait not in WAITS:
        raise ValueError(f"--cpu-wait {wait}: use one of {', '.join(WAITS)}")
    return CpuThreads(n, source, chosen, cores, wait or _wait_from_env(default_wait))


def _wait_from_env(default: str) -> str:
    """`default` where the environment holds no wait; 'poll', 'spin' or 'passive' where it
    holds exactly what `environment` sets for it (a re-executed benchmark, a child server),
    else 'environment' (the user's own)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    spin = os.environ.get("GOMP_SPINCOUNT", "")
    team = os.environ.get("KVSERVE_TEAM_SPIN_US", "")
    if not policy and not spin:
        return default
    if policy in ("", "PASSIVE") and spin in ("", "0"):
        return "poll" if team == str(TEAM_POLL_US) else "passive"
    if not policy and spin == str(SPIN_COUNT):
        return "spin"
    return "environment"


def apply(choice: CpuThreads) -> CpuThreads:
    """Confine the process, set OpenMP's environment and torch's thread count. Call it
    before any other thread starts (they inherit the affinity) and before `import torch`
    (OpenMP reads its environment once, when torch loads it)."""
    if choice.bind is not None:
        os.sched_setaffinity(0, choice.bind)
    before_torch = "torch" not in sys.modules
    os.environ.update(environment(choice))
    import torch

    torch.set_num_threads(choice.threads)
    if not before_torch:
        choice = CpuThreads(**{**asdict(choice), "applied_before_torch": False})
    return choice


def environment(choice: CpuThreads) -> dict[str, str]:
    """The variables OpenMP (GNU's; Intel's KMP_BLOCKTIME, in ms) and MKL read at load."""
    n = str(choice.threads)
    env = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
    if choice.wait == "spin":  # GOMP_SPINCOUNT wins over an OMP_WAIT_POLICY in libgomp
        env.update(GOMP_SPINCOUNT=str(SPIN_COUNT), KMP_BLOCKTIME="1",
                   KVSERVE_TEAM_SPIN_US=str(TEAM_POLL_US))
    elif choice.wait in ("passive", "poll"):
        env.update(OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="0", KMP_BLOCKTIME="0",
                   KVSERVE_TEAM_SPIN_US=str(TEAM_POLL_US if choice.wait == "poll" else 0))
    return env


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(cpu - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)
