"""AsyncEngine against the real EngineCore on a tiny model: submission, streaming,
abort on close/cancel, queue limits, rejection before the first yield, drain, idling."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling import SamplingParams
from scheduler.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    GenerationRequest,
    QueueFull,
)
from scheduler.engine_core import EngineConfig
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected, StepStats
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def make_engine(model_dir: str, **limits: int) -> AsyncEngine:
    cfg = EngineConfig(model=model_dir, num_blocks=limits.pop("num_blocks", 256),
                       max_num_seqs=limits.pop("max_num_seqs", 64))
    return AsyncEngine.from_config(cfg, **limits)


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)  # type: ignore[arg-type]


async def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_generate_matches_offline_and_idles(model_dir: str) -> None:
    prompt = [5, 40, 77, 100, 9]
    offline = LLM(model_dir, num_blocks=256).generate([prompt], greedy(12, ignore_eos=True))[0]

    async def main() -> None:
        engine = make_engine(model_dir)
        steps: list[StepStats] = []
        engine.add_step_listener(steps.append)
        await engine.start()
        tokens, text, last = [], "", None
        async for out in engine.generate(prompt, greedy(12, ignore_eos=True)):
            tokens += out.new_token_ids
            text += out.new_text
            last = out
        assert tokens == offline.token_ids and text == offline.text
        assert last is not None and last.finished and last.finish_reason == "length"
        assert last.kv is not None and last.kv.peak_blocks > 0
        assert engine.num_active == 0 and engine.stats.blocks_used == 0
        # idle: no busy polling, the loop task sleeps on its event
        n = len(steps)
        await asyncio.sleep(0.3)
        assert len(steps) == n
        await engine.shutdown()

    asyncio.run(main())


def test_rejections_come_before_the_first_yield(model_dir: str) -> None:
    async def main() -> None:
        engine = make_engine(model_dir, max_queued_requests=2, max_queued_tokens=10_000)
        with pytest.raises(EngineUnavailable):
            await engine.submit([GenerationRequest([5, 6], greedy(2))])  # not loaded yet
        await engine.start()
        # more KV blocks than the pool holds: the core's refusal, before the first yield
        gen = engine.generate([5] * 10, greedy(engine.stats.blocks_total * 16))
        with pytest.raises(RequestRejected) as exc:
            await gen.__anext__()
        assert exc.value.param == "max_tokens" and "KV blocks" in str(exc.value)
        # three submitted in the same loop turn: the third is over max_queued_requests
        results = await asyncio.gather(
            *(engine.submit([GenerationRequest([5, 6, 7], greedy(4))]) for _ in range(3)),
            return_exceptions=True)
        assert sum(isinstance(r, QueueFull) for r in results) == 1
        assert all(r.retry_after >= 1 for r in results if isinstance(r, QueueFull))
        for r in results:
            if not isinstance(r, BaseException):
                async for _ in r:
                    pass
        with pytest.raises(RequestRejected):  # a group larger than the queue: never fits
            await engine.submit([GenerationRequest([5], greedy(1)) for _ in range(3)])
        assert engine.num_queued == 0 and engine.num_active == 0
        await engine.shutdown()

    asyncio.run(main())


def test_close_and_cancel_abort_and_free_blocks(model_dir: str) -> None:
    async def main() -> None:
        engine = make_engine(model_dir)
        await engine.start()
        # close after the first delta
        stream = await engine.submit([GenerationRequest([5, 6, 7], greedy(200, ignore_eos=True))])
        first = await stream.__anext__()
        assert first.new_token_ids
        await stream.aclose()
        assert engine.num_active == 0
        await wait_for(lambda: engine.stats.blocks_used == 0)

        # cancel the consuming task mid-generation
        async def consume() -> None:
            async for _ in engine.generate([5, 6, 7, 8], greedy(200, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume())
        await wait_for(lambda: engine.stats.blocks_used > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_active == 0
        await wait_for(lambda: engine.stats.blocks_used == 0 and engine.stats.num_running == 0)
        await engine.shutdown()

    asyncio.run(main())


def test_priority_lower_runs_first(model_dir: str) -> None:
    async def main() -> None:
        engine = make_engine(model_dir, max_num_seqs=1)
        await engine.start()
        order: list[str] = []
        reqs = [GenerationRequest([5, 6], greedy(3, ignore_eos=True), "late", priority=5),
                GenerationRequest([5, 7], greedy(3, ignore_eos=True), "urgent", priority=-1)]
        async with await engine.submit(reqs) as stream:
            async for out in stream:
                if out.finished:
                    order.append(out.request_id)
        assert order == ["urgent", "late"]
        await engine.shutdown()

    asyncio.run(main())


def test_drain_finishes_in_flight_then_refuses(model_dir: str) -> None:
    async def main() -> None:
        engine = make_engine(model_dir)
        await engine.start()
        stream = await engine.submit([GenerationRequest([5, 6], greedy(20, ignore_eos=True))])
        drain = asyncio.create_task(engine.drain(timeout=60))
        await asyncio.sleep(0)
        assert not engine.ready
        with pytest.raises(EngineUnavailable) as exc:
            await engine.submit([GenerationRequest([5], greedy(1))])
        assert exc.value.reason == "draining"
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 20
        assert await drain is True

        # a drain that times out aborts what is left; the stream raises instead of hanging
        engine2 = make_engine(model_dir)
        await engine2.start()
        stream = await engine2.submit([GenerationRequest([5], greedy(250, ignore_eos=True))])
        assert await engine2.drain(timeout=0.05) is False
        with pytest.raises(EngineUnavailable):
            async for _ in stream:
                pass
        await wait_for(lambda: engine2.stats.blocks_used == 0)
        await engine.shutdown()
        await engine2.shutdown()

    asyncio.run(main())


@pytest.mark.serial  # a latency bound: `make test` runs it alone
def test_event_loop_stays_responsive_while_stepping(model_dir: str) -> None:
    async def main() -> None:
        engine = make_engine(model_dir)
        await engine.start()
        reqs = [GenerationRequest([5 + i, 6, 7], greedy(40, ignore_eos=True)) for i in range(16)]
        stream = await engine.submit(reqs)
        consumer = asyncio.create_task(asyncio.wait_for(_drain_stream(stream), 120))
        lags = []
        while not consumer.done():
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)
        await consumer
        lags.sort()
        assert lags[int(0.99 * (len(lags) - 1))] < 0.1, lags[-5:]
        await engine.shutdown()

    asyncio.run(main())


async def _drain_stream(stream) -> None:
    async for _ in stream:
        pass


def test_the_worker_steps_while_the_event_loop_is_busy(model_dir: str) -> None:
    """The step loop runs on the worker thread: a blocked event loop delays delivery, not
    generation (before issue 22 every step was a round trip through the event loop)."""
    async def main() -> None:
        engine = make_engine(model_dir)
        steps: list[StepStats] = []
        engine.add_step_listener(steps.append)
        await engine.start()
        stream = await engine.submit([GenerationRequest([5, 6, 7], greedy(30, ignore_eos=True))])
        before = len(steps)
        time.sleep(1.0)  # the event loop does nothing: no dispatch, no hand-off
        assert len(steps) - before >= 10, f"{len(steps) - before} steps while the loop slept"
        outs = [o async for o in stream]
        assert sum(len(o.new_token_ids) for o in outs) == 30 and outs[-1].finished
        await engine.shutdown()

    asyncio.run(main())


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(model_dir: str) -> None:
    """A step that raises fails every live request with EngineError (their streams end)
    and frees their blocks; the worker does not retry it, and the next request runs."""
    from scheduler.async_engine import EngineError
    from scheduler.engine_core import EngineCore

    cfg = EngineConfig(model=model_dir, num_blocks=256, max_num_seqs=64)
    broken = {"steps": 1}

    def factory(on_step):
        core = EngineCore(cfg, on_step=on_step)
        real = core.step

        def step():
            if broken["steps"]:
                broken["steps"] -= 1
                raise RuntimeError("injected")
            return real()
        core.step = step
        return core

    async def main() -> None:
        engine = AsyncEngine(factory, warmup=False)
        await engine.start()
        stream = await engine.submit([GenerationRequest([5, 6, 7], greedy(8, ignore_eos=True))])
        with pytest.raises(EngineError, match="injected"):
            async for _ in stream:
                pass
        await wait_for(lambda: engine.stats.blocks_used == 0 and engine.num_active == 0)
        outs = [o async for o in engine.generate([5, 6, 8], greedy(4, ignore_eos=True))]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
        await engine.shutdown()

    asyncio.run(main())
