"""The engine core in a process of its own (vLLM v1's EngineCore process).

`kvserve serve --engine-process` splits the server in two. The API process does HTTP,
tokenization, SSE and metrics. The engine process loads the model and runs the
`CoreLoop`, the same step loop the thread layout runs. They share no Python
interpreter, so the API side's work (JSON, SSE framing, the event loop) never waits for
the engine's GIL between two kernels, and the other way round. What crosses the pipe
is plain data, pickled: submitted requests (ids and sampling parameters), abort ids,
output deltas (ids and detokenized text) and stats; never a tensor.

Detokenization stays with the core, unlike vLLM's: stop strings are stop conditions,
and checking them in the step that produced them keeps a stopped request from
computing one more token and its KV, in both layouts.

The pipe is one `multiprocessing` connection. The API side writes it from one thread
(the pump: a burst of submissions never blocks the event loop on a full pipe) and reads
it on another; the engine process reads between steps and blocks on it only when idle.
If the engine process dies, the reader sees the pipe close and the API side fails what
was in flight (`AsyncEngine` reports it dead).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import pickle
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from attention.sizing import KVPoolTooSmall
from scheduler.async_stream import EngineError
from scheduler.core_loop import CoreInfo, CoreLoop, Work

logger = logging.getLogger("kvserve.engine")


def portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else an EngineError that says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return EngineError(f"{type(e).__name__}: {e}")


def freeze_heap() -> int:
    """Take every object the process holds out of the cyclic garbage collector's sight
    (`gc.freeze`, after a collection so that no garbage is kept); returns how many.
    Why: a full collection walks every tracked object, and a process with torch,
    transformers and a model loaded holds ~400k: one took ~200 ms beside a loaded 3M
    engine (docs/benchmarks.md at commit ba98c4b), a stall of every stream whenever Python
    starts one; frozen, a collection walks only what was made since (~0.01 ms). vLLM
    freezes its heap the same way after its warm-up (`freeze_gc_heap`). Called where a
    process keeps its model until it exits: the engine process once loaded and warmed up
    (`core_main`), and the server's API process once the engine has started
    (server/app.py; in the thread layout the engine lives there). Not by the offline
    `LLM`: a frozen heap is never collected, wrong for a caller's own process."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def core_main(config: Any, conn: Connection, warmup: bool,
              process_setup: Callable[[], None] | None) -> None:
    """The engine process: load the core, answer with its `CoreInfo`, run the loop."""
    # Ctrl-C reaches the whole process group; the API process drains and then says stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if process_setup is not None:
        process_setup()
    from scheduler.engine_core import EngineCore

    steps: list = []
    try:
        loop = CoreLoop(EngineCore(config, on_step=steps.append), warmup)
        frozen = freeze_heap()
        logger.info("engine heap frozen", extra={"fields": {"objects": frozen}})
        info = loop.info()
        info.frozen_objects = frozen
        conn.send(("loaded", info))
    except BaseException as e:
        if isinstance(e, KVPoolTooSmall):  # the user's to fix: the message says how
            logger.error("the engine process cannot size the KV pool: %s", e)
        else:
            logger.exception("the engine process failed to load the model")
        conn.send(("load_failed", portable(e)))
        return

    def take(block: bool) -> Work:
        """Everything the pipe holds, merged (waiting for a first message if `block`).
        The token is the list of (batch id, size) the results answer."""
        work, batches = Work(), []
        try:
            while (block and not batches and not work.aborts) or conn.poll(0):
                msg: Work = conn.recv()
                if msg.stop:
                    return Work(stop=True)
                if msg.adds:
                    batches.append((msg.token, len(msg.adds)))
                work.adds += msg.adds
                work.aborts += msg.aborts
        except EOFError:  # the API process is gone
            return Work(stop=True)
        work.token = batches
        return work

    def emit(kind: str, *payload: Any) -> None:
        if kind == "accepted":
            token, results, stats = payload
            payload = (token, [None if r is None else portable(r) for r in results], stats)
        elif kind == "failed":
            logger.error("engine step failed", exc_info=payload[0])
            payload = (portable(payload[0]), payload[1])
        with contextlib.suppress(OSError):  # the API process is gone: `take` stops next
            conn.send((kind, *payload))

    loop.run(take, emit, steps)


class EngineProcess:
    """The API side's handle on the engine process."""

    def __init__(self, config: Any, warmup: bool = True,
                 process_setup: Callable[[], None] | None = None) -> None:
        self.config, self.warmup, self.process_setup = config, warmup, process_setup
        self.process: Any = None
        self._conn: Connection | None = None
        self._sent: dict[int, Any] = {}  # batch id -> the API side's token for it
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> CoreInfo:
        """Spawn the process and wait until the model is loaded (blocking)."""
        ctx = mp.get_context("spawn")  # never fork a process that has threads
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=core_main, name="kvserve-engine-core", daemon=True,
                                   args=(self.config, child, self.warmup, self.process_setup))
        self.process.start()
        child.close()  # ours closes the pipe's far end: EOF when the process dies
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise EngineError("the engine process exited while loading the model "
                              f"(exit code {self.process.exitcode})") from None
        if kind == "load_failed":
            self.process.join(5)
            raise payload
        return payload

    def send(self, work: Work) -> None:
        """Hand submissions and aborts over (the pump thread only)."""
        assert self._conn is not None
        token, work.token = work.token, None
        if work.adds:
            with self._lock:
                self._next_id += 1
                work.token, self._sent[self._next_id] = self._next_id, token
        self._conn.send(work)

    def stop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):  # already gone
                self._conn.send(Work(stop=True))

    def events(self) -> Iterator[tuple]:
        """The engine's events in order (the reader thread only), with each accepted
        batch's id turned back into the token `send` was given; ("died", exit code)
        last when the pipe closes."""
        assert self._conn is not None
        while True:
            try:
                kind, *payload = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(10)
                yield ("died", self.process.exitcode)
                return
            if kind != "accepted":
                yield (kind, *payload)
                continue
            batches, results, stats = payload
            at = 0
            for batch_id, size in batches:
                with self._lock:
                    token = self._sent.pop(batch_id)
                yield ("accepted", token, results[at:at + size], stats)
                at += size
            if not batches:  # aborts only: the stats still change
                yield ("accepted", [], [], stats)

    def join(self, timeout: float) -> int | None:
        """Wait for the process to exit after `stop`; kill it past `timeout`."""
        if self.process is None:
            return None
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop; killing it")
            self.process.kill()
            self.process.join(5)
        if self._conn is not None:
            self._conn.close()
        return self.process.exitcode
