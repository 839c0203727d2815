"""The asyncio front of the synchronous EngineCore.

The core is not thread-safe and `step()` blocks for a long time on CPU, so every call
into it (construction included: torch keeps per-thread state) runs on one dedicated
worker thread. That thread runs the step loop itself, as vLLM's engine-core loop does:
it applies the submissions and aborts the event loop queued, steps while anything is
unfinished, hands each step's outputs to the event loop and starts the next step at
once. The event loop fans the outputs out to per-request queues and writes SSE while
the model computes the next token; it is never on the path between two steps. (Until
issue 22 each step was a round trip through the event loop, which waited for a slice
of the CPU before the next step could start.)
Nothing here knows about HTTP. Requests, streams, queue limits and exceptions live in
`scheduler/async_stream.py` (re-exported here).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine.sampling import SamplingParams
from policies.config import parse_kv_policy
from scheduler.async_stream import (
    Admission,
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    Listeners,
    Live,
    OutputListener,
    QueueFull,
    RequestStream,
    StepListener,
)
from scheduler.limits import fit_max_tokens, shifts_rope
from scheduler.outputs import EngineStats, RequestOutput, RequestRejected

if TYPE_CHECKING:
    from scheduler.warmup import Warmup

logger = logging.getLogger("kvserve.engine")

CoreFactory = Callable[[StepListener], Any]  # (on_step) -> EngineCore
__all__ = ["AsyncEngine", "EngineError", "EngineUnavailable", "GenerationRequest",
           "QueueFull", "RequestStream"]


class AsyncEngine:
    def __init__(self, core_factory: CoreFactory, *, max_queued_requests: int = 1024,
                 max_queued_tokens: int = 1 << 20, warmup: bool = True) -> None:
        self._factory = core_factory
        # Run scheduler/warmup.py between loading and ready (False: tests of the loading
        # sequence itself, or a core that is not an EngineCore).
        self.warmup = warmup
        self.warmup_report: Warmup | None = None
        self.admission = Admission(max_queued_requests, max_queued_tokens)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-engine")
        self._core: Any = None
        self.tokenizer: Any = None  # a private copy for the event loop side
        self.max_model_len = 0
        self.vocab_size = 0
        self.max_request_tokens = 0  # min(context, whole pool) in tokens
        # the core's policy for requests naming none: a name, an object or a parsed config
        self.default_kv_policy: Any = "full"
        self.tenant_quotas: dict[str, float] = {}  # the core's, tenant -> pool fraction
        self.stats = EngineStats()  # refreshed by the worker after every core call
        self.load_error: BaseException | None = None
        self.draining = False
        self._stopping = False
        self._loaded = asyncio.Event()
        self._live: dict[str, Live] = {}
        # Queued by the event loop, taken by the worker between steps, under `_work`.
        self._work = threading.Condition()
        self._pending_adds: list[tuple[Live, asyncio.Future]] = []
        self._pending_aborts: list[str] = []
        self._core_busy = False  # the worker's own: the core has unfinished requests
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Future | None = None  # the worker's step loop
        self.listeners = Listeners()

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> AsyncEngine:
        from scheduler.engine_core import EngineCore

        return cls(lambda on_step: EngineCore(config, on_step=on_step), **options)

    # ---- lifecycle -----------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()  # set on the loop once the step loop runs

    @property
    def ready(self) -> bool:
        return self.loaded and not self.draining and not self._stopping

    @property
    def num_active(self) -> int:
        return len(self._live)

    @property
    def num_queued(self) -> int:
        """Admitted requests without a first token yet (what the queue limits count)."""
        return self.admission.num_queued

    @property
    def max_queued_requests(self) -> int:
        return self.admission.max_requests

    @property
    def max_queued_tokens(self) -> int:
        return self.admission.max_tokens

    @property
    def num_pending(self) -> int:
        """Admitted requests not yet handed to the core."""
        return len(self._pending_adds)

    def add_step_listener(self, fn: StepListener) -> None:
        """`fn` runs on the worker thread after every step: keep it cheap and thread-safe."""
        self.listeners.step.append(fn)

    def add_output_listener(self, fn: OutputListener) -> None:
        """`fn(output, monotonic_now)` runs on the event loop for every delivered output."""
        self.listeners.output.append(fn)

    async def start(self) -> None:
        """Load the core on the worker thread and start the step loop."""
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        try:
            await loop.run_in_executor(self._executor, self._load)
        except BaseException as e:
            self.load_error = e
            raise
        self._task = loop.run_in_executor(self._executor, self._worker_loop, loop)
        self._loaded.set()

    def _load(self) -> None:
        core = self._factory(self.listeners.on_step)
        if self.warmup:
            from scheduler.warmup import warm_up  # imports torch: not at CLI start-up

            self.warmup_report = warm_up(core)
        self.tokenizer = copy.deepcopy(core.tokenizer)
        self.tokenizer.encode("warm up")  # the copy's first call pays its own set-up
        self.max_model_len = int(core.max_model_len)
        self.vocab_size = int(core.model_config.vocab_size)
        config = getattr(core, "config", None)
        self.default_kv_policy = getattr(config, "default_kv_policy", None) or "full"
        self.tenant_quotas = dict(getattr(config, "tenant_quotas", None) or {})
        self.stats = self._stats(core)
        cap = self.max_model_len
        block_size = getattr(config, "block_size", None)
        layers = getattr(core.model_config, "num_layers", None)
        if block_size and layers and self.stats.blocks_total:
            cap = min(cap, self.stats.blocks_total // layers * block_size)
        self.max_request_tokens = cap
        self._core = core

    async def wait_loaded(self) -> None:
        await self._loaded.wait()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, let in-flight requests finish for up to `timeout` seconds,
        then abort the rest. True when everything finished in time."""
        self.draining = True
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            err = EngineUnavailable("the server is shutting down", "draining")
            for rid in list(self._live):
                self._fail(rid, err)
            return False

    async def shutdown(self) -> None:
        self._stopping = True
        for rid in list(self._live):
            self._fail(rid, EngineUnavailable("the server is shutting down", "stopped"))
        self._notify()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- submission ----------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       kv_policy: object | None = None, cache_salt: str | None = None,
                       tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """One request's outputs; raises QueueFull/RequestRejected before the first yield."""
        req = GenerationRequest(prompt_ids, params, request_id or uuid.uuid4().hex,
                                priority, kv_policy, cache_salt=cache_salt, tenant=tenant)
        async with await self.submit([req]) as stream:
            async for out in stream:
                yield out

    def check_admission(self, num_requests: int, num_tokens: int) -> None:
        """Raise what `submit` would for a group of this size, without submitting."""
        if self.load_error is not None:
            raise EngineUnavailable(f"the model failed to load: {self.load_error}", "failed")
        if not self.loaded:
            raise EngineUnavailable("the model is still loading", "loading")
        if self.draining or self._stopping:
            raise EngineUnavailable("the server is draining and admits no new requests",
                                    "draining")
        self.admission.check(num_requests, num_tokens)

    async def submit(self, requests: list[GenerationRequest]) -> RequestStream:
        """Admit a group atomically (all or none) and wait until the core accepted it.

        Raises EngineUnavailable, QueueFull or RequestRejected; nothing stays queued then.
        """
        for r in requests:
            if self.loaded:  # the core's own rule, checked before anything is queued
                policy = parse_kv_policy(r.kv_policy if r.kv_policy is not None
                                         else self.default_kv_policy)
                fit_max_tokens(len(r.prompt_ids), r.params.max_tokens, self.max_model_len,
                               rope_shift=shifts_rope(policy))
            if r.request_id in self._live:
                raise RequestRejected(f"duplicate request id {r.request_id!r}", "request_id")
        self.check_admission(len(requests), sum(len(r.prompt_ids) for r in requests))
        assert self._task is not None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        members, futures = [], []
        now = time.monotonic()
        for r in requests:
            if r.arrival_time is None:
                r.arrival_time = now
            live = Live(r, queue)
            self._live[r.request_id] = live
            self.admission.enqueue(live)
            members.append(live)
            futures.append(loop.create_future())
        self._idle.clear()  # type: ignore[union-attr]
        with self._work:
            self._pending_adds.extend(zip(members, futures))
            self._work.notify()
        stream = RequestStream(self._abort, members, queue)
        try:
            await asyncio.gather(*futures)
        except BaseException:
            stream.abort()
            raise
        return stream

    # ---- loop-thread bookkeeping -----------------------------------------------------
    def _forget(self, rid: str) -> Live | None:
        live = self._live.pop(rid, None)
        if live is not None:
            self.admission.release(live)
            if not self._live and self._idle is not None:
                self._idle.set()
        return live

    def _abort(self, rid: str, err: BaseException | None = None) -> None:
        """Drop a request; the worker frees its blocks before the next step. A submitter
        still waiting for acceptance gets `err` (or a cancellation)."""
        live = self._forget(rid)
        if live is None:
            return
        with self._work:
            for i, (pending, fut) in enumerate(self._pending_adds):
                if pending is live:
                    del self._pending_adds[i]
                    if not fut.done():
                        fut.set_exception(err) if err is not None else fut.cancel()
                    break
            else:  # with the core, or on its way there: the worker aborts it
                self._pending_aborts.append(rid)
                self._work.notify()
        self.listeners.on_output(RequestOutput(rid, [], "", None, finished=True, finish_reason="abort",
                                   num_prompt_tokens=len(live.req.prompt_ids),
                                   arrival_time=live.req.arrival_time or 0.0))

    def _fail(self, rid: str, err: BaseException) -> None:
        live = self._live.get(rid)
        if live is not None:
            self._abort(rid, err)
            live.queue.put_nowait(err)

    def _dispatch(self, outputs: list[RequestOutput], seconds: float) -> None:
        """A step's outputs, on the event loop (scheduled by the worker)."""
        self.admission.observe_step(seconds)
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # aborted while the step ran
                continue
            self.admission.release(live)
            if out.finished:
                self._forget(out.request_id)
            self.listeners.on_output(out)
            live.queue.put_nowait(out)

    def _accepted(self, adds: list[tuple[Live, asyncio.Future]],
                  results: list[BaseException | None]) -> None:
        """The core's answer to submissions, on the event loop."""
        for (live, fut), res in zip(adds, results):
            if res is not None:
                self._forget(live.req.request_id)
            if not fut.done():
                fut.set_result(None) if res is None else fut.set_exception(res)

    def _step_failed(self, err: Exception) -> None:
        logger.error("engine step failed; failing %d requests", len(self._live),
                     exc_info=err)
        error = EngineError(f"engine step failed: {err}")
        for rid in list(self._live):
            self._fail(rid, error)

    def _notify(self) -> None:
        with self._work:
            self._work.notify()

    # ---- worker thread only ------------------------------------------------------------
    def _worker_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The step loop: wait for work, apply what the event loop queued, step, repeat.
        Everything the event loop must see goes back through `call_soon_threadsafe`."""
        while True:
            with self._work:
                while not (self._stopping or self._pending_adds or self._pending_aborts
                           or self._core_busy):
                    self._work.wait()
                if self._stopping:
                    return
                adds, self._pending_adds = self._pending_adds, []
                aborts, self._pending_aborts = self._pending_aborts, []
            if adds or aborts:
                try:
                    results = self._apply(adds, aborts)
                except Exception as e:  # a broken core: fail what was submitted
                    logger.exception("applying submissions failed")
                    results = [e] * len(adds)
                    self._core_busy = False
                loop.call_soon_threadsafe(self._accepted, adds, results)
            if self._core_busy:
                t0 = time.perf_counter()
                try:
                    outputs = self._step()
                except Exception as e:
                    # Nothing steps again until the event loop's aborts of the failed
                    # requests arrive (the core may fail the same way every time).
                    self._core_busy = False
                    loop.call_soon_threadsafe(self._step_failed, e)
                    continue
                loop.call_soon_threadsafe(self._dispatch, outputs, time.perf_counter() - t0)

    def _apply(self, adds: list[tuple[Live, asyncio.Future]],
               aborts: list[str]) -> list[BaseException | None]:
        core = self._core
        for rid in aborts:
            core.abort_request(rid)
        results: list[BaseException | None] = []
        for live, _ in adds:
            r = live.req
            try:
                core.add_request(r.request_id, r.prompt_ids, r.params, priority=r.priority,
                                 kv_policy=r.kv_policy, arrival_time=r.arrival_time,
                                 cache_salt=r.cache_salt, tenant=r.tenant)
                results.append(None)
            except Exception as e:
                results.append(e)
        self._core_busy = core.has_unfinished()
        self.stats = self._stats(core)
        return results

    def _step(self) -> list[RequestOutput]:
        core = self._core
        try:
            return core.step()
        finally:
            self._core_busy = core.has_unfinished()
            self.stats = self._stats(core)

    def _stats(self, core: Any) -> EngineStats:
        """The core's stats, counters since the warm-up (its requests are no client's)."""
        stats = core.stats()
        if self.warmup_report is not None:
            stats = stats.since(self.warmup_report.baseline)
        return stats
