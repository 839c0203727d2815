"""The CPU decode path: a C++ kernel that reads keys and values from the pool's blocks in
place (`csrc/paged_decode_cpu.cpp`), built on first use.

Why: on CPU the torch path's decode is dominated not by the attention maths but by
copying every sequence's blocks into a padded tensor (`gather_blocks`) and building the
mask, once per layer per step — 28-37% of a decode step in the issue-2 profile. The
kernel walks each sequence's block table, skips invisible slots, and keeps one softmax
per (sequence, kv head) in fp32, so ragged lengths cost nothing and no copy is made.
Built with -march=native, it takes an AVX-512 path where the CPU has one (head dims
16/32/64/128: 16 slots' scores per step, GQA heads sharing each K and V load, rows
prefetched ahead) and a portable loop elsewhere; the same source builds on both.

Prefill chunks (many queries per sequence) stay on the torch path, where SDPA's matrix
products pay off. The build needs a C++ compiler (torch.utils.cpp_extension, cached
under TORCH_EXTENSIONS_DIR); without one, or with KVSERVE_CPU_KERNEL=0, decode falls
back to the torch path with a warning, so a CPU install never fails over it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from kvpool.attention import paged_attention

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def kernel_available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the op."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def _load() -> bool:
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        log.info("loading the CPU paged-decode kernel (the first start compiles it, ~20 s)")
        load(name="kvserve_paged_decode_cpu", sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
             extra_ldflags=["-fopenmp"], verbose=False)
        return hasattr(torch.ops.kvserve, "paged_decode")
    except Exception as exc:  # no compiler, no headers, ...: the torch path still works
        log.warning("CPU paged-decode kernel unavailable (%s); using the torch path", exc)
        return False


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `kvpool.attention.paged_attention`; decode rows use the kernel."""
    if q.shape[1] != 1 or not kernel_available():
        return paged_attention(q, k_cache, v_cache, table, slot_pos, q_pos, scale, window,
                               return_probs)
    out, mass = torch.ops.kvserve.paged_decode(
        q[:, 0], k_cache, v_cache, table, slot_pos, q_pos.reshape(-1), float(scale),
        int(window or 0), return_probs,
    )
    return out[:, None], (mass[:, None] if return_probs else None)
