"""`python -m loadtest soak` against a real kvserve: a short soak with disconnects and
malformed requests on a server in this process, and `--spawn`, kvserve as a child with
its RSS, a clean drain and the result written into a markdown file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from loadtest import prom
from server.testing import ServerThread
from tests.live_server import tiny_server
from tests.tiny_models import make_tiny_model

CONTEXT = 256  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    with tiny_server(model_dir, num_blocks=1024) as s:
        yield s


def test_soak_with_disconnects_and_malformed(server: ServerThread, model_dir: str,
                                             tmp_path: Any) -> None:
    from loadtest.soak import main as soak_main

    out = tmp_path / "soak.json"
    # bounded by a count, not a time: the same requests (seeded) on a fast or slow engine
    rc = soak_main(["--base-url", server.url, "--minutes", "2", "--max-requests", "40",
                    "--concurrency", "4",
                    "--tokenizer", model_dir, "--max-model-len", str(CONTEXT),
                    "--prompt-len", "24", "--output-len", "16", "--disconnect-fraction", "0.3",
                    "--malformed-fraction", "0.15", "--rss-every", "1",
                    "--max-rss-growth", "50", "--result-json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, r["problems"]
    assert r["leaked_blocks"] == 0 and r["idle_after"]["idle"]
    assert not r["server_errors"] and not r["malformed_accepted"]
    counts = r["counts"]
    assert counts.get("disconnect:disconnected", 0) >= 3, counts
    assert sum(v for k, v in counts.items() if k.startswith("malformed:4")) >= 3, counts
    assert counts.get("normal:200", 0) >= 10, counts
    samples = prom.scrape(server.url)
    assert prom.value(samples, "kvserve_kv_blocks", state="used") == 0


def test_soak_spawned_server(model_dir: str, tmp_path: Any) -> None:
    """`--spawn`: kvserve as a child process, RSS from /proc, a clean drain at the end,
    and the result written into a markdown file between the soak markers."""
    from loadtest.soak import SOAK_BEGIN, SOAK_END
    from loadtest.soak import main as soak_main

    doc = tmp_path / "bench.md"
    doc.write_text(f"# B\n\n## Serving benchmarks (issue 8)\n\n{SOAK_BEGIN}\nold\n{SOAK_END}\n\n"
                   "## Later section\n")
    out = tmp_path / "soak.json"
    rc = soak_main(["--spawn", "--model", model_dir, "--minutes", str(5 / 60),
                    "--concurrency", "3", "--max-model-len", str(CONTEXT), "--prompt-len", "16",
                    "--output-len", "8", "--rss-every", "1", "--max-rss-growth", "50",
                    "--result-json", str(out), "--doc", str(doc)])
    r = json.loads(out.read_text())
    assert rc == 0, r["problems"]
    assert r["rss_base_bytes"] > 10 * 2**20 and len(r["rss_trace"]) >= 2
    assert r["leaked_blocks"] == 0 and r["server_exit_code"] == 0
    assert not os.path.exists(f"/proc/{r['server_pid']}")  # stopped, and only once started
    text = doc.read_text()
    assert "old" not in text and "**Soak: " in text and text.endswith("## Later section\n")
