"""Imports point one way (docs/architecture.md): server -> scheduler -> engine -> kvpool,
with policies beside kvpool; loadtest is a client on top that nothing below imports, and
the demo model's training and evaluation code (demo_model/, not installed) is no part of
the runtime either. Read from the sources with `ast`, so a lazy import inside a function
counts as much as one at the top of a module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the first-party packages it may import
ALLOWED = {
    "kvpool": set(),
    "policies": set(),
    "engine": {"kvpool"},
    "scheduler": {"engine", "kvpool", "policies"},
    "server": {"scheduler", "engine", "kvpool", "policies"},
}
FIRST_PARTY = {*ALLOWED, "loadtest", "demo_model", "tests"}


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


def test_kvserve_has_no_bench_subcommand() -> None:
    """Benchmarks are `python -m loadtest`: the server's CLI never reaches into loadtest."""
    from server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve"])


def test_the_installed_packages_are_the_runtime_and_loadtest() -> None:
    """pyproject installs the runtime packages and loadtest (a client shipped with it);
    demo_model/ needs a checkout, and only the checkpoint stays under engine/demo/."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    installed = set(re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools]", 1)[1]))
    assert installed == {*ALLOWED, "loadtest"}
    assert sorted(p.name for p in (ROOT / "engine" / "demo").glob("*.py")) == ["__init__.py"]


POOL_TENSORS = re.compile(r"\.(k_cache|v_cache|_flat|_flat_scales)\b|\bpool\.(kv|scales)\b")


def test_only_kvpool_reads_the_pools_tensors() -> None:
    """The runner writes and attends through `BlockPool.write`/`attend` and the policies'
    bridge reads statistics through `gather_stats` (issue 18): no runtime module outside
    kvpool/ names the pool's K/V or scale tensors, so their layout can change in one place."""
    bad = [f"{f.relative_to(ROOT)}:{i}" for package in ALLOWED if package != "kvpool"
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
