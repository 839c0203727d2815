"""RMSNorm (with the residual add), SiLU-and-mul and RoPE: fused C++ ops on the CPU, torch
elsewhere.

Why: in eager torch each of these is 3-8 ops, every one a pass over the activations and,
on a CPU under passive OpenMP waiting, a wake-up of the other threads. On the 160M model
they were ~17% of a prefill step and ~8% of a decode step at 32 rows; vLLM's CPU
backend fuses them through torch.compile. `csrc/layer_ops_cpu.cpp` does each in one
pass, rounding where transformers rounds in bf16/fp16, so outputs keep matching it
(tests/test_layer_ops.py compares both paths; tests/test_parity.py the whole model).

The torch functions here are the reference semantics and the path on other devices, for
shapes the C++ op does not take (rows that are not contiguous), and without a compiler
or with KVSERVE_CPU_KERNEL=0 (kvpool/native.py builds the op on first use).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.rope import apply_rotary
from kvpool.native import load_ops

_SOURCE = Path(__file__).parent / "csrc" / "layer_ops_cpu.cpp"
# No -ffast-math (NaNs must propagate); no FMA contraction (torch rounds mul and add apart).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]


def native(x: torch.Tensor) -> bool:
    """Whether the C++ op runs for `x` (a CPU tensor, once the library is built)."""
    return x.device.type == "cpu" and load_ops("kvserve_layer_ops_cpu", _SOURCE, _FLAGS,
                                               ["-fopenmp"])


def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1 and native(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    if _rows(x) and weight.dtype == x.dtype:
        return torch.ops.kvserve_layer.rms_norm(x, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add of a layer fused with the
    next norm. x and residual may be overwritten (the C++ op works in place)."""
    if (_rows(x) and residual.dim() == 2 and residual.stride(1) == 1
            and weight.dtype == x.dtype == residual.dtype):
        torch.ops.kvserve_layer.add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2m] (gate | up) -> silu(gate) * up [T, m]."""
    if _rows(gate_up):
        return torch.ops.kvserve_layer.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] rotated ("rotate_half" layout, the first
    2 * cos.shape[-1] dims of each head), in place where the C++ op runs."""
    if (q.dim() == k.dim() == 3 and q.stride(2) == k.stride(2) == 1 and native(q)
            and cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()):
        torch.ops.kvserve_layer.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
