"""Freed memory stays in the process for the next step (glibc's malloc, once the model is
loaded).

Why: a prefill step's activations are tens of MB each (the 160M model's gate/up output at
2,048 tokens: 50 MB), and glibc serves every allocation over 32 MB with a fresh `mmap`
and hands it back with `munmap` when torch frees it. The next step then faults every page
in again: ~10 ms to first touch 50 MB here against 2 ms to rewrite it, and the GEMM
that writes it ran at 148-194 GFLOP/s from process to process instead of 188-203 (768 x
6,144 at 2,048 rows, two threads, a Firecracker VM; docs/benchmarks.md at commit 0a7427b).
vLLM's CPU docs have users preload tcmalloc for the same reason; kvserve asks glibc
itself: no `mmap` for allocations (they come from the heap) and no trimming of the
heap's free top, so a freed buffer is reused with its pages already mapped. The resident
size then stays at the peak a workload reached instead of falling between steps.

It runs after the model and the KV pool are allocated (`EngineCore`), so the weights'
load-time copies, freed once packed, still go back to the system. It leaves a process
alone whose malloc the user chose: another allocator preloaded (`LD_PRELOAD`), or glibc's
own `MALLOC_MMAP_MAX_` / `MALLOC_TRIM_THRESHOLD_` set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("kvserve.engine")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_NEVER = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before a trim
_USER_CHOICES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")

_kept = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (once a process); True when it does now."""
    global _kept
    if _kept:
        return True
    if (platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
            or "malloc" in os.environ.get("LD_PRELOAD", "")
            or any(k in os.environ for k in _USER_CHOICES)):
        return False
    libc = ctypes.CDLL(None)
    _kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER))
    if _kept:
        logger.info("freed memory is kept for reuse (glibc: no mmap, no trim)")
    return _kept
