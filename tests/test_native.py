"""Building the C++ ops (native/build.py): a lock left by a killed build is cleared,
loaders in several processes take turns, and an edited header or another CPU rebuilds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from native import build as native
from native.build import STALE_LOCK_S, _builder_lock, clear_stale_lock, cpu_flag, headers_flag


def test_a_killed_builds_lock_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    """torch waits forever on a build lock; one older than any build is a killed
    build's and must go, a fresh one belongs to a build in progress and must stay."""
    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # no lock
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()


def test_the_lock_checked_is_torchs_build_directory(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """load_ops clears the lock in torch's own build directory for the op (a private
    torch helper: this fails loudly if its contract moves)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert Path(_get_build_directory("kvserve_x", verbose=False)) == tmp_path / "kvserve_x"


def test_a_fresh_lock_of_a_killed_build_does_not_block_the_next_start(tmp_path: Path) -> None:
    """A build killed a moment ago (a server stopped during its first start) leaves
    torch's lock fresh, and torch waits on it before even checking whether anything is
    to build. The next load holds kvserve's `flock` (dropped by the kernel when its
    holder dies), so the fresh lock is nobody's and goes: the load finishes, where it
    used to hang (a subprocess, so nothing of this process's loaded ops counts)."""
    from kvpool.tables import load_mark

    if not load_mark():  # built (or found) here first: the subprocess only loads
        pytest.skip("no C++ compiler: the ops are never built")
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory("kvserve_tables_cpu", verbose=False))
    lock = build_dir / "lock"
    with _builder_lock(build_dir):  # nobody is building: the lock is a dead build's
        lock.touch()  # fresh: the age rule alone would keep it for ten minutes
    code = "from kvpool.tables import load_mark; import sys; sys.exit(0 if load_mark() else 3)"
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                              timeout=120, capture_output=True, text=True)
    finally:
        with _builder_lock(build_dir):
            held = lock.exists()
            lock.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not held


def test_loaders_take_turns_on_the_flock(tmp_path: Path) -> None:
    """While one process holds the builder lock, another's waits (a build in progress
    is never mistaken for a killed one), and gets it once the first lets go."""

    code = ("import sys, time; from pathlib import Path; from native.build import _builder_lock\n"
            "t = time.monotonic()\n"
            f"with _builder_lock(Path({str(tmp_path)!r})) as held:\n"
            "    print(held, round(time.monotonic() - t, 2))\n")
    with _builder_lock(tmp_path) as held:
        assert held
        other = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert other.poll() is None  # still waiting on the lock
    out, _ = other.communicate(timeout=60)
    held_there, waited = out.split()
    assert held_there == "True" and float(waited) >= 1.0


def test_an_edited_header_changes_the_build_flags(tmp_path: Path) -> None:
    """torch rebuilds a cached library when its source or flags change and hashes no
    header: the flag naming the headers the source includes (beside it, by a relative
    path, and those headers' own includes, beside them) must change when any of them
    does, and only then; a header nobody includes does not count."""
    src, shared = tmp_path / "src", tmp_path / "shared"
    for d in (src, shared):
        d.mkdir()
    source = src / "op.cpp"
    source.write_text('#include "a.h"\n#include "../shared/b.h"\n')
    (src / "a.h").write_text("int a;\n")
    (shared / "b.h").write_text('#include "d.h"\nint b;\n')  # d.h: beside b.h
    (shared / "d.h").write_text("int d;\n")
    (src / "unused.h").write_text("int u;\n")
    seen = [headers_flag(source)]
    assert seen[0].startswith("-DKVSERVE_HEADERS_") and headers_flag(source) == seen[0]
    source.write_text(source.read_text() + "// torch hashes the source itself\n")
    (src / "unused.h").write_text("int u2;\n")
    assert headers_flag(source) == seen[0]
    for header in (src / "a.h", shared / "b.h", shared / "d.h"):
        header.write_text(header.read_text() + "// edited\n")
        seen.append(headers_flag(source))
        assert seen[-1] not in seen[:-1], header


def test_a_build_in_another_checkout_has_the_same_flags(tmp_path: Path) -> None:
    """Checkouts of the same source (CI's clone beside a developer's tree, a benchmark's
    base checkout) share torch's build folder: flags that named a checkout's path made
    each rebuild the library over the other's, minutes on a slow CPU."""
    assert not any(f.startswith("-I") for lib in native.LIBRARIES.values() for f in lib.cflags)
    root = Path(native.__file__).parent.parent
    copy = tmp_path / "copy"
    for rel in ("native/csrc", "attention/csrc", "kvpool/csrc", "policies/csrc"):
        (copy / rel).mkdir(parents=True)
        for f in (root / rel).iterdir():
            (copy / rel / f.name).write_bytes(f.read_bytes())
    name = "attention/csrc/paged_decode_cpu.cpp"
    assert headers_flag(copy / name) == headers_flag(root / name)
    ring = copy / "native/csrc/window_ring.h"  # reached by a relative include: counted
    ring.write_text(ring.read_text() + "// edited\n")
    assert headers_flag(copy / name) != headers_flag(root / name)


def test_a_native_build_names_the_cpus_instruction_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """`-march=native` reads the same on every CPU, and torch's build cache keys on the
    flags: a cache carried from an AVX-512 host to an AVX2 one (this project's machines
    have been both) must not load the AVX-512 library. The define follows the CPU's
    flags (in any order) and only `-march=native` builds carry it."""
    flags = {"flags": "fpu sse2 avx2 fma avx512f avx512bw"}
    monkeypatch.setattr(native, "cpuinfo", lambda field: flags.get(field, ""))
    zen4 = cpu_flag(["-O3", "-march=native"])
    assert len(zen4) == 1 and zen4[0].startswith("-DKVSERVE_CPU_")
    flags["flags"] = "avx512bw avx512f fma avx2 sse2 fpu"
    assert cpu_flag(["-march=native"]) == zen4
    flags["flags"] = "fpu sse2 avx2 fma"
    assert cpu_flag(["-march=native"]) != zen4
    assert cpu_flag(["-O3"]) == []


def test_every_cpp_source_is_a_library_and_ships() -> None:
    """`LIBRARIES` is what `--build` compiles ahead of use: a source missing from it would
    build on first use only. Its sources and headers are package data too (an installed,
    non-editable kvserve builds from them)."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(native.__file__).parent.parent
    sources = {p.resolve() for p in root.glob("*/csrc/*.cpp")}
    assert sources == {lib.source for lib in native.LIBRARIES.values()}
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    for f in root.glob("*/csrc/*"):
        package = f.parent.parent.name
        assert any(fnmatch.fnmatch(f"csrc/{f.name}", pat) for pat in data.get(package, [])), f


def test_build_command_builds_and_refuses_unknown_names(tmp_path: Path) -> None:
    """`python -m native --build` (the Makefile's, ahead of first use): the named
    libraries load (found in the shared build cache, or built), in processes of their
    own; an unknown name is a usage error. `--background` returns at once and logs."""
    root = Path(native.__file__).parent.parent
    names = ["kvserve_sampling_cpu", "kvserve_tables_cpu"]
    run = subprocess.run([sys.executable, "-m", "native", "--build", *names,
                          "--jobs", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert all(f"{n}: built" in run.stdout for n in names), run.stdout
    bad = subprocess.run([sys.executable, "-m", "native", "--build", "kvserve_nope"],
                         cwd=root, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown libraries ['kvserve_nope']" in bad.stderr
    # the background form: read what this run appends to the shared log
    log = native.build_log()
    before = log.read_text() if log.exists() else ""
    t0 = time.perf_counter()
    bg = subprocess.run([sys.executable, "-m", "native", "--build", names[0],
                         "--background"], cwd=root, capture_output=True, text=True, timeout=60)
    assert bg.returncode == 0 and "in the background" in bg.stdout, bg.stdout + bg.stderr
    assert time.perf_counter() - t0 < 30  # did not wait for the build
    deadline = time.time() + 120
    while f"{names[0]}: built" not in (log.read_text()[len(before):] if log.exists() else ""):
        assert time.time() < deadline, "the background build never logged"
        time.sleep(0.2)
