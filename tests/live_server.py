"""A tiny model served by a real uvicorn on loopback, shared by the API test modules (so
each one states only what differs: the served names and the engine's settings)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from server.app import build_app
from server.settings import ServerSettings
from server.testing import ServerThread


@contextmanager
def tiny_server(model_dir: str, names: tuple[str, ...] = ("tiny",),
                settings: dict[str, object] | None = None,
                **engine: object) -> Iterator[ServerThread]:
    """`model_dir` served under `names` (127.0.0.1, ephemeral port); `settings`:
    ServerSettings fields; `engine`: EngineConfig fields (default a 512-block pool)."""
    config = EngineConfig(model=model_dir, **{"num_blocks": 512, **engine})  # type: ignore[arg-type]
    app = build_app(AsyncEngine.from_config(config),
                    ServerSettings(served_model_names=list(names), model_path=model_dir,
                                   **(settings or {})))  # type: ignore[arg-type]
    with ServerThread(app) as s:
        yield s


def openai_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180.0) -> None:
    """Poll a spawned `kvserve serve`'s /ready until 200; fail with its log if the
    process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as c:
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "server did not become ready"
            try:
                if c.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)


def hang_up_mid_stream(url: str, engine: object, n_clients: int, max_tokens: int = 200
                       ) -> None:
    """`n_clients` streams, each read until its third chunk; once all are that far (and
    the engine holds them all, with blocks), every client closes its socket."""
    import asyncio

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()
        streaming = 0

        async def one(i: int) -> None:
            nonlocal streaming
            body = {"prompt": f"long story {i}", "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True}
            async with httpx.AsyncClient(base_url=url, timeout=120) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 3:  # mid-generation: a couple of tokens in
                        streaming += 1
                        if streaming == n_clients:
                            started.set()
                        await release.wait()
                        break
            # leaving both context managers closes the socket: the server sees a disconnect

        tasks = [asyncio.create_task(one(i)) for i in range(n_clients)]
        await asyncio.wait_for(started.wait(), 120)
        assert engine.num_active == n_clients  # type: ignore[attr-defined]
        assert engine.stats.blocks_used > 0  # type: ignore[attr-defined]
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
