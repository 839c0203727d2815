"""Running a real engine while watching what its policies see and choose.

A policy class's `select` is handed a step's `RowsView` and answers with a drop mask;
the engine calls it through the class, so wrapping it there records every call of every
request of that class, on the engine's own path (grouping, statistics, C++ selection).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from policies.rows import RowsView
from scheduler.engine_core import EngineCore

# (the policy class, the view its `select` was handed, the drop mask it returned)
Recorder = Callable[[type, RowsView, torch.Tensor | None], None]


def step_recording(core: EngineCore, record: Recorder) -> None:
    """Step `core` until its requests finish, the `select` of each of their policies'
    classes wrapped so that every call also goes to `record`; the classes get their
    own `select` back afterwards, also when a step raises."""
    patched: dict[type, Any] = {}
    for req in core.requests.values():
        cls = type(req.policy)
        if cls in patched:
            continue
        real = cls.__dict__["select"]  # a staticmethod: the engine calls it on the class
        patched[cls] = real

        def recording(policies: list, view: RowsView, _real: Any = real.__func__,
                      _cls: type = cls) -> torch.Tensor | None:
            drop = _real(policies, view)
            record(_cls, view, drop)
            return drop

        cls.select = staticmethod(recording)
    try:
        while core.has_unfinished():
            core.step()
    finally:
        for cls, real in patched.items():
            cls.select = real
