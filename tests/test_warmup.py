"""The warm-up AsyncEngine runs before it reports loaded (scheduler/warmup.py): it runs
real steps, leaves the pool empty, draws no seed, and no counter shows it."""

from __future__ import annotations

import asyncio
from dataclasses import fields

import pytest

from engine.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from scheduler.outputs import EngineStats, StepStats
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def test_since_takes_off_counters_only() -> None:
    base = EngineStats(blocks_total=64, blocks_used=3, prompt_tokens_total=5,
                       requests_by_policy_total={"full": 2}, policy_seconds_total={"h2o": 0.5})
    now = EngineStats(blocks_total=64, blocks_used=7, num_running=2, prompt_tokens_total=12,
                      requests_by_policy_total={"full": 3, "h2o": 1},
                      policy_seconds_total={"h2o": 1.5})
    d = now.since(base)
    assert (d.blocks_total, d.blocks_used, d.num_running) == (64, 7, 2)  # gauges kept
    assert d.prompt_tokens_total == 7
    assert d.requests_by_policy_total == {"full": 1, "h2o": 1}
    assert d.policy_seconds_total == {"h2o": 1.0}
    # every cumulative field is listed: a new counter must be added to COUNTERS
    cumulative = {f.name for f in fields(EngineStats)
                  if f.name.endswith("_total") and f.name != "blocks_total"}
    assert cumulative == set(EngineStats.COUNTERS)


def test_engine_warms_up_before_loaded(model_dir: str) -> None:
    async def main() -> None:
        engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=96))
        steps: list[StepStats] = []
        engine.add_step_listener(steps.append)
        await engine.start()
        w = engine.warmup_report
        assert w is not None and w.steps >= 2 and w.seconds > 0
        assert w.native_ops == {} or set(w.native_ops) == {
            "paged_decode_cpu", "sampling_cpu", "select_cpu", "state_cpu", "tables_cpu", "key_stats_cpu"}
        s = engine.stats
        assert (s.blocks_used, s.num_running, s.num_waiting) == (0, 0, 0)
        assert s.blocks_total == 96
        assert s.prompt_tokens_total == s.generation_tokens_total == 0
        assert s.prefix_cache_queries_total == 0
        assert not any(s.requests_by_policy_total.values())
        assert steps == []  # the step histograms saw nothing
        tokens = []
        async for out in engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=3,
                                                                      ignore_eos=True)):
            tokens += out.new_token_ids
        assert len(tokens) == 3 and len(steps) == 3
        assert engine.stats.prompt_tokens_total == 4
        assert engine.stats.generation_tokens_total == 3
        assert engine.stats.requests_by_policy_total.get("full") == 1
        await engine.shutdown()

    asyncio.run(main())


def test_warm_up_draws_no_seed(model_dir: str) -> None:
    """An unseeded request gets the same seed from the core's generator (EngineConfig.seed)
    with or without the warm-up, so sampled outputs do not depend on it."""
    async def first_tokens(warmup: bool) -> list[int]:
        engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=96, seed=7),
                                         warmup=warmup)
        await engine.start()
        tokens: list[int] = []
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=6,
                                                                   ignore_eos=True)):
            tokens += out.new_token_ids
        await engine.shutdown()
        return tokens

    assert asyncio.run(first_tokens(True)) == asyncio.run(first_tokens(False))
