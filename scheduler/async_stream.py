"""What `AsyncEngine` hands out and raises: submissions, per-request streams, admission
limits and the exceptions the server maps to HTTP statuses. Nothing here knows about
HTTP or touches the engine core."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling import SamplingParams
from policies.config import KVPolicyConfig
from scheduler.outputs import RequestOutput, RequestRejected, StepStats

logger = logging.getLogger("kvserve.engine")
StepListener = Callable[[StepStats], None]
OutputListener = Callable[[RequestOutput, float], None]


class QueueFull(Exception):
    """The admission queue is over a limit; retrying later may succeed."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailable(Exception):
    """The engine is loading, draining, stopped or failed to load (HTTP 503)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineError(RuntimeError):
    """The engine step failed; the requests in flight are lost (a bug, not bad input)."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    priority: int = 0
    kv_policy: KVPolicyConfig | None = None  # resolved (scheduler/resolve.py); None: default
    arrival_time: float | None = None
    cache_salt: str | None = None  # enters the prefix-cache keys (tenant isolation)
    tenant: str | None = None  # quota accounting and per-tenant statistics


@dataclass(eq=False)
class Live:
    """A submitted engine request, from admission until it finished or was aborted."""

    req: GenerationRequest
    queue: asyncio.Queue
    queued: bool = True  # counted against the queue limits until its first output


class Admission:
    """The queue limits: requests admitted and without a first token yet, and their
    prompt tokens. Event-loop side only."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.num_queued = 0
        self.queued_tokens = 0
        self.step_ewma_s = 0.0  # for Retry-After

    def check(self, num_requests: int, num_tokens: int) -> None:
        if num_requests > self.max_requests:
            raise RequestRejected(f"{num_requests} sequences exceed the queue limit of "
                                  f"{self.max_requests}", "n")
        if num_tokens > self.max_tokens:
            raise RequestRejected(f"{num_tokens} prompt tokens exceed the queue limit of "
                                  f"{self.max_tokens} tokens", "prompt")
        if (self.num_queued + num_requests > self.max_requests
                or self.queued_tokens + num_tokens > self.max_tokens):
            raise QueueFull(
                f"the queue is full ({self.num_queued} requests, {self.queued_tokens} "
                f"prompt tokens waiting); retry later", self.retry_after())

    def enqueue(self, live: Live) -> None:
        self.num_queued += 1
        self.queued_tokens += len(live.req.prompt_ids)

    def release(self, live: Live) -> None:
        if live.queued:
            live.queued = False
            self.num_queued -= 1
            self.queued_tokens -= len(live.req.prompt_ids)

    def observe_step(self, seconds: float) -> None:
        e = self.step_ewma_s
        self.step_ewma_s = seconds if not e else 0.9 * e + 0.1 * seconds

    def retry_after(self) -> int:
        return int(min(60, max(1, math.ceil(2 * self.step_ewma_s))))


class RequestStream:
    """Outputs of one submission (one or more engine requests) in arrival order.

    Every output carries its `request_id`. Iteration ends when all members finished.
    Closing the stream, or cancelling the task that iterates it, aborts what is left
    (through `abort_one`, the engine's abort).
    """

    def __init__(self, abort_one: Callable[[str], None], members: list[Live],
                 queue: asyncio.Queue) -> None:
        self._abort_one = abort_one
        self._queue = queue
        self.request_ids = [m.req.request_id for m in members]
        self._unfinished = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        for rid in list(self._unfinished):
            self._abort_one(rid)
        self._unfinished.clear()

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class Listeners:
    """Observers of the engine (metrics): a failing listener is logged, never fatal."""

    def __init__(self) -> None:
        self.step: list[StepListener] = []
        self.output: list[OutputListener] = []

    def on_step(self, stats: StepStats) -> None:
        """Worker thread, after every step."""
        for fn in self.step:
            try:
                fn(stats)
            except Exception:
                logger.exception("step listener failed")

    def on_output(self, out: RequestOutput) -> None:
        """Event loop, for every delivered output (aborts included)."""
        now = time.monotonic()
        for fn in self.output:
            try:
                fn(out, now)
            except Exception:
                logger.exception("output listener failed")
