"""Run the app under a real uvicorn in a background thread (tests, notebooks, load tests).

A real server on 127.0.0.1 with an ephemeral port exercises what an in-process ASGI
client cannot: sockets, SSE framing, client disconnects, and an event loop that must
stay responsive while the engine thread computes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any

import httpx
import uvicorn


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        self.config = uvicorn.Config(app, host=host, port=0, log_config=None, lifespan="on",
                                     timeout_graceful_shutdown=2, access_log=False)
        self.server = uvicorn.Server(self.config)
        self.host = host
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="uvicorn", daemon=True)

    def _main(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(serve())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0, wait_ready: bool = True) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        if wait_ready:
            self.wait_ready(deadline - time.monotonic())
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while client.get("/ready").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the engine did not become ready")
                time.sleep(0.05)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's event loop (to inspect engine state safely)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
