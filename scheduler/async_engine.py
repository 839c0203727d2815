"""The asyncio front of the synchronous EngineCore.

The core is not thread-safe and `step()` blocks for a long time on CPU, so it runs
apart from the event loop, in one of two layouts:
- `thread` (`from_config`'s default, for programs that embed the engine): every call
  into the core (construction included: torch keeps per-thread state) runs on one
  dedicated worker thread of this process;
- `process` (`engine_process=True`, `kvserve serve`'s default): the core lives in a
  process of its own (`scheduler/engine_process.py`); a pump thread hands it
  submissions and aborts over a pipe and a reader thread brings its events back.
Either way the core runs `scheduler/core_loop.py`'s step loop, as vLLM's engine-core
loop does: it applies the submissions and aborts the event loop queued, steps while
anything is unfinished, hands each step's outputs to the event loop and starts the
next step at once. The event loop fans the outputs out to per-request queues and writes
SSE while the model computes the next token; it is never on the path between two steps.
Nothing here knows about HTTP. Requests, streams, queue limits and exceptions live in
`scheduler/async_stream.py` (re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine.sampling import SamplingParams
from policies.config import KVPolicyConfig
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
from scheduler.core_loop import CoreInfo, CoreLoop, Work
from scheduler.engine_process import EngineProcess
from scheduler.outputs import EngineStats, RequestOutput, RequestRejected

if TYPE_CHECKING:
    from scheduler.resolve import ModelLimits

logger = logging.getLogger("kvserve.engine")

CoreFactory = Callable[[StepListener], Any]  # (on_step) -> EngineCore
__all__ = ["AsyncEngine", "EngineError", "EngineUnavailable", "GenerationRequest",
           "QueueFull", "RequestStream"]


class AsyncEngine:
    def __init__(self, core_factory: CoreFactory | None = None, *,
                 process: EngineProcess | None = None, max_queued_requests: int = 1024,
                 max_queued_tokens: int = 1 << 20, warmup: bool = True) -> None:
        """`core_factory` builds the core on the worker thread (the thread layout);
        `process` runs it in a process of its own instead (`from_config` makes either)."""
        assert (core_factory is None) != (process is None), "a core factory or a process"
        self._factory = core_factory
        self._process = process
        # Run scheduler/warmup.py between loading and ready (False: tests of the loading
        # sequence itself, or a core that is not an EngineCore).
        self.warmup = warmup
        self.info: CoreInfo | None = None  # set once loaded
        self.admission = Admission(max_queued_requests, max_queued_tokens)
        # thread layout: the worker; process layout: the pump and the reader
        self._executor = ThreadPoolExecutor(1 if process is None else 2,
                                            thread_name_prefix="kvserve-engine")
        self._loop: CoreLoop | None = None  # the thread layout's
        self.tokenizer: Any = None  # a private copy for the event loop side
        self.max_model_len = 0
        self.vocab_size = 0
        # the core's, for scheduler/resolve.py (the default policy, the longest default
        # max_tokens); None until loaded
        self.limits: ModelLimits | None = None
        self.tenant_quotas: dict[str, float] = {}  # the core's, tenant -> pool fraction
        self.stats = EngineStats()  # the core's, as of its latest event
        self.load_error: BaseException | None = None  # also set when the core dies
        # Called (on the event loop) once if the engine process dies after loading.
        self.on_dead: Callable[[BaseException], None] | None = None
        self.draining = False
        self._stopping = False
        self._loaded = asyncio.Event()
        self._live: dict[str, Live] = {}
        # Queued by the event loop, taken by the worker (or pump) between steps.
        self._work = threading.Condition()
        self._pending_adds: list[tuple[Live, asyncio.Future]] = []
        self._pending_aborts: list[str] = []
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Future | None = None  # the worker's step loop (or pump+reader)
        self.listeners = Listeners()

    @classmethod
    def from_config(cls, config: Any, *, engine_process: bool = False,
                    process_setup: Callable[[], None] | None = None,
                    **options: Any) -> AsyncEngine:
        """An engine over `EngineCore(config)`; `engine_process` puts the core in a
        process of its own, which calls `process_setup` (picklable: logging, diagnostics)
        first."""
        if engine_process:
            return cls(process=EngineProcess(config, options.get("warmup", True), process_setup),
                       **options)
        from scheduler.engine_core import EngineCore

        return cls(lambda on_step: EngineCore(config, on_step=on_step), **options)

    # ---- lifecycle -----------------------------------------------------------------
    @property
    def layout(self) -> str:
        return "thread" if self._process is None else "process"

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None in the thread layout)."""
        return None if self._process is None else self._process.pid

    @property
    def warmup_report(self) -> Any:
        return None if self.info is None else self.info.warmup

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
        """`fn` runs on a worker thread after every step: keep it cheap and thread-safe."""
        self.listeners.step.append(fn)

    def add_output_listener(self, fn: OutputListener) -> None:
        """`fn(output, monotonic_now)` runs on the event loop for every delivered output."""
        self.listeners.output.append(fn)

    async def start(self) -> None:
        """Load the core (on the worker thread, or in the engine process) and start the
        step loop."""
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        try:
            info = await loop.run_in_executor(self._executor, self._load)
        except BaseException as e:
            self.load_error = e
            raise
        self.tokenizer = info.tokenizer
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.limits = info.limits
        self.tenant_quotas = dict(getattr(info.config, "tenant_quotas", None) or {})
        self.stats, self.info = info.stats, info
        if self._process is None:
            self._task = loop.run_in_executor(self._executor, self._run_thread, loop)
        else:
            self._task = asyncio.gather(
                loop.run_in_executor(self._executor, self._pump),
                loop.run_in_executor(self._executor, self._read, loop))
        self._loaded.set()

    def _load(self) -> CoreInfo:
        if self._process is not None:
            return self._process.start()
        assert self._factory is not None
        self._loop = CoreLoop(self._factory(self.listeners.on_step), self.warmup)
        return self._loop.info()

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
        if self._process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, 30.0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- submission ----------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       kv_policy: KVPolicyConfig | None = None, cache_salt: str | None = None,
                       tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """One request's outputs; raises QueueFull/RequestRejected before the first yield.

        `kv_policy` and `params.max_tokens` as `scheduler/resolve.py` resolved them (None:
        the engine's default policy): the engine takes them as they are."""
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
        Each request's kv_policy and max_tokens are as `scheduler/resolve.py` made them
        (the server and `LLM` call it), not checked again here.
        """
        for r in requests:
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

    def _on_event(self, kind: str, *payload: Any) -> None:
        """One of the core loop's events (`scheduler/core_loop.py`), on the event loop."""
        if kind == "died":
            self._died(payload[0])
            return
        self.stats = payload[-1]
        if kind == "accepted":
            self._accepted(payload[0], payload[1])
        elif kind == "step":
            self._dispatch(payload[0], payload[1])
        else:
            self._step_failed(payload[0])

    def _died(self, exit_code: int | None) -> None:
        """The engine process exited without being asked to: fail everything in flight,
        refuse new work (503) and tell the server, which exits so that a supervisor
        restarts it."""
        if self._stopping:
            return
        err = EngineError(f"the engine process died (exit code {exit_code})")
        logger.error("the engine process died", extra={"fields": {"exit_code": exit_code}})
        self.load_error = err
        for rid in list(self._live):
            self._fail(rid, err)
        if self.on_dead is not None:
            self.on_dead(err)

    def _notify(self) -> None:
        with self._work:
            self._work.notify()

    # ---- worker threads only -----------------------------------------------------------
    def _take(self, block: bool) -> Work:
        """What the event loop queued (waiting for some if `block`); the adds' token is
        their (Live, future) pairs, answered by an "accepted" event."""
        with self._work:
            while block and not (self._stopping or self._pending_adds or self._pending_aborts):
                self._work.wait()
            if self._stopping:
                return Work(stop=True)
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
        return Work([live.req for live, _ in adds], aborts, token=adds)

    def _run_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """The thread layout: the step loop itself, on the worker thread."""
        assert self._loop is not None
        self._loop.run(self._take, lambda *event: loop.call_soon_threadsafe(
            self._on_event, *event))

    def _pump(self) -> None:
        """The process layout: hand what the event loop queued to the engine process."""
        assert self._process is not None
        while True:
            work = self._take(True)
            if work.stop:
                self._process.stop()
                return
            try:
                self._process.send(work)
            except OSError:  # the process is gone; the reader reports it
                return

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """The process layout: the engine's events to the event loop, step listeners
        here (they must not wait for the event loop)."""
        assert self._process is not None
        for event in self._process.events():
            if event[0] == "step":
                for stats in event[3]:
                    self.listeners.on_step(stats)
            loop.call_soon_threadsafe(self._on_event, *event)
