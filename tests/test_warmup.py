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
        done, total = w.row_buckets  # oneDNN row buckets: all of them for a tiny model
        # oneDNN layers (the engine's choices, as its CoreInfo reports them: on CUDA none)
        if any(c["layout"] == "onednn" for c in engine.info.linear_choices):
            assert total > 32 and done == total
        else:  # panels or dense: nothing to warm
            assert (done, total) == (0, 0)
        host = {"select_cpu", "state_cpu", "tables_cpu"}  # on any device
        assert set(w.native_ops) in (host, host | {
            "paged_decode_cpu", "sampling_cpu", "storage_cpu"})
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


def test_step_buckets_cover_every_step_shape() -> None:
    """Every row count a step can have pads to a listed bucket: decode batches (head
    included) up to max_num_seqs, then prefill steps' larger buckets without the head."""
    from engine.cpu_linear import padded_rows
    from scheduler.warmup import step_buckets

    got = step_buckets(48, 300)
    heads = [n for n, head in got if head]
    assert heads == [*range(padded_rows(1), 33), 36, 40, 44, 48]
    assert [n for n, head in got if not head] == [52, 56, 60, 64, 72, 80, 88, 96, 104, 112, 120, 128,
                                                  144, 160, 176, 192, 208, 224, 240,
                                                  256, 288, 320]
    listed = {n for n, _ in got}
    assert all(padded_rows(rows) in listed for rows in range(1, 301))


def test_warm_buckets_runs_each_shape_once_per_bucket_within_the_deadline() -> None:
    """Each distinct packed weight shape runs once at each bucket (layers of one shape
    share oneDNN's state: one of them runs); the output head (vocab outputs) only where
    asked; nothing once the deadline has passed."""
    import time

    import torch
    from torch import nn

    from engine.cpu_linear import PackedLinear, packing_available, warm_buckets

    if not packing_available(torch.float32):
        pytest.skip("no oneDNN prepacking in this torch build")
    model = nn.Sequential(*(PackedLinear(nn.Linear(16, 32, bias=False)) for _ in range(3)),
                          PackedLinear(nn.Linear(32, 16)), PackedLinear(nn.Linear(16, 50)))
    seen: list[tuple[int, int, int]] = []
    for i, m in enumerate(model):
        m.register_forward_hook(lambda mod, args, out, i=i: seen.append((i, *args[0].shape)))
    later = time.perf_counter() + 60
    assert warm_buckets(model, [(1, True), (40, False)], vocab=50, deadline=later) == (2, 2)
    assert seen == [(0, 1, 16), (3, 1, 32), (4, 1, 16), (0, 40, 16), (3, 40, 32)]
    seen.clear()
    past = time.perf_counter() - 1
    assert warm_buckets(model, [(1, True), (8, True)], vocab=50, deadline=past) == (0, 2)
    assert seen == []


def test_warm_buckets_has_nothing_to_do_without_packed_layers() -> None:
    """Dense layers (and the panels) keep no per-shape state: nothing runs, and the
    report says there was nothing to warm rather than that every bucket was."""
    import time

    from torch import nn

    from engine.cpu_linear import warm_buckets

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 50))
    calls: list[int] = []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    later = time.perf_counter() + 60
    assert warm_buckets(model, [(1, True), (40, False)], vocab=50, deadline=later) == (0, 0)
    assert calls == []


def test_warm_up_builds_the_grammar_compiler(model_dir: str) -> None:
    """With xgrammar installed, the warm-up's third request runs under a grammar: the
    compiler's tokenizer tables exist before the first client asks for a schema."""
    pytest.importorskip("xgrammar")
    from scheduler.engine_core import EngineCore
    from scheduler.warmup import warm_up

    core = EngineCore(EngineConfig(model=model_dir, num_blocks=96))
    assert core._grammars is None
    warm_up(core)
    assert core._grammars is not None and core._grammars.xgr is not None
    assert not core.has_unfinished() and core.pool.num_used == 0
