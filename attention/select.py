"""Which attention implementation a device gets, without importing Triton on CPU.

Why a module of its own: `attention/triton_attention.py` decorates its kernels with
`triton.jit` when it is imported, so importing it imports Triton, and Triton's
nanobind extension then prints ~30 lines of "nanobind: leaked ..." when a CPU process
exits (and costs ~0.5 s of import). The engine asks this module instead; it imports
the Triton module only for a CUDA device. The Triton tests import
`attention.triton_attention` themselves (TRITON_INTERPRET=1 on CPU), unaffected.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attention.cpu_attention import kernel_available, paged_attention_cpu
from attention.torch_attention import paged_attention

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def select_attention(device: torch.device) -> AttentionFn:
    """Triton on CUDA (when it is installed); on CPU the C++ decode kernel when it
    builds (attention/cpu_attention.py), else the torch path."""
    if device.type == "cuda":
        from attention.triton_attention import select_attention as select_with_triton

        return select_with_triton(device)
    if device.type == "cpu" and kernel_available():
        return paged_attention_cpu
    return paged_attention


def sums_any_heads(fn: AttentionFn) -> bool:
    """Whether `fn` returns the mass summed over every head when asked (`sum_heads`), at
    any head count: the Triton kernels' mass pass sums in the kernel, in the order the
    statistics graphs' pass does (engine/cuda_graphs.py), so a request's mass is the
    same bits in a graph step and an eager one. (The C++ kernel does it from 2 to 4 kv
    heads, the order `head_sum` adds them in.)"""
    return getattr(fn, "__module__", "") == "attention.triton_attention"
