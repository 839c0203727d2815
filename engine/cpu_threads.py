"""How many CPU threads the model's ops use, and how they wait: chosen before torch loads.

A server process has two busy Python threads besides torch's own: the event loop (HTTP,
SSE) and the engine worker that steps the model. OpenMP's default waiting is to spin
after every parallel region, so each intra-op thread keeps a core busy between ops and
the HTTP side waits for a time slice: on 2 cores, 4 concurrent requests took 1.8-2.1x
the time of one (5-7x beside another busy process). With passive waiting a finished
intra-op thread sleeps at once, and one thread per physical core is then the fastest
setting we measured (docs/benchmarks.md, "CPU threads"). In a container the count is
capped by the cgroup's CPU limit. Pinning each intra-op thread
to one core was slower as soon as another process used that core (a pinned thread
cannot move away), so pinning is opt-in (`--cpu-bind`), not the default.

OpenMP reads its settings when torch loads it, so `apply` must run before `import
torch`; if torch is already loaded (kvserve used as a library), the thread count still
takes effect through torch, the wait policy does not.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuThreads:
    """The choice, as the start-up log and the benchmark fingerprint record it."""

    threads: int
    source: str  # "default" (physical cores), "--cpu-threads", "OMP_NUM_THREADS"
    bind: list[int] | None  # CPUs the process is confined to; None: left as it was
    physical_cores: int  # in the CPUs the process may run on, at most its cgroup's limit
    wait_policy: str  # OMP_WAIT_POLICY as applied ("PASSIVE" unless the user set one)
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


def plan(threads: int | None, bind: str | None) -> CpuThreads:
    """The choice for `--cpu-threads` / `--cpu-bind` (None: not given); ValueError with
    a message for the user on a bad value."""
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
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE").upper()
    return CpuThreads(n, source, chosen, cores, policy)


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
    """The variables OpenMP (GNU's, and Intel's: KMP_BLOCKTIME) and MKL read at load."""
    n = str(choice.threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OMP_WAIT_POLICY": choice.wait_policy,
            "KMP_BLOCKTIME": os.environ.get("KMP_BLOCKTIME", "0")}


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(cpu - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)
