"""RMSNorm (with the residual add), SiLU-and-mul and RoPE as one Triton kernel each, for
CUDA tensors (engine/layer_ops.py picks them; the C++ ops serve the CPU).

Why: once the decode forward is one CUDA graph (engine/cuda_graphs.py) no launch costs
host time, but every kernel is still a node of a few microseconds on the GPU. The 160M
model's graph replayed in 2.11 ms on an H200 (docs/benchmarks.md at commit ba3a7c9) with about
490 kernels, some 400 of them the elementwise pieces of these three ops in torch (an
RMSNorm with its residual add is ~9 kernels, RoPE on q and k ~14). Here each is one.

Rounding is layer_ops.py's reference (transformers'): the maths in fp32, rounded to the
activations' dtype where transformers rounds (the normalised row before the weight, the
residual sum, silu before the product, and RoPE's every product and sum, with cos/sin
rounded first, as its apply_rotary_pos_emb in the model's dtype). Importing this module
imports Triton: layer_ops imports it for CUDA tensors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, sx, sr, so, n, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """One row: OUT = W * rms_norm(X [+ RES]); with RES, the sum is also stored in RES."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RES:
        s = (h + tl.load(RES + row * sr + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(RES + row * sr + cols, s, mask=ok)
        h = s.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n
    h = (h * (1.0 / tl.sqrt(var + eps))).to(dtype).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * so + cols, (w * h).to(dtype), mask=ok)


@triton.jit
def _silu_mul_kernel(GU, OUT, sg, so, m, BLOCK: tl.constexpr):
    """One row tile: OUT = silu(gate) * up, gate | up the two halves of GU's row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < m
    gate = tl.load(GU + row * sg + cols, mask=ok, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    up = tl.load(GU + row * sg + m + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * so + cols, (s * up).to(dtype), mask=ok)


@triton.jit
def _rotate(X, t, st, sh, heads, c, s, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
            BLOCK_HALF: tl.constexpr):
    """Every head of token t of X, in place ("rotate_half" layout, first 2*HALF dims)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < heads) & (i < HALF)
    p1 = X + t * st + h * sh + i
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0)
    # transformers' roundings: cos/sin in the activations' dtype, each product and the
    # sum rounded to it. Written in that dtype, not as fp32 with explicit round trips:
    # compiled for a GPU, those round trips did not round as torch does (commit 65b60e2: 21%
    # of fp16/bf16 outputs off, by up to 25 units in the last place, where Triton's
    # interpreter matched exactly); `rotary_` also turns FMA contraction off.
    dtype = x1.dtype
    ci = c.to(dtype)
    si = s.to(dtype)
    o1 = x1 * ci - x2 * si
    o2 = x2 * ci + x1 * si
    tl.store(p1, o1, mask=ok)
    tl.store(p1 + HALF, o2, mask=ok)


@triton.jit
def _rotary_kernel(Q, K, COS, SIN, sqt, sqh, skt, skh, hq, hk,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    """One token: its q and k heads rotated by its cos/sin row ([T, HALF] fp32)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(COS + t * HALF + i, mask=i < HALF, other=0.0)
    s = tl.load(SIN + t * HALF + i, mask=i < HALF, other=0.0)
    _rotate(Q, t, sqt, sqh, hq, c, s, BLOCK_HQ, HALF, BLOCK_HALF)
    _rotate(K, t, skt, skh, hk, c, s, BLOCK_HK, HALF, BLOCK_HALF)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] rows (stride(1) == 1), weight [H] of x's dtype -> a new [T, H]."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.stride(0), 0, out.stride(0), n, eps,
                                    HAS_RES=False, BLOCK=block, num_warps=_warps(block))
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """residual += x; x = weight * rms_norm(residual): both in place, as the C++ op."""
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, x.stride(0), residual.stride(0),
                                    x.stride(0), n, eps, HAS_RES=True, BLOCK=block,
                                    num_warps=_warps(block))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2m] (gate | up) rows -> silu(gate) * up [T, m]."""
    t, m = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, m), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(m))
    _silu_mul_kernel[(t, triton.cdiv(m, block))](gate_up, out, gate_up.stride(0),
                                                 out.stride(0), m, BLOCK=block, num_warps=4)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, H, D] and k [T, KVH, D] (heads contiguous) rotated in place by cos/sin
    [T, half] float32 (contiguous): the first 2*half dims of each head."""
    half = cos.shape[1]
    if q.shape[0] == 0:
        return
    _rotary_kernel[(q.shape[0],)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), q.shape[1],
        k.shape[1], BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        enable_fp_fusion=False)  # a fused multiply-add would round once where torch rounds twice
