"""The step loop around one EngineCore, the same in both of the server's layouts.

`AsyncEngine` runs the core either on a worker thread of the API process or in a
process of its own (`scheduler/engine_process.py`, vLLM v1's EngineCore process). Either
way the core sits in this loop: take what the API side queued (submissions, aborts),
apply it, step while anything is unfinished, and hand every result back without waiting
for the API side to read it. Only `take` (where work comes from) and `emit` (where
results go) differ: a condition variable and `call_soon_threadsafe` on a thread, a pipe
in the process. What crosses is plain data: requests, ids, output deltas and stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.async_stream import GenerationRequest
from scheduler.outputs import EngineStats, RequestOutput, StepStats

if TYPE_CHECKING:
    from scheduler.resolve import ModelLimits
    from scheduler.warmup import Warmup

logger = logging.getLogger("kvserve.engine")


@dataclass
class Work:
    """What the API side queued since the loop last looked."""

    adds: list[GenerationRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    token: Any = None  # the API side's handle of `adds`, handed back with their results
    stop: bool = False


@dataclass
class CoreInfo:
    """What the API side learns once the core is loaded (all picklable)."""

    tokenizer: Any  # a copy of the core's, for tokenizing on the API side
    max_model_len: int
    vocab_size: int
    limits: ModelLimits  # what resolving a request needs (scheduler/resolve.py)
    stats: EngineStats
    warmup: Warmup | None
    config: Any  # the core's EngineConfig (None for a core without one)
    # A request's page lists in the pool: its layers, or (layer, kv head)s on a per-head
    # pool (`--kv-layout head`); 0 for a core without a pool.
    num_lanes: int
    # Objects the engine process moved out of the garbage collector's sight once loaded
    # (`freeze_heap`; 0 in the thread layout, where the server's app freezes its process).
    frozen_objects: int = 0
    # Each CPU linear layer shape's layout and each MoE stacked projection's kernel, and
    # how they were chosen (`LinearChoice.as_dict`; engine/linear_choice.py,
    # engine/expert_choice.py); [] on a GPU or with cpu_prepack off.
    linear_choices: list[dict] = field(default_factory=list)
    # How the KV pool was sized (attention/sizing.py's KVSizing; None for a core without
    # one): the server's /metrics exports it.
    kv_sizing: Any = None


# emit's events, each with the core's stats after it last: ("accepted", token,
# [exception or None per add], stats), ("step", outputs, seconds, [StepStats], stats)
# and ("failed", exception, stats)
Emit = Callable[..., None]


class CoreLoop:
    def __init__(self, core: Any, warmup: bool) -> None:
        self.core = core
        self.warmup: Warmup | None = None
        if warmup:
            from scheduler.warmup import warm_up  # imports torch: not at CLI start-up

            self.warmup = warm_up(core)

    def info(self) -> CoreInfo:
        import copy

        core = self.core
        tokenizer = copy.deepcopy(core.tokenizer)
        tokenizer.encode("warm up")  # the copy's first call pays its own set-up
        kv = getattr(core, "kv", None)
        lanes = kv.num_layers if kv is not None else 0  # the manager counts lanes
        return CoreInfo(tokenizer, int(core.max_model_len), int(core.model_config.vocab_size),
                        core.limits, self.stats(), self.warmup, getattr(core, "config", None),
                        int(lanes), linear_choices=[
                            c.as_dict() for c in getattr(core, "linear_choices", [])],
                        kv_sizing=getattr(core, "kv_sizing", None))

    def stats(self) -> EngineStats:
        """The core's stats, counters since the warm-up (its requests are no client's)."""
        stats = self.core.stats()
        return stats if self.warmup is None else stats.since(self.warmup.baseline)

    def run(self, take: Callable[[bool], Work], emit: Emit,
            step_stats: list[StepStats] | None = None) -> None:
        """Until `take` says stop. `take(block)` waits for work only when `block` (the
        core is idle); `step_stats`, when given, is the list the core's step listener
        appends to, sent with each step and emptied."""
        core, busy = self.core, False
        while True:
            work = take(not busy)
            if work.stop:
                return
            if work.adds or work.aborts:
                try:
                    results = self._apply(work)
                except Exception as e:  # a broken core: fail what was submitted
                    logger.exception("applying submissions failed")
                    results = [e] * len(work.adds)
                emit("accepted", work.token, results, self.stats())
            busy = core.has_unfinished()
            if not busy:
                continue
            t0 = time.perf_counter()
            try:
                outputs: list[RequestOutput] = core.step()
            except Exception as e:
                # Nothing steps again until the API side's aborts of the failed requests
                # arrive (the core may fail the same way every time).
                busy = False
                emit("failed", e, self.stats())
                continue
            steps = []
            if step_stats:
                steps, step_stats[:] = list(step_stats), []
            emit("step", outputs, time.perf_counter() - t0, steps, self.stats())
            busy = core.has_unfinished()

    def _apply(self, work: Work) -> list[BaseException | None]:
        core = self.core
        for rid in work.aborts:
            core.abort_request(rid)
        results: list[BaseException | None] = []
        for r in work.adds:
            try:
                core.add_request(r.request_id, r.prompt_ids, r.params, priority=r.priority,
                                 kv_policy=r.kv_policy, arrival_time=r.arrival_time,
                                 cache_salt=r.cache_salt, tenant=r.tenant)
                results.append(None)
            except Exception as e:
                results.append(e)
        return results
