"""Host memory facts: how much this process may still allocate, and byte sizes as text.

`available_bytes()` is what the KV pool's automatic size starts from on a CPU (the engine
core reads it after the weights are loaded; attention/sizing.py turns it into blocks):
the smallest of
- `/proc/meminfo`'s `MemAvailable`: what the kernel estimates can be allocated without
  swapping (free memory plus the page cache and slabs it can reclaim);
- the cgroup's headroom where a cgroup sets a memory limit (a container, a Kubernetes
  pod, a systemd slice): cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`, minus
  the cgroup's working set, i.e. its usage less the inactive file cache the kernel
  reclaims before it kills anything (what `kubectl top` and the OOM killer go by: the
  page cache left by reading the weights' files would otherwise count as used). Every
  ancestor of the process's cgroup with a limit is read, and the smallest headroom wins;
- `KVSERVE_MEMORY_LIMIT` (bytes, e.g. `8GiB`) minus this process's resident memory:
  a limit of kvserve's own, read like a container's, for capping what kvserve takes on
  a machine it shares without setting up a cgroup.

Every reader takes `root`, the directory `/proc` and `/sys` are under (`/` on a live
system), so a test can lay out a cgroup's files in a temporary directory. Only the
standard library: the CLI imports this before torch loads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_LIMIT = "KVSERVE_MEMORY_LIMIT"
# cgroup v1 writes "no limit" as 2^63-1 rounded down to a page; v2 writes "max".
_NO_LIMIT = 1 << 62

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {text!r} (e.g. '2GiB', '512MB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n: float) -> str:
    """Bytes for people: '6.2 GiB', under one GiB '48 MiB', under one MiB '192 KiB'."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.0f} KiB"


@dataclass(frozen=True)
class Available:
    """Bytes this process may still allocate, and which limit said so."""

    bytes: int
    source: str  # "MemAvailable" | "cgroup_v2" | "cgroup_v1" | ENV_LIMIT | "unknown"
    seen: dict[str, int] = field(default_factory=dict)  # every limit read: its headroom


def available_bytes(root: str | os.PathLike = "/",
                    environ: Mapping[str, str] | None = None) -> Available:
    """The smallest headroom of MemAvailable, the cgroup's limit and KVSERVE_MEMORY_LIMIT
    (see the module's docstring); never negative. ValueError for an unreadable
    KVSERVE_MEMORY_LIMIT. With none of them (no /proc: not Linux) it is 0 bytes from
    "unknown", and an automatic pool is refused: pass --kv-cache-memory there."""
    env = os.environ if environ is None else environ
    seen: dict[str, int] = {}
    meminfo = meminfo_available(root)
    if meminfo is not None:
        seen["MemAvailable"] = meminfo
    cgroup = cgroup_headroom(root)
    if cgroup is not None:
        seen[cgroup[1]] = cgroup[0]
    limit = env.get(ENV_LIMIT, "").strip()
    if limit:
        try:
            cap = parse_bytes(limit)
        except ValueError:
            raise ValueError(f"{ENV_LIMIT}={limit!r}: not a byte size (e.g. 8GiB)") from None
        seen[ENV_LIMIT] = cap - resident_bytes(root)
    if not seen:
        return Available(0, "unknown", seen)
    source = min(seen, key=lambda k: seen[k])
    return Available(max(0, seen[source]), source, seen)


def meminfo_available(root: str | os.PathLike = "/") -> int | None:
    """`MemAvailable` of `/proc/meminfo`, in bytes (None where there is none)."""
    text = _read(Path(root, "proc/meminfo"))
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def resident_bytes(root: str | os.PathLike = "/") -> int:
    """This process's resident memory (`VmRSS` of `/proc/self/status`), 0 if unknown."""
    text = _read(Path(root, "proc/self/status"))
    m = re.search(r"^VmRSS:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def cgroup_headroom(root: str | os.PathLike = "/") -> tuple[int, str] | None:
    """(limit − working set, which file) of the tightest memory limit on this process's
    cgroup or its ancestors, v2 first, then v1; None where no cgroup sets one."""
    mounts = Path(root, "sys/fs/cgroup")
    v2 = v1 = None
    for line in (_read(Path(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    best: tuple[int, str] | None = None
    if v2 is not None:
        best = _tightest(mounts, v2, "memory.max", "memory.current", "inactive_file",
                         "cgroup_v2")
    if best is None and v1 is not None:
        best = _tightest(mounts / "memory", v1, "memory.limit_in_bytes",
                         "memory.usage_in_bytes", "total_inactive_file",
                         "cgroup_v1")
    return best


def _tightest(mount: Path, path: str, limit_file: str, usage_file: str, inactive: str,
              name: str) -> tuple[int, str] | None:
    """The smallest headroom over `mount/path` and its parents up to `mount` (a
    container often sees its own cgroup as the mount's root, so the directories of a
    path that is not there are skipped)."""
    best: tuple[int, str] | None = None
    rel = Path(path.strip("/"))
    for level in [rel, *rel.parents]:
        d = mount / level
        limit = _int_file(d / limit_file)
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _int_file(d / usage_file) or 0
        m = re.search(rf"^{inactive}\s+(\d+)", _read(d / "memory.stat") or "", re.MULTILINE)
        working = max(0, usage - (int(m.group(1)) if m else 0))
        headroom = limit - working
        if best is None or headroom < best[0]:
            best = (headroom, name)
    return best


def _int_file(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return _NO_LIMIT
    return int(text) if text.isdigit() else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def device_memory(device: object) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device (`torch.cuda.mem_get_info`)."""
    import torch  # here: the host readers above must not load torch

    free, total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
    return int(free), int(total)
