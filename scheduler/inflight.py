"""A step in flight (async scheduling, `EngineCore.step`): what completing a launched
step needs, and the pinned buffers its sampled ids cross to the host in.

Why a module: the engine step is `_launch` then `_complete`; with async scheduling a
launched step outlives the call that launched it, so what it carries is named here,
apart from the loop that plans and advances."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.step import StepOutput
from scheduler.request import Request
from scheduler.scheduler import Chunk, Plan


@dataclass(slots=True, eq=False)
class Launch:
    """A step whose forward and sampling were issued: what completing it needs."""

    plan: Plan
    done: list[Chunk]  # sampled chunks, in the order of `ids`
    scored: list[Request]  # scoring requests (max_tokens 0) it finishes
    ids: torch.Tensor  # the sampled ids, on the model's device
    lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # their logprobs, if asked
    out: StepOutput
    n_pre: int
    n_dec: int
    schedule_s: float
    forward_s: float
    sample_s: float = 0.0
    policy_s: float = 0.0  # its policies' seconds where they ran before its completion
    policies_ran: bool = False  # ... they did: before the next step's plan (async)
    host: torch.Tensor | None = None  # left in flight: the ids' copy under way to here
    event: torch.cuda.Event | None = None  # ... recorded after that copy (on CUDA)


class HostIds:
    """Two pinned buffers the sampled ids of a step are copied into without waiting:
    the step in flight's and the one launched after it (read after its event)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        # (buffer, its event), made on the first CUDA step
        self._pairs: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None

    def start(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The ids' host copy under way and an event recorded after it; off CUDA the
        ids themselves (already on the host) and no event."""
        if ids.device.type != "cuda":
            return ids, None
        if self._pairs is None:
            self._pairs = [(torch.empty(self.max_rows, dtype=ids.dtype, pin_memory=True),
                            torch.cuda.Event()) for _ in "ab"]
        self._pairs.reverse()
        buffer, event = self._pairs[0]
        host = buffer[: ids.numel()]
        host.copy_(ids, non_blocking=True)
        event.record()
        return host, event
