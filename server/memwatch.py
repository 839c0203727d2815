"""Memory diagnostics: where does the process's RSS go?

`KVSERVE_MEMDEBUG=SECONDS[,tracemalloc][,trim]` starts a daemon thread that logs, every
SECONDS, one `memwatch` line (logger `kvserve.memory`, level warning so it shows under
`--log-level warning`) with:

- `rss_mib`: the process's resident set (/proc/self/status);
- glibc's view of the C heap (`mallinfo2`, all arenas): `heap_in_use_mib` (what
  malloc handed out and was not freed), `heap_free_mib` (freed but still held by
  malloc: fragmentation and untrimmed arena tops), `heap_mib` (both), `mmap_mib` (large
  allocations served by mmap, returned to the OS on free), and `arenas`: [MiB held,
  MiB free] per malloc arena, the main thread's first (each thread that allocates,
  e.g. the engine worker, gets an arena of its own);
- `gc_objects` (frozen start-up objects excluded) and the types whose count grew most;
- with `tracemalloc`: the Python heap's traced size and the source lines whose
  allocations grew most (tracemalloc slows Python code down; for diagnosis only);
- with `trim`: `malloc_trim(0)` after each line, its duration and the RSS after it —
  how much of the RSS was memory the program had already freed.

This separates a Python-level leak (object counts and traced bytes climb) from native
growth (heap_in_use climbs with flat Python counts) and from allocator retention
(heap_free climbs: memory freed by the program but not given back to the OS). Why it
exists: docs/memory.md, "Process memory".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import re
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from typing import Any

logger = logging.getLogger("kvserve.memory")
MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


LIBC = _libc()


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size of a process (this one by default), or None off Linux."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tree_rss_bytes(pid: int) -> int | None:
    """RSS of a process and all its descendants (with `--engine-layout process` the
    model lives in a child of the server), or None off Linux."""
    total = rss_bytes(pid)
    if total is None:
        return None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return total
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        total += sum(tree_rss_bytes(c) or 0 for c in children)
    return total


def malloc_stats() -> dict[str, Any]:
    """glibc heap totals over all arenas in MiB (empty without glibc's mallinfo2)."""
    fn = getattr(LIBC, "mallinfo2", None)
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    m = fn()
    raw = {"heap_in_use_mib": m.uordblks, "heap_free_mib": m.fordblks, "mmap_mib": m.hblkhd,
           "heap_mib": m.arena}
    out: dict[str, Any] = {k: round(v / MIB, 1) for k, v in raw.items()}
    arenas = arena_stats()
    if arenas is not None:
        out["arenas"] = arenas
    return out


def arena_stats() -> list[tuple[float, float]] | None:
    """(MiB the arena holds from the OS, MiB of it free) per malloc arena, main first,
    from malloc_info's XML; None without glibc."""
    if LIBC is None or not hasattr(LIBC, "malloc_info"):
        return None
    LIBC.fopen.restype = ctypes.c_void_p
    LIBC.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    LIBC.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as tmp:
        fp = LIBC.fopen(tmp.name.encode(), b"w")
        if not fp:
            return None
        LIBC.malloc_info(0, fp)
        LIBC.fclose(fp)
        xml = tmp.read()
    out = []
    for heap in xml.split("<heap nr=")[1:]:
        heap = heap.split("</heap>")[0]
        free = sum(int(m) for m in re.findall(r'<total type="(?:fast|rest)" count="\d+" '
                                               r'size="(\d+)"', heap))
        cur = re.search(r'<system type="current" size="(\d+)"', heap)
        out.append((round(int(cur.group(1)) / MIB, 1) if cur else 0.0, round(free / MIB, 1)))
    return out


class MemoryWatch:
    """The KVSERVE_MEMDEBUG logger thread (see the module docstring)."""

    def __init__(self, every_s: float, trace: bool = False, top: int = 8,
                 trim: bool = False) -> None:
        self.every_s, self.trace, self.top, self.trim = every_s, trace, top, trim
        self._stop = threading.Event()
        self._types: Counter[str] = Counter()
        self._snap: tracemalloc.Snapshot | None = None

    @classmethod
    def from_env(cls, value: str | None = None) -> MemoryWatch | None:
        value = os.environ.get("KVSERVE_MEMDEBUG", "") if value is None else value
        if not value.strip():
            return None
        parts = [p.strip() for p in value.split(",")]
        return cls(float(parts[0] or 60), trace="tracemalloc" in parts[1:],
                   trim="trim" in parts[1:])

    def start(self) -> MemoryWatch:
        if self.trace and not tracemalloc.is_tracing():
            tracemalloc.start(8)
        threading.Thread(target=self._loop, name="kvserve-memwatch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.log_once()
            except Exception:  # diagnostics must never take the server down
                logger.exception("memwatch failed")

    def sample(self) -> dict[str, Any]:
        """One line's fields."""
        rss = rss_bytes()
        fields: dict[str, Any] = {"rss_mib": round(rss / MIB, 1) if rss else None,
                                  **malloc_stats()}
        types = Counter(type(o).__name__ for o in gc.get_objects())
        fields["gc_objects"], fields["gc_frozen"] = sum(types.values()), gc.get_freeze_count()
        grew = (types - self._types).most_common(self.top) if self._types else []
        fields["gc_grew"] = dict(grew)
        self._types = types
        if self.trace and tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            fields["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / MIB, 1)
            if self._snap is not None:
                diff = snap.compare_to(self._snap, "lineno")[: self.top]
                fields["traced_grew"] = [f"{d.traceback[0].filename.rsplit('/', 2)[-1]}:"
                                         f"{d.traceback[0].lineno} {d.size_diff / 1024:+.0f}KiB"
                                         f" n={d.count_diff:+d}" for d in diff]
            self._snap = snap
        return fields

    def log_once(self) -> dict[str, Any]:
        fields = self.sample()
        if self.trim and LIBC is not None:
            t0 = time.perf_counter()
            LIBC.malloc_trim(0)
            fields["trim_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
            fields["rss_after_trim_mib"] = round((rss_bytes() or 0) / MIB, 1)
        logger.warning("memwatch", extra={"fields": {"t": round(time.time(), 1),
                                                     "pid": os.getpid(), **fields}})
        return fields
