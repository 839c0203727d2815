"""The fused CPU layer ops (engine/layer_ops.py, csrc/layer_ops_cpu.cpp) against
transformers' own modules and functions, dtype by dtype."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine import layer_ops
from engine.layer_ops import add_rms_norm, rms_norm, rotary_, silu_and_mul

pytestmark = pytest.mark.skipif(not layer_ops.native(torch.zeros(1)),
                                reason="no C++ compiler: the torch path is the only one")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def _hf_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    norm = LlamaRMSNorm(w.numel(), eps=EPS).to(w.dtype)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        return norm(x)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: the norm's sum runs in another order; 16-bit: the same roundings, so at
    most one unit in the last place, rarely."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)
    else:
        ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(1e-2)
        assert ((got.float() - ref.float()).abs() <= ulp * 1.01).all()
        assert (got != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_and_the_fused_residual_add_match_transformers(dtype, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    res = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    _close(rms_norm(x, w, EPS), _hf_norm(x, w), dtype)

    stream = res + x  # transformers' residual add, rounded to the dtype
    x_in, res_in = x.clone(), res.clone()
    normed, new_res = add_rms_norm(x_in, res_in, w, EPS)
    assert torch.equal(new_res, stream)
    _close(normed, _hf_norm(stream, w), dtype)
    assert normed.data_ptr() == x_in.data_ptr() and new_res.data_ptr() == res_in.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(33, 2 * 200, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamp, both signs
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    got = silu_and_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=4e-7)
    else:
        _close(got, ref, dtype)


def test_bf16_rounding_matches_torch_at_ties_overflow_and_nan() -> None:
    """The C++ ops round fp32 to bf16 by its bits (branch-free, to vectorize): sums
    exactly half-way between two bf16 values go to the even one, past the largest
    finite value to inf, NaN stays NaN; the residual add must equal torch's bit for
    bit. Columns 0-1: ties down and up; 2-3: ties below zero; 4: overflow; 5: NaN."""
    big = torch.finfo(torch.bfloat16).max
    res = torch.tensor([[1.0, 1.0 + 2**-7, -1.0, -(1.0 + 2**-7), big, math.nan] * 2])
    x = torch.tensor([[2**-8, 2**-8, -(2**-8), -(2**-8), big, 1.0] * 2])
    res, x = res.to(torch.bfloat16), x.to(torch.bfloat16)
    want = res + x
    assert want[0, 0] == 1.0 and want[0, 1] == 1.0 + 2**-6 and want[0, 4] == math.inf
    _, got = add_rms_norm(x.clone(), res.clone(), torch.ones(12, dtype=torch.bfloat16), EPS)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


def test_silu_and_mul_propagates_nan_and_inf() -> None:
    gate_up = torch.tensor([[math.nan, math.inf, -math.inf, 1.0, 2.0, 2.0, 2.0, math.nan]])
    got = silu_and_mul(gate_up)
    ref = torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:]
    torch.testing.assert_close(got, ref, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_matches_transformers_bit_for_bit(dtype, rotary_dim) -> None:
    """q and k are views into one qkv output, as the Llama layer hands them over."""
    t, heads, kv_heads, d = 9, 4, 2, 64
    g = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)
    v_before = v.clone()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(100, 100 + t).float()[:, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    # transformers' layout: [B, heads, T, rot] with cos/sin [B, T, rot] repeated twice
    cos_hf, sin_hf = torch.cat([cos, cos], -1)[None].to(dtype), torch.cat([sin, sin], -1)[None].to(dtype)
    q_hf, k_hf = (x.transpose(0, 1)[None, :, :, :rotary_dim] for x in (q, k))
    ref_q, ref_k = apply_rotary_pos_emb(q_hf, k_hf, cos_hf, sin_hf)
    pass_q, pass_k = q[..., rotary_dim:].clone(), k[..., rotary_dim:].clone()

    out_q, out_k = rotary_(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place, through the views
    assert torch.equal(out_q[..., :rotary_dim], ref_q[0].transpose(0, 1))
    assert torch.equal(out_k[..., :rotary_dim], ref_k[0].transpose(0, 1))
    assert torch.equal(out_q[..., rotary_dim:], pass_q) and torch.equal(out_k[..., rotary_dim:], pass_k)
    assert torch.equal(v, v_before)


def test_shapes_the_op_does_not_take_use_the_torch_path() -> None:
    """[T, H, D] with strided rows (Qwen3's q_norm on a qkv view) goes to torch."""
    x = torch.randn(5, 3, 16)[:, :, :8]  # rows of 8 not contiguous with each other
    w = torch.rand(8) + 0.5
    torch.testing.assert_close(rms_norm(x, w, EPS), _hf_norm(x, w))


def test_bad_shapes_are_refused_by_the_op() -> None:
    with pytest.raises(RuntimeError, match="rows"):
        torch.ops.kvserve_layer.rms_norm(torch.randn(4, 8), torch.ones(6), EPS)
    with pytest.raises(RuntimeError, match="2m"):
        torch.ops.kvserve_layer.silu_and_mul(torch.randn(4, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_path_agrees_with_the_op(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """What another device, or a CPU without a compiler, runs: the same answers."""
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(7, 64, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
    gate_up = torch.randn(7, 128, generator=g).to(dtype)
    q, k = torch.randn(7, 4, 32, generator=g).to(dtype), torch.randn(7, 2, 32, generator=g).to(dtype)
    cos, sin = torch.rand(7, 16, generator=g), torch.rand(7, 16, generator=g)

    def run() -> list[torch.Tensor]:
        return [rms_norm(x, w, EPS), *add_rms_norm(x.clone(), res.clone(), w, EPS),
                silu_and_mul(gate_up), *rotary_(q.clone(), k.clone(), cos, sin)]

    native = run()
    monkeypatch.setattr(layer_ops, "native", lambda t: False)
    for got, ref in zip(run(), native, strict=True):
        _close(got, ref, dtype)
