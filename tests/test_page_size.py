"""The tokens a page holds when `--block-size` is not given (scheduler/pool_shape.py
`page_tokens`): 16 on a per-layer pool; on a per-head pool pages of at least 8 KiB of K,
16 to 64 tokens, because the decode kernel reads a page as one run and short runs cost
it (docs/benchmarks.md, "Per-head KV"). The engine and its metrics report what it chose."""

from __future__ import annotations

import types

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling import SamplingParams
from scheduler.engine_config import EngineConfig
from scheduler.llm import LLM
from scheduler.pool_shape import HEAD_PAGE_BYTES, page_tokens
from tests.live_server import tiny_server
from tests.tiny_models import make_tiny_model


def _shape(head_dim: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(head_dim=head_dim)


@pytest.mark.parametrize(("head_dim", "dtype", "tokens"), [
    (32, torch.float32, 64),    # the 3m model: 16 tokens are 2 KiB of K
    (64, torch.bfloat16, 64),   # 160m
    (128, torch.bfloat16, 32),  # Llama-3-8B: 32 tokens are 8 KiB
    (128, torch.float32, 16),   # 16 tokens are already 8 KiB
    (256, torch.bfloat16, 16),
    (16, torch.bfloat16, 64),   # never past 64 tokens, however small a head
    (128, "int8", 64),          # a byte a channel plus its scale: 32 tokens fall short
])
def test_a_per_head_page_holds_8_kib_of_k(head_dim: int, dtype: torch.dtype | str,
                                           tokens: int) -> None:
    config = EngineConfig(model="m", kv_layout="head")
    got = page_tokens(config, _shape(head_dim), dtype)  # type: ignore[arg-type]
    assert got == tokens
    itemsize = 1 if isinstance(dtype, str) else dtype.itemsize
    if got > 16:  # the next smaller page would fall short of the bytes
        assert got // 2 * head_dim * itemsize < HEAD_PAGE_BYTES


def test_a_per_layer_pool_and_a_given_size_are_unchanged() -> None:
    shape = _shape(32)
    assert page_tokens(EngineConfig(model="m"), shape, torch.float32) == 16  # type: ignore[arg-type]
    given = EngineConfig(model="m", kv_layout="head", block_size=8)
    assert page_tokens(given, shape, torch.float32) == 8  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def test_the_engine_runs_on_its_default_pages(model_dir: str) -> None:
    """The tiny llama's heads are 16 fp32 dims: a per-head pool takes 64-token pages, a
    per-layer pool 16-token blocks, and both generate the same greedy tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [[5 + i % 50 for i in range(90)]]
    outs = {}
    for layout, tokens in (("layer", 16), ("head", 64)):
        llm = LLM(model_dir, num_blocks=256, device="cpu", kv_layout=layout)
        assert llm.engine.config.block_size == tokens
        assert llm.engine.pool.block_size == tokens
        outs[layout] = llm.generate(prompt, params)[0].token_ids
    assert outs["layer"] == outs["head"]


def test_metrics_report_the_chosen_page(model_dir: str) -> None:
    """A page's bytes on /metrics: K and V of 64 tokens of one kv head of 16 fp32 dims."""
    with tiny_server(model_dir, kv_layout="head") as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        text = c.get("/metrics").text
    [page] = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "kvserve_kv_block_bytes"]
    assert page == 2 * 64 * 16 * 4
