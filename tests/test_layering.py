"""The house's rules (docs/architecture.md, "Rooms"), read from the sources with `ast` and
a regex over C++ includes, so a lazy import inside a function, or one under
TYPE_CHECKING, counts as much as one at the top of a module:

- rooms import only rooms below them: server -> scheduler -> engine -> kvpool ->
  policies / attention -> native; loadtest and benchmarks are clients on top that
  nothing in the runtime imports, and demo_model/ is no part of the runtime either;
- C++ sources include only headers of their own room or of a room below (a header
  shared by two rooms lives in native/csrc);
- no two files import each other, directly or round a loop;
- the scheduler reaches memory only through the KV-cache manager, and nothing outside
  kvpool/ (but the model runner, which reads a step's rows) touches the slot tables.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# room -> the first-party rooms it may import
ALLOWED = {
    "native": set(),
    "attention": {"native"},
    "policies": {"native"},
    "kvpool": {"native", "attention", "policies"},
    "engine": {"native", "attention", "kvpool"},
    "scheduler": {"native", "attention", "kvpool", "policies", "engine"},
    "server": {"native", "attention", "kvpool", "policies", "engine", "scheduler"},
}
CLIENTS = {"loadtest", "benchmarks"}
FIRST_PARTY = {*ALLOWED, *CLIENTS, "demo_model", "tests"}
PACKAGES = sorted(p for p in FIRST_PARTY - {"tests"} if (ROOT / p).is_dir())


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(f): f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))}


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The first-party modules `path` imports (`from pkg import mod` names `pkg.mod`)."""
    found: set[str] = set()
    this = _module(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = this.split(".")[: -node.level if path.name != "__init__.py" else None]
                if path.name == "__init__.py" and node.level > 1:
                    pkg = pkg[: 1 - node.level]
                base = ".".join([*pkg, base] if base else pkg)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != this}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & FIRST_PARTY


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_runtime_packages_import_only_layers_below(package: str) -> None:
    bad = {str(f.relative_to(ROOT)): sorted(imported_packages(f) - ALLOWED[package] - {package})
           for f in sorted((ROOT / package).rglob("*.py"))}
    assert not {f: p for f, p in bad.items() if p}, "imports against the layering"


def test_loadtest_never_imports_the_benchmarks() -> None:
    """The load tests users run stand alone; the engine benchmarks may use them."""
    bad = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "loadtest").rglob("*.py"))
           if "benchmarks" in imported_packages(f)]
    assert not bad, bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_file_level_import_loops() -> None:
    known = _modules()
    edges = {m: imported_modules(f, known) for m, f in known.items()}
    assert _cycles(edges) == []


def test_the_cycle_check_finds_a_loop() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def test_cpp_includes_follow_the_rooms() -> None:
    """A C++ source includes headers of its own room or of a room it may import; every
    quoted include resolves to a file (no include paths: a header's room is its folder)."""
    bad = []
    for room in ALLOWED:
        for src in sorted((ROOT / room).rglob("*")):
            if src.suffix not in (".cpp", ".h"):
                continue
            for name in _INCLUDE.findall(src.read_text()):
                header = (src.parent / name).resolve()
                if not header.is_file():
                    bad.append(f"{src.relative_to(ROOT)}: {name} (missing)")
                    continue
                target = header.relative_to(ROOT).parts[0]
                if target != room and target not in ALLOWED[room]:
                    bad.append(f"{src.relative_to(ROOT)} -> {header.relative_to(ROOT)}")
    assert not bad, bad


# What changes memory: the slot tables, compaction and a cache's own changes.
_MEMORY_CALLS = re.compile(
    r"\.tables\.\w+\(|\bcompaction\.|\bcache\.(append|evict\w*|release|swap_out|swap_in|"
    r"compact|renumber|drop_before|start_ring|hold|adopt|discard_swapped)\(")
# The scheduler's doors into kvpool: the manager, and the pool it builds and hands over
# (and the windows' arithmetic the pool is sized by, which changes nothing).
_SCHEDULER_KVPOOL = {"kvpool.manager", "kvpool.pool", "kvpool.seq_cache", "kvpool.policy_rows",
                     "kvpool.windows"}


def test_the_scheduler_reaches_memory_through_the_manager() -> None:
    """No module of the scheduler or the server calls the slot tables, compaction or a
    cache's changes (the manager does: `KVCacheManager`), and the scheduler imports from
    kvpool only the manager, the pool it builds, and the types handed through the door."""
    known = _modules()
    bad = [f"{f.relative_to(ROOT)}:{i}" for room in ("scheduler", "server")
           for f in sorted((ROOT / room).rglob("*.py"))
           for i, line in enumerate(f.read_text().splitlines(), 1)
           if _MEMORY_CALLS.search(line)]
    assert not bad, bad
    reach = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f, known)
                                              if m.startswith("kvpool.") and m not in _SCHEDULER_KVPOOL)
             for f in sorted((ROOT / "scheduler").rglob("*.py"))}
    assert not {f: m for f, m in reach.items() if m}


def test_only_kvpool_and_the_runner_touch_the_tables() -> None:
    """Outside kvpool/, only the model runner's files read the slot tables (a step's rows
    of blocks and positions): no other runtime module imports them."""
    known = _modules()
    runner = {"engine.runner", "engine.attention_groups", "engine.cuda_graphs"}
    bad = {m: sorted(t for t in imported_modules(f, known)
                     if t in {"kvpool.tables", "kvpool.compaction"})
           for m, f in known.items()
           if m.split(".")[0] in ALLOWED and not m.startswith("kvpool") and m not in runner}
    assert not {m: t for m, t in bad.items() if t}


def test_kvserve_has_no_bench_subcommand() -> None:
    """Benchmarks are `python -m loadtest` and `python -m benchmarks.*`: the server's CLI
    never reaches into them."""
    from server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve"])


def test_the_installed_packages_are_the_runtime_and_the_clients() -> None:
    """pyproject installs the runtime rooms and the clients on top (loadtest, and the
    engine benchmarks where they have a room); demo_model/ needs a checkout, and only the
    checkpoint stays under engine/demo/."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    installed = set(re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools]", 1)[1]))
    assert installed == {*ALLOWED, *(c for c in CLIENTS if (ROOT / c).is_dir())}
    assert sorted(p.name for p in (ROOT / "engine" / "demo").glob("*.py")) == ["__init__.py"]


POOL_TENSORS = re.compile(r"\.(k_cache|v_cache|_flat|_flat_scales)\b|\b(pool|storage)\.(kv|scales)\b")


def test_only_the_storage_reads_the_pools_tensors() -> None:
    """The runner writes and attends through `KVStorage.write`/`attend` and the policies'
    bridge reads statistics through `gather_stats`: no runtime module outside attention/
    names the K/V or scale tensors, so their layout can change in one place."""
    bad = [f"{f.relative_to(ROOT)}:{i}" for package in ALLOWED if package != "attention"
           for f in sorted((ROOT / package).rglob("*.py"))
           for i, line in enumerate(f.read_text().splitlines(), 1) if POOL_TENSORS.search(line)]
    assert not bad, bad


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports, at its top or inside a function
    (`from package import module` names the module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found - {_module(path)}


@pytest.mark.parametrize("package", ["policies", "scheduler", "server"])
def test_no_import_cycles_between_modules(package: str) -> None:
    """No module of these packages imports, directly or through others, one that imports
    it back (a cycle makes every module on it load, and be understood, as one)."""
    files = {_module(f): f for f in sorted((ROOT / package).rglob("*.py"))}
    graph = {m: module_imports(f, set(files)) for m, f in files.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m):], m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
