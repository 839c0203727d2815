"""The Triton layer ops (engine/layer_ops_triton.py, what layer_ops runs on CUDA) against
transformers' modules, dtype by dtype: on CPU through Triton's interpreter, on a GPU
natively. Shapes cross the kernels' edges: rows that are not a power of two, a single
row, several column tiles for SiLU-and-mul, partial rotary, GQA heads."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine import layer_ops
from tests.attention_cases import DEV
from tests.test_layer_ops import EPS, _close, _hf_norm

pytest.importorskip("triton")
ops = pytest.importorskip("engine.layer_ops_triton")
# Triton's interpreter converts fp32 to bf16 wrongly (~3/4 of a norm's outputs a unit or
# two off, where fp16 comes out right): bf16 is checked where the kernels compile.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the interpreter rounds bf16 wrongly; CUDA checks it"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_and_the_fused_residual_add_match_transformers(dtype, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    res = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    got = ops.rms_norm(x.to(DEV), w.to(DEV), EPS).cpu()
    _close(got, _hf_norm(x, w), dtype)

    stream = res + x  # transformers' residual add, rounded to the dtype
    x_in, res_in = x.to(DEV), res.to(DEV)
    ops.add_rms_norm_(x_in, res_in, w.to(DEV), EPS)  # both in place
    assert torch.equal(res_in.cpu(), stream)
    _close(x_in.cpu(), _hf_norm(stream, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(3, 2 * 1100, generator=g)).to(dtype)  # two column tiles
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    got = ops.silu_and_mul(gate_up.to(DEV)).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=4e-7)
    else:
        _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_matches_transformers(dtype, rotary_dim) -> None:
    """q and k are views into one qkv output, as the Llama layer hands them over; 6 query
    heads and 2 kv heads (not powers of two per token: masked head tiles)."""
    t, heads, kv_heads, d = 5, 6, 2, 64
    g = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(100, 100 + t).float()[:, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    cos_hf = torch.cat([cos, cos], -1)[None].to(dtype)
    sin_hf = torch.cat([sin, sin], -1)[None].to(dtype)
    q0, k0 = (x.view(t, -1, d) for x in
              qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)[:2])
    ref_q, ref_k = apply_rotary_pos_emb(*(x.transpose(0, 1)[None, :, :, :rotary_dim]
                                          for x in (q0, k0)), cos_hf, sin_hf)

    dev = qkv.to(DEV)
    q, k, v = dev.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)
    ops.rotary_(q, k, cos.to(DEV), sin.to(DEV))
    q, k = q.cpu(), k.cpu()
    for got, ref, before in ((q, ref_q, q0), (k, ref_k, k0)):
        _close(got[..., :rotary_dim], ref[0].transpose(0, 1).contiguous(), dtype)
        assert torch.equal(got[..., rotary_dim:], before[..., rotary_dim:])
    assert torch.equal(v.cpu(), qkv[:, (heads + kv_heads) * d:])


def test_layer_ops_pick_the_kernels_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors get these kernels (unless KVSERVE_TRITON_LAYER_OPS=0); CPU tensors
    the C++ ops or torch, never Triton."""
    assert layer_ops.fused(torch.zeros(1)) is not ops
    if torch.cuda.is_available():
        assert layer_ops.fused(torch.zeros(1, device="cuda")) is ops
        layer_ops._triton_ops.cache_clear()
        monkeypatch.setenv("KVSERVE_TRITON_LAYER_OPS", "0")
        assert layer_ops.fused(torch.zeros(1, device="cuda")) is None
        layer_ops._triton_ops.cache_clear()
