"""RMSNorm (with the residual add), SiLU-and-mul and RoPE: fused C++ ops on the CPU, Triton
kernels on CUDA (engine/layer_ops_triton.py), torch elsewhere.

Why: in eager torch each of these is 3-8 ops, every one a pass over the activations and,
on a CPU under passive OpenMP waiting, a wake-up of the other threads. On the 160M model
they were ~17% of a prefill step and ~8% of a decode step at 32 rows; vLLM's CPU
backend fuses them through torch.compile. `csrc/layer_ops_cpu.cpp` does each in one
pass, rounding where transformers rounds in bf16/fp16, so outputs keep matching it
(tests/test_layer_ops.py compares both paths; tests/test_parity.py the whole model).

The torch functions here are the reference semantics and the path on other devices, for
shapes the fused ops do not take (rows that are not contiguous), without a compiler or
with KVSERVE_CPU_KERNEL=0 (native/build.py builds the op on first use), and on CUDA
without Triton or with KVSERVE_TRITON_LAYER_OPS=0.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from engine.rope import apply_rotary
from native.build import load_ops


def native(x: torch.Tensor) -> bool:
    """Whether the C++ op runs for `x` (a CPU tensor, once the library is built)."""
    return x.device.type == "cpu" and load_ops("kvserve_layer_ops_cpu")


@functools.cache
def _triton_ops() -> ModuleType | None:
    if os.environ.get("KVSERVE_TRITON_LAYER_OPS", "1") == "0":
        return None
    try:
        from engine import layer_ops_triton
    except ImportError:  # a CUDA torch without Triton: the torch path
        return None
    return layer_ops_triton


def fused(x: torch.Tensor) -> ModuleType | None:
    """The fused ops for `x`'s device: `torch.ops.kvserve_layer` (C++, CPU, once built),
    `layer_ops_triton` (CUDA, Triton installed), else None (the torch path)."""
    if x.is_cuda:
        return _triton_ops()
    return torch.ops.kvserve_layer if native(x) else None  # type: ignore[return-value]


def _rows(x: torch.Tensor) -> ModuleType | None:
    return fused(x) if x.dim() == 2 and x.stride(1) == 1 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    ops = _rows(x)
    if ops is not None and weight.dtype == x.dtype:
        return ops.rms_norm(x, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> torch.Tensor:
    """RMSNorm scaled by (weight + offset) in float32 and rounded once: OLMo 2's
    `(w * x).to(dtype)` and Gemma's `x * (1 + w)` (offset 1), where `rms_norm` rounds
    the normalised x before scaling, as Llama does. In float32 the two agree, so the
    fused op runs there, over weight + offset (Gemma's four norms a layer on the torch
    path were ~4% of a Gemma 3 prefill's time on AMD Zen 3, with its gelu's product)."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight if offset == 0.0 else weight + offset, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (weight.float() + offset)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add of a layer fused with the
    next norm. x and residual may be overwritten (the C++ op works in place)."""
    ops = _rows(x)
    if (ops is not None and residual.dim() == 2 and residual.stride(1) == 1
            and weight.dtype == x.dtype == residual.dtype):
        ops.add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2m] (gate | up) -> silu(gate) * up [T, m]."""
    ops = _rows(gate_up)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] rotated ("rotate_half" layout, the first
    2 * cos.shape[-1] dims of each head), in place where a fused op (C++, Triton) runs."""
    ops = fused(q)
    if (ops is not None and q.dim() == k.dim() == 3 and q.stride(2) == k.stride(2) == 1
            and q.dtype == k.dtype and cos.dtype == torch.float32 and cos.is_contiguous()
            and sin.is_contiguous()):
        ops.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
