"""Building kvserve's C++ CPU ops on first use (torch.utils.cpp_extension).

Why at run time and not at install: the ops are compiled with -march=native for the CPU
they serve on (AVX-512 where it exists), and a pip wheel cannot know it. The library is
cached on disk (TORCH_EXTENSIONS_DIR), so only the first start pays the build. Without a
compiler, or with KVSERVE_CPU_KERNEL=0, `load_ops` returns False and the caller keeps
its torch path: a CPU install never fails over a native op.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from native.cpu import cpuinfo

log = logging.getLogger(__name__)
# A build takes 25-60 s here. torch's lock file outlives a build that was killed (Ctrl-C,
# a test timeout), and every later load then waits for it forever, even one with nothing
# to build; one this old is such (the rule where `flock` is missing, `_builder_lock`).
STALE_LOCK_S = 600.0
_lock = threading.Lock()
_loaded: dict[str, bool] = {}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


@dataclass(frozen=True)
class Library:
    """One C++ source built into one library of ops (flags as its source needs them)."""

    source: Path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()


_ROOT = Path(__file__).resolve().parent.parent
# `#pragma omp simd` only: the kernels' threads are kvserve's own team (csrc/team.h), not
# OpenMP's, so no OpenMP runtime is linked.
_SIMD = ("-fopenmp-simd",)
# Every library kvserve builds, by name: here (not in the modules that use them) so that
# `python -m native --build` needs nothing but torch and can run while pip installs
# the rest (the Makefile does).
LIBRARIES: dict[str, Library] = {
    "kvserve_paged_decode_cpu": Library(_ROOT / "attention/csrc/paged_decode_cpu.cpp",
                                        ("-O3", "-march=native", "-ffast-math", *_SIMD)),
    "kvserve_storage_cpu": Library(_ROOT / "attention/csrc/storage_cpu.cpp",
                                   ("-O3", "-march=native", *_SIMD)),
    "kvserve_tables_cpu": Library(_ROOT / "kvpool/csrc/tables_cpu.cpp", ("-O3", "-march=native")),
    # No -ffast-math (NaNs must propagate); no FMA contraction (torch rounds mul and add apart).
    # -fno-trapping-math: without it GCC keeps a float compare that could trap as a branch,
    # and no loop with a select (silu's, bf16 rounding's NaN test) was vectorised: silu_and_mul
    # ran 5x slower than torch's silu and mul (the results are the same: nothing reads the
    # floating-point exception flags).
    "kvserve_layer_ops_cpu": Library(_ROOT / "engine/csrc/layer_ops_cpu.cpp",
                                     ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
                                      "-ffp-contract=off", *_SIMD)),
    "kvserve_sampling_cpu": Library(_ROOT / "engine/csrc/sampling_cpu.cpp",
                                    ("-O3", "-march=native")),
    "kvserve_select_cpu": Library(_ROOT / "policies/csrc/select_cpu.cpp", ("-O3", "-march=native")),
    # -fno-math-errno: llrint inlines (and vectorises) only without errno to set
    "kvserve_state_cpu": Library(_ROOT / "policies/csrc/state_cpu.cpp",
                                 ("-O3", "-march=native", "-fno-math-errno")),
}


def load_ops(name: str) -> bool:
    """Build (once per process) and load the library `name` of `LIBRARIES`; the ops it
    registers appear under torch.ops. False when it cannot be built."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            lib = LIBRARIES[name]
            cflags = list(lib.cflags)
            _loaded[name] = build(name, lib.source, [*cflags, headers_flag(lib.source),
                                                     *cpu_flag(cflags)], list(lib.ldflags))
        return _loaded[name]


def library_digest(name: str) -> str:
    """A digest of what a build of the library `name` is made of: its source, the headers
    it includes and its flags (the CPU define included), as torch's build cache keys it.
    A record of how fast that build ran (engine/kernel_cache.py) holds only while it is
    the same."""
    lib = LIBRARIES[name]
    cflags = list(lib.cflags)
    digest = hashlib.sha256(lib.source.read_bytes())
    for flag in (*cflags, headers_flag(lib.source), *cpu_flag(cflags), *lib.ldflags):
        digest.update(b"\0" + flag.encode())
    return digest.hexdigest()[:16]


def cpu_flag(cflags: list[str]) -> list[str]:
    """For a `-march=native` build, a define naming the CPU's instruction-set flags. Why:
    torch keys its build cache on source and flags, and `-march=native` reads the same on
    every CPU, so a cache carried to a machine without AVX-512 (a copied home directory,
    a VM moved to another host kind) would load a library built for AVX-512 and die of an
    illegal instruction; with the flags named it is rebuilt for the CPU it runs on."""
    if "-march=native" not in cflags:
        return []
    digest = hashlib.sha256(" ".join(sorted(cpuinfo("flags").split())).encode())
    return [f"-DKVSERVE_CPU_{digest.hexdigest()[:16]}"]


def headers_flag(source: Path) -> str:
    """A define naming the contents of the headers the source includes (`#include "..."`
    beside the including file, followed into the headers they include). Why: torch
    rebuilds a cached library when its source or its flags change, and hashes no header,
    so an edited header (one shared by two libraries, such as native/csrc/window_ring.h)
    would leave a stale build in use. Sources include other folders' headers by relative
    paths, not `-I`: flags naming a checkout's path made every checkout rebuild."""
    digest = hashlib.sha256()
    seen: set[Path] = set()
    todo = [source]
    while todo:
        at = todo.pop()
        for name in _INCLUDE.findall(at.read_text(encoding="utf-8")):
            header = (at.parent / name).resolve()
            if header.is_file() and header not in seen:
                seen.add(header)
                todo.append(header)
    for header in sorted(seen):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"-DKVSERVE_HEADERS_{digest.hexdigest()[:16]}"


def build(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> bool:
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        # torch runs `ninja` from PATH: a venv's own (a dependency) counts where the venv is
        # not activated (`.venv/bin/kvserve serve`, the Makefile's way)
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH"), bin_dir]))
        build_dir = Path(_get_build_directory(name, verbose=False))
        with _builder_lock(build_dir) as sole:
            clear_stale_lock(build_dir, 0.0 if sole else STALE_LOCK_S)
            log.info("loading C++ ops %s (the first start compiles them)", name)
            load(name=name, sources=[str(source)], is_python_module=False, extra_cflags=cflags,
                 extra_ldflags=ldflags, verbose=False)
        return True
    except Exception as exc:  # no compiler, no headers, ...: the torch path still works
        log.warning("C++ ops %s unavailable (%s); using the torch path", name, exc)
        return False


@contextlib.contextmanager
def _builder_lock(build_dir: Path) -> Iterator[bool]:
    """Hold an exclusive `flock` on `build_dir` for a load; yields whether it is held.

    Why: torch's own lock is a file that says nothing of its owner, so a build that was
    killed (a server stopped during its first start) left every later start waiting on
    it, for ever or, with the age rule alone, ten minutes. The kernel drops a `flock`
    when its process dies, so while every kvserve loader holds this one, a torch lock
    found under it belongs to nobody alive and goes at once. Where `flock` is missing
    (no fcntl, a file system without locks) the age rule stays."""
    try:
        import fcntl

        build_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(build_dir / "kvserve.flock", os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process loads
            held = True
        except OSError:
            held = False
        yield held
    finally:
        os.close(fd)  # releases the flock


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove `build_dir`'s build lock if it is older than `max_age_s` (left by a killed
    build: no live build holds a lock that long; 0 under `_builder_lock`, where none can
    be live); returns whether it did."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing a stale C++ build lock %s (%.0f s old: a killed build)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def build_all(names: list[str], jobs: int) -> dict[str, bool]:
    """Build `names` in `jobs` processes at once (a library is one compiler process, so a
    pool of them is how a first start uses more than one core); {name: built}."""
    import subprocess

    todo, running, done = list(names), {}, {}
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            running[name] = (time.perf_counter(), subprocess.Popen(
                [sys.executable, "-c", "import sys; from native.build import load_ops; "
                 f"sys.exit(0 if load_ops({name!r}) else 1)"], cwd=_ROOT))
        time.sleep(0.2)
        for name, (t0, proc) in list(running.items()):
            if proc.poll() is not None:
                done[name] = proc.returncode == 0
                del running[name]
                print(f"{name}: {'built' if done[name] else 'FAILED'} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return done


def build_log() -> Path:
    """Where `--background` builds write: beside torch's build folders."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(),
                "kvserve-build.log")


def main(argv: list[str] | None = None) -> int:
    """`python -m native --build [NAME ...] [--jobs N] [--background]`: build
    kvserve's C++ ops now rather than on first use (the names default to all of them).
    `--background` returns at once and leaves the builds running, their output in
    TORCH_EXTENSIONS_DIR's `kvserve-build.log`: the Makefile starts them as soon as torch
    is installed, so they compile while pip installs the rest. A server or test that
    needs a library meanwhile waits on its build (`_builder_lock`), never builds it twice."""
    import argparse
    import subprocess

    p = argparse.ArgumentParser(prog="python -m native", description=main.__doc__)
    p.add_argument("--build", nargs="*", metavar="NAME", required=True)
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    p.add_argument("--background", action="store_true")
    a = p.parse_args(argv)
    names = a.build or list(LIBRARIES)
    if unknown := [n for n in names if n not in LIBRARIES]:
        p.error(f"unknown libraries {unknown}; known: {', '.join(LIBRARIES)}")
    if a.background:
        log_path = build_log()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as out:
            subprocess.Popen([sys.executable, "-m", "native", "--build", *names,
                              "--jobs", str(a.jobs)], cwd=_ROOT, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        print(f"building {len(names)} C++ libraries in the background (log: {log_path})",
              flush=True)
        return 0
    done = build_all(names, a.jobs)
    return 0 if all(done.values()) else 1

