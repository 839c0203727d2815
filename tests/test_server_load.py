"""Under load the event loop keeps answering; disconnected clients free everything.

Both tests run a real uvicorn in a thread of this process (bounded: tiny model, a few
dozen tokens per request) and measure against the event loop, not the model: `/health`
never waits for a step, and a client that goes away is aborted before the next step.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from scheduler.outputs import StepStats
from server.app import build_app
from server.settings import ServerSettings
from server.testing import ServerThread
from tests.live_server import hang_up_mid_stream
from tests.tiny_models import make_tiny_model


class StepCounter:
    def __init__(self) -> None:
        self.steps = 0
        self.max_batch = 0
        self.delay = 0.0  # > 0 slows steps down, for tests that need a long request
        self._lock = threading.Lock()

    def __call__(self, s: StepStats) -> None:
        with self._lock:
            self.steps += 1
            self.max_batch = max(self.max_batch, s.num_seqs)
        if self.delay:
            time.sleep(self.delay)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[ServerThread, AsyncEngine, StepCounter]]:
    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=1024))
    counter = StepCounter()
    engine.add_step_listener(counter)
    app = build_app(engine, ServerSettings(served_model_names=["tiny"], model_path=model_dir))
    with ServerThread(app) as s:
        yield s, engine, counter


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=256, max_keepalive_connections=256)


# The load runs in its own process so that the client's work (64 SSE parsers) does not
# share this process's GIL with the server: the probe then measures the server's loop.
LOAD_CLIENT = """
import asyncio, json, sys
import httpx

async def main(url, n, max_tokens):
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def one(i):
            body = {"prompt": f"request number {i}", "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True, "temperature": 0.8, "seed": i}
            chunks = 0
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.status_code
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")
            return chunks
        return await asyncio.gather(*(one(i) for i in range(n)))

print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))))
"""


@pytest.mark.serial  # a latency bound: `make test` runs it alone
def test_health_p95_under_load(served: tuple[ServerThread, AsyncEngine, StepCounter]) -> None:
    server, engine, counter = served
    n_clients, max_tokens = 64, 64

    async def load_round(probe: httpx.AsyncClient, latencies: list[float]) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", LOAD_CLIENT, server.url, str(n_clients),
            str(max_tokens), stdout=asyncio.subprocess.PIPE)
        out = asyncio.create_task(proc.communicate())
        while not out.done():
            busy = engine.num_active > 0
            t0 = time.perf_counter()
            r = await probe.get("/health")
            if busy:  # only probes sent while requests were in flight count ("under load")
                latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200
            await asyncio.sleep(0.005)
        stdout, _ = await out
        assert proc.returncode == 0
        chunks = json.loads(stdout)
        assert len(chunks) == n_clients and all(c >= 2 for c in chunks), chunks

    async def main() -> list[float]:
        latencies: list[float] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as probe:
            await probe.get("/health")  # connect first: measure the loop, not TCP setup
            # However fast the engine steps, the busy periods together hold 20+ probes: a
            # faster engine (or CI's machine) only means more rounds of load. One round gave
            # 17 probes on CI once the step's host work shrank.
            for _ in range(8):
                await load_round(probe, latencies)
                if len(latencies) >= 20:
                    break
        return latencies

    steps0 = counter.steps
    latencies = asyncio.run(main())
    steps = counter.steps - steps0
    assert counter.max_batch >= n_clients // 2, counter.max_batch  # really concurrent
    assert steps >= max_tokens and len(latencies) >= 20, (steps, len(latencies))
    latencies.sort()
    # 20-40 probes: "p99" would be the single worst one, which on a 2-core machine shared
    # by the engine thread, the server and the load process can be one OS scheduling
    # hiccup (seen once in a full run). A loop blocked by the engine shows in every
    # probe, so the 95th percentile must stay under 100 ms and the worst under 1 s.
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    report = (f"/health p95 {p95 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms over "
              f"{len(latencies)} probes, {steps} steps, max batch {counter.max_batch}")
    print(report)
    assert p95 < 0.1 and latencies[-1] < 1.0, report


def test_disconnect_50_streams_frees_everything(
        served: tuple[ServerThread, AsyncEngine, StepCounter]) -> None:
    server, engine, counter = served
    n_clients = 50

    async def count_tasks() -> int:
        return len(asyncio.all_tasks())

    baseline_tasks = server.call(count_tasks())

    hang_up_mid_stream(server.url, engine, n_clients)
    steps_at_close = counter.steps
    deadline = time.monotonic() + 15
    while engine.num_active or engine.stats.blocks_used or engine.stats.num_running:
        assert time.monotonic() < deadline, (engine.num_active, engine.stats)
        time.sleep(0.01)
    # Aborted within a few steps, not the 200 each stream asked for. How many steps run
    # before the server sees 50 hang-ups depends on the machine's load (6 seen in a full
    # run beside other work): the bound guards the abort, not the machine's speed.
    assert counter.steps - steps_at_close <= 20
    assert engine.stats.blocks_used == 0 and engine.num_queued == 0
    deadline = time.monotonic() + 5
    while server.call(count_tasks()) > baseline_tasks:
        assert time.monotonic() < deadline, "tasks left on the server loop"
        time.sleep(0.02)


def test_non_streaming_disconnect_aborts(
        served: tuple[ServerThread, AsyncEngine, StepCounter]) -> None:
    server, engine, counter = served
    aborted0 = _abort_count(server)
    body = {"prompt": "never read", "max_tokens": 220, "ignore_eos": True}
    counter.delay = 0.01  # 220 steps take > 2 s: the client surely leaves first
    try:
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.3)) as c, \
                pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)  # gives up and closes the socket
    finally:
        counter.delay = 0.0
    steps_at_close = counter.steps
    deadline = time.monotonic() + 15
    while engine.num_active or engine.stats.blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert counter.steps - steps_at_close <= 5
    assert _abort_count(server) == aborted0 + 1


def _abort_count(server: ServerThread) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvserve_request_success_total" and \
                    s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0
