"""The engine core in a process of its own (`--engine-layout process`,
scheduler/engine_process.py): the same answers as the thread layout, disconnects and
aborts that cross the pipe, stats and step metrics that come back over it, and a dead
engine process that fails what was in flight and refuses new work instead of hanging.

A real uvicorn on loopback serves a tiny model whose core runs in a spawned process.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from engine.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine, EngineError, EngineUnavailable
from scheduler.async_stream import GenerationRequest
from scheduler.engine_core import EngineConfig
from scheduler.outputs import RequestRejected
from server.app import build_app
from server.settings import ServerSettings
from server.testing import ServerThread
from tests.live_server import hang_up_mid_stream
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The spawned engine reads OpenMP's settings from the environment (the parent's
    torch.set_num_threads does not cross): one thread, as every test model runs."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = before


def _serve(model_dir: str, fatal: list[BaseException] | None = None
           ) -> tuple[ServerThread, AsyncEngine]:
    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=1024),
                                     engine_process=True)
    settings = ServerSettings(served_model_names=["tiny"], model_path=model_dir,
                              on_fatal=None if fatal is None else fatal.append)
    return ServerThread(build_app(engine, settings)), engine


@pytest.fixture(scope="module")
def served(model_dir: str, one_thread: None) -> Iterator[tuple[ServerThread, AsyncEngine]]:
    server, engine = _serve(model_dir)
    with server:
        yield server, engine


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return 0.0


def _wait(cond: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_same_tokens_as_the_thread_layout(served: tuple[ServerThread, AsyncEngine],
                                               model_dir: str) -> None:
    server, engine = served
    assert engine.layout == "process" and engine.engine_pid not in (None, os.getpid())
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)

    async def run(e: AsyncEngine) -> list:
        return [o async for o in e.generate([5, 6, 7, 8], SamplingParams(**params))]

    async def thread_layout() -> list:
        e = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=1024))
        await e.start()
        try:
            return await run(e)
        finally:
            await e.shutdown()

    ours = server.call(run(engine))
    theirs = asyncio.run(thread_layout())
    assert [o.new_token_ids for o in ours] == [o.new_token_ids for o in theirs]
    assert [[lp.top for lp in o.logprobs] for o in ours] == \
        [[lp.top for lp in o.logprobs] for o in theirs]
    assert ours[-1].finish_reason == "length" and ours[-1].kv is not None

    # over HTTP, with the step metrics that crossed the pipe
    steps0 = _metric(server.url, "kvserve_engine_step_seconds_count")
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 12,
                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    _wait(lambda: _metric(server.url, "kvserve_engine_step_seconds_count") >= steps0 + 12)
    assert _metric(server.url, "kvserve_generation_tokens_total") >= 24
    # the engine process's own memory: the model is there, not in the API process
    assert _metric(server.url, "kvserve_engine_process_resident_memory_bytes") > 50 * 2**20
    assert _metric(server.url, "kvserve_engine_process_cpu_seconds_total") > 0


def test_the_engine_process_freezes_its_loaded_heap(served: tuple[ServerThread, AsyncEngine],
                                                     model_dir: str) -> None:
    """Once loaded and warmed up, the engine process moves its heap (torch, transformers,
    the model) out of the garbage collector's sight, so a full collection never walks
    it while streams wait; a core on a thread freezes nothing itself (the server's app
    freezes the process it shares, server/app.py)."""
    _, engine = served
    assert engine.info is not None and engine.info.frozen_objects > 100_000

    async def thread_layout() -> int:
        e = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=1024))
        await e.start()
        try:
            assert e.info is not None
            return e.info.frozen_objects
        finally:
            await e.shutdown()

    assert asyncio.run(thread_layout()) == 0


def test_rejections_cross_the_pipe(served: tuple[ServerThread, AsyncEngine]) -> None:
    """What the core refuses in the engine process reaches the submitter as the same
    exception, with its field, and nothing stays behind."""
    server, engine = served

    async def submit() -> None:
        await engine.submit([GenerationRequest([10**6], SamplingParams(max_tokens=2))])

    with pytest.raises(RequestRejected, match="vocabulary") as info:
        server.call(submit())
    assert info.value.param == "prompt"
    assert engine.num_active == 0 and engine.num_queued == 0


def test_disconnects_abort_in_the_engine_process(
        served: tuple[ServerThread, AsyncEngine]) -> None:
    server, engine = served
    n_clients = 20
    aborted0 = _metric(server.url, "kvserve_request_success_total", finished_reason="abort")
    gen0 = _metric(server.url, "kvserve_generation_tokens_total")
    hang_up_mid_stream(server.url, engine, n_clients)
    # the stats come from the engine process: its blocks are free again
    _wait(lambda: not (engine.num_active or engine.stats.blocks_used
                       or engine.stats.num_running))
    assert _metric(server.url, "kvserve_request_success_total",
                   finished_reason="abort") == aborted0 + n_clients
    # aborted long before their 200 tokens each
    assert _metric(server.url, "kvserve_generation_tokens_total") - gen0 < n_clients * 100


def test_a_dead_engine_process_fails_requests_and_the_server(model_dir: str,
                                                             one_thread: None) -> None:
    fatal: list[BaseException] = []
    server, engine = _serve(model_dir, fatal)
    with server:
        events: list[str] = []
        with httpx.Client(base_url=server.url, timeout=60) as c, \
                c.stream("POST", "/v1/completions",
                         json={"prompt": "doomed", "max_tokens": 240, "stream": True,
                               "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3:
                    os.kill(engine.engine_pid, signal.SIGKILL)  # type: ignore[arg-type]
        assert events[-1] == "data: [DONE]"
        assert '"code":"engine_error"' in events[-2] and "died" in events[-2]
        _wait(lambda: bool(fatal))
        assert isinstance(fatal[0], EngineError) and engine.num_active == 0
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "failed"
        assert httpx.get(server.url + "/health").status_code == 503


def _note_pid(path: str) -> None:
    Path(path).write_text(str(os.getpid()))


def test_a_model_that_fails_to_load_in_the_engine_process(tmp_path: Path,
                                                         one_thread: None) -> None:
    """...and `process_setup` (the CLI's logging and KVSERVE_MEMDEBUG) runs in the
    engine process before it loads anything."""
    setup = tmp_path / "setup.pid"

    async def main() -> None:
        engine = AsyncEngine.from_config(EngineConfig(model=str(tmp_path)),
                                         engine_process=True,
                                         process_setup=partial(_note_pid, str(setup)))
        with pytest.raises(Exception) as info:
            await engine.start()
        assert engine.load_error is info.value
        with pytest.raises(EngineUnavailable, match="failed to load"):
            await engine.submit([GenerationRequest([1, 2], SamplingParams(max_tokens=2))])
        await engine.shutdown()
        assert engine._process is not None and not engine._process.process.is_alive()
        assert int(setup.read_text()) == engine.engine_pid != os.getpid()

    asyncio.run(main())


def test_the_cli_sets_up_the_engine_process(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """What `kvserve serve` hands the engine process: its log settings and, with
    KVSERVE_MEMDEBUG, a memory watch of its own (lines carry the pid)."""
    import logging
    import threading

    from server.cli import engine_process_setup

    monkeypatch.setenv("KVSERVE_MEMDEBUG", "0.05")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    watch = None
    try:
        watch = engine_process_setup("warning", "json")
        assert root.level == logging.WARNING and watch is not None
        assert any(t.name == "kvserve-memwatch" for t in threading.enumerate())
    finally:
        if watch is not None:
            watch.stop()
        root.handlers[:] = handlers
        root.setLevel(level)


def test_soak_counts_the_engine_process_memory(served: tuple[ServerThread, AsyncEngine]
                                               ) -> None:
    """A soak against a running server reads RSS from /metrics: both processes."""
    from loadtest.soak import Soak, build_parser

    server, _ = served
    rss = Soak(build_parser().parse_args(["--base-url", server.url]), server.url,
               None).rss_now()
    engine = _metric(server.url, "kvserve_engine_process_resident_memory_bytes")
    api = _metric(server.url, "process_resident_memory_bytes")
    assert engine > 0 and api > 0
    assert rss is not None and rss > api + engine / 2  # the engine's is counted
    assert abs(rss - (engine + api)) < 0.05 * (engine + api)  # two scrapes apart


def test_structured_outputs_and_their_refusals_cross_the_pipe(
        served: tuple[ServerThread, AsyncEngine]) -> None:
    """The grammar is compiled and matched in the engine process; a bad spec is a 400
    naming its field, as in the thread layout."""
    pytest.importorskip("xgrammar")
    server, _ = served
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "seed": 4,
                                               "guided_regex": "[a-c]{3}"})
        assert ok.status_code == 200, ok.text
        assert re.fullmatch("[a-c]{3}", ok.json()["choices"][0]["text"])
        bad = c.post("/v1/completions", json={"prompt": "x", "guided_regex": "[a-c"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
