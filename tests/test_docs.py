"""The docs' promises that code cannot check elsewhere: every seed paper the code or docs
cite is described in docs/papers.md, and the docs' citations of seed files link there;
the README covers serving a local model, sizing the pool and picking a policy."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED = re.compile(r"\b(00\d)_[0-9a-f]{16}\.txt\b")


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
        files = [ROOT / f for f in out]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        files = list(ROOT.rglob("*"))
    return [f for f in files if f.suffix in (".py", ".md") and f.is_file()]


def test_papers_md_describes_every_cited_seed_paper() -> None:
    papers = (ROOT / "docs" / "papers.md").read_text()
    cited = {m.group(0) for f in _tracked_text_files() for m in SEED.finditer(f.read_text())}
    assert len(cited) >= 5, cited
    for name in sorted(cited):
        num = name[:3]
        assert f'<a id="{num}"></a>' in papers, num
        assert f"`{name}`" in papers, name
        section = papers[papers.index(f'<a id="{num}"></a>'):]
        assert "What kvserve took" in section.split("<a id=")[1], num


def test_papers_md_lists_the_workspace_copies() -> None:
    shared = ROOT.parent / "shared" / "papers"
    if not shared.is_dir():
        pytest.skip("no shared/papers next to this checkout")
    papers = (ROOT / "docs" / "papers.md").read_text()
    for f in sorted(shared.glob("*.txt")):
        assert f"`{f.name}`" in papers, f.name


def test_docs_link_seed_file_citations_to_papers_md() -> None:
    """A seed file name in the docs is a link to its section of papers.md (the files
    themselves are not in the repository)."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if doc.name == "papers.md":
            continue
        text = doc.read_text()
        for m in SEED.finditer(text):
            before = text[max(0, m.start() - 2):m.start()]
            after = text[m.end():m.end() + 30]
            link = "papers.md#" if doc.parent.name == "docs" else "docs/papers.md#"
            assert before == "[`" and after.startswith(f"`]({link}{m.group(1)})"), \
                (doc.name, m.group(0))


def test_readme_covers_serving_sizing_and_policies() -> None:
    readme = (ROOT / "README.md").read_text()
    assert 'make serve ARGS="--model ' in readme and "--port" in readme
    for heading in ("### Serving a local Hugging Face model", "### Sizing the KV pool",
                    "### Picking a policy"):
        assert heading in readme, heading
    assert "2 × layers × kv_heads × head_dim × dtype bytes" in readme
    # the pool's default: sized from the machine (attention/sizing.py), the rule in
    # docs/memory.md, the option that overrides it
    from attention.sizing import CPU_FRACTION, CUDA_FRACTION
    from scheduler.engine_core import EngineConfig

    assert EngineConfig(model="m").kv_cache_memory is None
    assert (CPU_FRACTION, CUDA_FRACTION) == (0.5, 0.9)
    flat = " ".join(readme.split())
    assert "**sized from the machine**" in flat and "KVSERVE_MEMORY_LIMIT" in flat
    memory = (ROOT / "docs" / "memory.md").read_text()
    assert "## How big is the pool" in memory and "0.5 × available − reserve" in memory
    assert "docs/memory.md#how-big-is-the-pool" in readme
    assert "docs/papers.md" in readme
