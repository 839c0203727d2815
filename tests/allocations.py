"""The peak bytes of tensors a piece of code allocates (`PeakAllocations`), on any
device, CPU included, where torch keeps no allocator statistics: every op is seen at the
dispatcher (C++ kernels' own `at::` allocations too), and a storage an op returns that
none of its inputs holds is new, counted until it is freed.

torch's `torch.distributed._tools.mem_tracker.MemTracker` does the same for training
(it registers gradient hooks on every parameter, which an inference model's cannot take)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakAllocations(TorchDispatchMode):
    """`with PeakAllocations() as m: ...`, then `m.peak`: the most bytes of storages
    allocated inside the block alive at once (views, in-place and out= results, and
    what existed before, not counted); `m.live`: those still alive. `mark()` then
    `peak_since()`: the peak of a stretch inside it, above what was alive at its start
    (a module's forward, from its hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()
        self._marks: list[list[int]] = []  # [live at the mark, peak since], innermost last

    def mark(self) -> None:
        self._marks.append([self.live, self.live])

    def peak_since(self) -> int:
        base, peak = self._marks.pop()
        return peak - base

    def _freed(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._counted:
                continue
            self._counted.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        for mark in self._marks:
            mark[1] = max(mark[1], self.live)
        return out
