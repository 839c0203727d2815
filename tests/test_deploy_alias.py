"""`--metrics-alias vllm`: the vLLM metric names routers and autoscalers read, with the
same values as the `kvserve_` series, through the collector and through `kvserve serve`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.spawn import python_path
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineCore
from scheduler.outputs import EngineStats
from server.cli import build_parser
from server.metrics import VLLM_ALIASES, ServerMetrics, add_metrics_alias
from tests.live_server import wait_ready
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent

# What the Gateway API Inference Extension's endpoint picker (modelServerType vllm), the
# vLLM production-stack router and common vLLM dashboards read.
ROUTER_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total",
                "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total", "vllm:request_success_total",
                "vllm:time_to_first_token_seconds_bucket",
                "vllm:e2e_request_latency_seconds_bucket", "vllm:cache_config_info")


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(smp: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    found = [v for (n, ls), v in smp.items() if n == name and want <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def fake_engine(stats: EngineStats) -> AsyncEngine:
    engine = AsyncEngine(lambda on_step: None)
    engine.stats = stats
    return engine


def test_alias_mirrors_the_kvserve_values() -> None:
    stats = EngineStats(num_running=3, num_waiting=2, blocks_total=120, blocks_used=30,
                        blocks_free=90, prefix_cache_queries_total=50,
                        prefix_cache_hits_total=20, prompt_tokens_total=70,
                        generation_tokens_total=11,
                        preemptions_total={"recompute": 2, "swap": 3})
    engine = fake_engine(stats)
    metrics = ServerMetrics(engine)
    before = samples(generate_latest(metrics.registry).decode())
    assert not any(n.startswith("vllm:") for n, _ in before), "alias is opt-in"
    add_metrics_alias(metrics, engine, "vllm", "my-model")
    metrics.ttft.observe(0.3)
    metrics.success.labels("stop").inc()
    smp = samples(generate_latest(metrics.registry).decode())

    for n, ls in smp:
        if n.startswith("vllm:"):
            assert dict(ls).get("model_name") == "my-model", n
    assert value(smp, "vllm:num_requests_running") == 3
    assert value(smp, "vllm:num_requests_waiting") == 2
    assert value(smp, "vllm:kv_cache_usage_perc") == value(smp, "kvserve_kv_cache_usage_perc") == 0.25
    assert value(smp, "vllm:gpu_cache_usage_perc") == 0.25
    assert value(smp, "vllm:num_preemptions_total") == 5  # vLLM's has no mode label
    assert value(smp, "vllm:prefix_cache_hits_total") == 20
    assert value(smp, "vllm:gpu_prefix_cache_queries_total") == 50
    assert value(smp, "vllm:prompt_tokens_total") == 70
    assert value(smp, "vllm:generation_tokens_total") == 11
    assert value(smp, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(smp, "vllm:time_to_first_token_seconds_count") == 1
    assert value(smp, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(smp, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 0
    # not loaded yet: no cache config to report
    assert not any(n == "vllm:cache_config_info" for n, _ in smp)
    # the kvserve_ series are unchanged
    assert {k for k in smp if not k[0].startswith("vllm:")} >= set(before) - {
        k for k in before if k[0].endswith("_created")}


def test_cache_config_info_in_vllm_units() -> None:
    engine = fake_engine(EngineStats(blocks_total=96))
    engine.info = SimpleNamespace(  # what the engine sets once loaded
        config=SimpleNamespace(block_size=16, enable_prefix_caching=True,
                               kv_cache_dtype="bfloat16"),
        num_lanes=4)
    metrics = ServerMetrics(engine)
    add_metrics_alias(metrics, engine, "vllm", "m")
    smp = samples(generate_latest(metrics.registry).decode())
    # a vLLM block holds block_size tokens of every layer: 96 per-layer blocks / 4 layers
    assert value(smp, "vllm:cache_config_info", block_size="16", num_gpu_blocks="24",
                 enable_prefix_caching="True", cache_dtype="bfloat16") == 1


def test_unknown_alias_is_refused() -> None:
    engine = fake_engine(EngineStats())
    with pytest.raises(ValueError, match="vllm"):
        add_metrics_alias(ServerMetrics(engine), engine, "sglang", "m")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-alias", "sglang"])
    assert build_parser().parse_args(["serve", "--metrics-alias", "vllm"]).metrics_alias == "vllm"
    assert build_parser().parse_args(["serve"]).metrics_alias is None


def test_every_alias_source_is_a_kvserve_metric() -> None:
    documented = (ROOT / "docs" / "metrics.md").read_text()
    for short in VLLM_ALIASES:
        assert f"kvserve_{short}" in documented, short


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvserve_serve_metrics_alias_vllm(tmp_path: Path) -> None:
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--model", model_dir, "--port", str(port),
         "--served-model-name", "tiny", "--num-blocks", "48", "--block-size", "4",
         "--metrics-alias", "vllm", "--no-request-log"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(proc, url, tmp_path / "server.log", 120)
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
            smp = samples(c.get("/metrics").text)
        names = {n for n, _ in smp}
        missing = [n for n in ROUTER_NAMES if n not in names]
        assert not missing, missing
        assert value(smp, "vllm:generation_tokens_total") == \
            value(smp, "kvserve_generation_tokens_total") == 3
        # 48 per-layer blocks of the tiny model's 3 layers = 16 vLLM blocks
        assert value(smp, "vllm:cache_config_info", model_name="tiny", block_size="4",
                     num_gpu_blocks="16") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _vllm_alias_of(core: EngineCore) -> tuple:
    """The core's info as the server loads it, and a scrape of the vllm: alias beside it."""
    from scheduler.core_loop import CoreLoop

    info = CoreLoop(core, warmup=False).info()
    engine = fake_engine(core.stats())
    engine.info = info
    metrics = ServerMetrics(engine)
    add_metrics_alias(metrics, engine, "vllm", "m")
    return info, samples(generate_latest(metrics.registry).decode())


def test_cache_config_info_counts_lanes_on_a_per_head_pool(tmp_path: Path) -> None:
    """A per-head pool's page holds one (layer, kv head)'s tokens: vLLM's blocks are its
    pages over the lanes (layers × kv heads), as the core reports them once loaded."""
    from scheduler.llm import LLM

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    core = LLM(model_dir, num_blocks=96, block_size=4, device="cpu", kv_layout="head").engine
    info, smp = _vllm_alias_of(core)
    mc = core.model_config
    assert info.num_lanes == mc.num_layers * mc.num_kv_heads > mc.num_layers
    assert value(smp, "vllm:cache_config_info", block_size="4",
                 num_gpu_blocks=str(96 // info.num_lanes)) == 1


@pytest.mark.parametrize(("hybrid", "lanes"), [(True, 1), (False, 6)])
def test_cache_config_info_counts_vllms_groups_on_a_hybrid_pool(tmp_path: Path, hybrid: bool,
                                                                lanes: int) -> None:
    """On a Gemma-3-shaped model (5 sliding-window layers : 1 global) whose windowed
    layers keep their windows, a vLLM block is one page of each layer of one of vLLM's
    groups (vLLM's hybrid manager groups by the fewest layers of one kind: the 1 global
    layer), not of every layer: 120 pages are 120 of vLLM's blocks; with the hybrid KV
    cache off, 120 / 6."""
    from scheduler.llm import LLM

    model_dir = make_tiny_model("gemma3", tmp_path / "gemma3", num_hidden_layers=6,
                                sliding_window_pattern=6, sliding_window=16)
    core = LLM(model_dir, num_blocks=120, block_size=4, device="cpu",
               hybrid_kv_cache=hybrid).engine
    info, smp = _vllm_alias_of(core)
    assert info.num_lanes == 6 and info.kv_sizing.block_lanes == lanes
    assert value(smp, "vllm:cache_config_info", block_size="4",
                 num_gpu_blocks=str(120 // lanes)) == 1
