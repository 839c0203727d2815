"""A fresh prompt's causal attention on the CPU op (kvpool/csrc/causal_prefill.h) against
torch's SDPA in fp32 (`causal_self_attention`), and the fallback where the op does not run.

Shapes cross what the kernel must get right: prompts shorter than, equal to and just past
its 16-query blocks (the diagonal chunk's mask, zero rows past T), long ones (many key
chunks, the online softmax's rescaling), GQA groups, every head dim it has a path for,
the strided q/k/v views of a fused qkv output, and bf16 (widened, rounded once at the
end). tests/test_isa.py runs the file again on a build without AVX-512, where the op
refuses and `causal_prefill_cpu` takes SDPA."""

from __future__ import annotations

import pytest
import torch

from kvpool import cpu_attention
from kvpool.attention import causal_self_attention
from kvpool.cpu_attention import causal_prefill_cpu

needs_kernel = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                  reason="no C++ compiler for the CPU kernel")


def qkv_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as the models make them: views of one [T, (Hq + 2 Hkv) * D] output."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    return qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [
    (1, 2, 1, 16), (15, 4, 2, 64), (16, 3, 3, 64), (17, 12, 12, 64), (40, 8, 2, 32),
    (100, 4, 1, 128), (257, 6, 2, 64), (600, 2, 2, 64)])
def test_the_op_matches_sdpa(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    q, k, v = qkv_views(t, hq, hkv, d, dtype, seed=t)
    scale = d ** -0.5
    out = causal_prefill_cpu(q, k, v, scale)
    want = causal_self_attention(q.float(), k.float(), v.float(), scale)
    assert out.dtype == dtype and out.shape == (t, hq, d)
    if cpu_attention.vector_path() == "avx512":  # the op ran
        assert torch.equal(out, torch.ops.kvserve.causal_prefill(q, k, v, scale))
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    else:  # the fp32 result rounded once: within a bf16 ulp of its magnitude
        assert (out.float() - want).abs().max() <= want.abs().max() * 2 ** -7


@needs_kernel
def test_each_query_sees_exactly_the_keys_up_to_it() -> None:
    """A value placed at key j reaches queries j.. only, and with a query whose scores are
    all equal the output is the mean of the values it sees (the mask and the softmax,
    exactly where the blocks and chunks meet: keys 15, 16, 31, 32)."""
    t, d = 48, 16
    q = torch.zeros(t, 1, d)  # equal scores: each query averages its visible values
    k = torch.randn(t, 1, d)
    v = torch.zeros(t, 1, d)
    v[:, 0, 0] = torch.arange(t, dtype=torch.float32)
    out = causal_prefill_cpu(q, k, v, 1.0)
    means = torch.arange(t, dtype=torch.float32) / 2  # mean of 0..i
    torch.testing.assert_close(out[:, 0, 0], means, atol=1e-5, rtol=1e-6)
    assert not out[:, 0, 1:].any()


@needs_kernel
def test_the_op_refuses_what_it_cannot_run() -> None:
    if cpu_attention.vector_path() != "avx512":
        q, k, v = qkv_views(4, 2, 1, 16, torch.float32)
        with pytest.raises(RuntimeError, match="needs an AVX-512 build"):
            torch.ops.kvserve.causal_prefill(q, k, v, 0.25)
        return
    op = torch.ops.kvserve.causal_prefill
    q, k, v = qkv_views(4, 4, 2, 16, torch.float32)
    for args, match in (((q, k.bfloat16(), v.bfloat16()), "one dtype"),
                        ((q.half(), k.half(), v.half()), "fp32 or bf16"),
                        ((q[:, :3], k, v), "multiple of Hkv"),
                        ((q, k[:3], v[:3]), "causal_prefill takes"),  # T differs
                        ((torch.zeros(4, 16, 4).transpose(1, 2), k, v), "contiguous"),
                        (qkv_views(4, 2, 1, 48, torch.float32), "head dim")):
        with pytest.raises(RuntimeError, match=match):
            op(*args, 0.25)
    assert op(q[:0], k[:0], v[:0], 0.25).shape == (0, 4, 16)


def test_the_fallback_takes_sdpa_where_the_op_does_not_run() -> None:
    """Head dims without a path, fp16, and rows whose heads are not contiguous go to SDPA
    (the same bits as `causal_self_attention`), as does everything without the kernel."""
    for q, k, v in (qkv_views(20, 4, 2, 48, torch.float32),
                    qkv_views(20, 4, 2, 16, torch.float16),
                    tuple(x.transpose(0, 1).contiguous().transpose(0, 1)
                          for x in qkv_views(20, 4, 2, 16, torch.float32))):
        assert torch.equal(causal_prefill_cpu(q, k, v, 0.3), causal_self_attention(q, k, v, 0.3))
