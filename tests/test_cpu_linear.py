"""Linear layers laid out for the CPU (engine/cpu_linear.py): oneDNN-prepacked, or in
16-column panels for kvserve's own kernel (engine/csrc/linear_panels.h); which layers take
which, and a model on either generating what dense weights do. The panels' own tests:
tests/test_cpu_linear_panels.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import cpu_linear
from engine.cpu_linear import (
    PackedLinear,
    PanelLinear,
    pack_min_elements,
    packing_available,
    padded_rows,
)
from engine.linear_choice import pack_linears
from engine.sampling import SamplingParams
from native.cpu import cpuinfo
from scheduler.llm import LLM
from tests.panels import needs_panels
from tests.tiny_models import make_tiny_model

needs_onednn = pytest.mark.skipif(not packing_available(torch.float32),
                                  reason="this torch build has no oneDNN prepacking")


@pytest.fixture
def onednn_only(monkeypatch) -> None:
    """The vendor rules as on a CPU where no layer takes the panels (an Intel AVX-512 one;
    the tests that use it choose the vendor rules: engine/linear_choice.py)."""
    monkeypatch.setattr(cpu_linear, "panels_available", lambda: False)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33, 64, 200])  # 33 and 200 are padded
def test_packed_linear_matches_f_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    ref = linear(x)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        out = packed(x)
        out3 = packed(x.view(1, rows, 96))  # leading dims, as the models' [T, h]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out3[0], ref, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 32, 33])  # padded on AMD, exact, padded
@pytest.mark.parametrize("native", [False, True])
def test_bf16_is_widened_without_bf16_dot_products(rows: int, native: bool) -> None:
    """Without AVX512-BF16/AMX a bf16 layer is packed and computed in fp32 and rounds its
    output to bf16: fp32 products of the same bf16 values, so it equals the fp32 GEMM of
    the widened tensors rounded once (summation order aside), and takes and returns bf16."""
    if native and not cpu_linear.native_bf16():
        pytest.skip("no bf16 dot products on this CPU")
    assert cpu_linear.packed_dtype(torch.bfloat16, False) == torch.float32
    assert cpu_linear.packed_dtype(torch.bfloat16, True) == torch.bfloat16
    assert cpu_linear.packed_dtype(torch.float32, False) == torch.float32
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    widened = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    packed = PackedLinear(linear, native=native)
    assert packed.packed.dtype == (torch.bfloat16 if native else torch.float32)
    with torch.inference_mode():
        out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    # one bf16 rounding of (nearly) the same fp32 sum: at most one bf16 ulp apart
    torch.testing.assert_close(out.float(), widened, atol=1e-2, rtol=2 ** -7)
    if not native:
        assert (out.float() - widened.to(torch.bfloat16).float()).abs().max() <= \
            widened.abs().max() * 2 ** -7


@needs_onednn
def test_only_dtypes_that_gain_are_packed(monkeypatch, onednn_only) -> None:
    assert packing_available(torch.float32)
    assert packing_available(torch.bfloat16) == (cpu_linear.bf16_path() != "dense")
    assert not packing_available(torch.float16)
    monkeypatch.setattr(cpu_linear, "PACK_MIN_ELEMENTS", 0)  # any size: the dtype decides
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).half())
    assert pack_linears(model, "vendor") == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear


@needs_onednn
def test_small_weights_stay_dense(monkeypatch, onednn_only) -> None:
    """Below PACK_MIN_ELEMENTS (on an Intel CPU with MKL) oneDNN's per-call cost
    outweighs its layout (a model like the demo's runs dense); at it and above, the
    weight is packed."""
    monkeypatch.setattr(cpu_linear, "PACK_MIN_ELEMENTS", 1 << 19)
    big = cpu_linear.PACK_MIN_ELEMENTS // 1024
    model = nn.Sequential(nn.Linear(1024, big - 1), nn.Linear(1024, big))
    assert pack_linears(model, "vendor") == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)


@needs_onednn
def test_every_weight_is_packed_unless_mkl_runs_on_an_intel_cpu() -> None:
    """MKL, torch's dense fp32 GEMM, is fast for small weights only on Intel CPUs; on
    other vendors' (or without MKL) oneDNN's packed layout wins at every size."""
    assert pack_min_elements("GenuineIntel", mkl=True) == 1 << 19
    assert pack_min_elements("AuthenticAMD", mkl=True) == 0
    assert pack_min_elements("GenuineIntel", mkl=False) == 0
    assert pack_min_elements("", mkl=True) == 0
    assert pack_min_elements(
        cpuinfo("vendor_id"), torch.backends.mkl.is_available()) == cpu_linear.PACK_MIN_ELEMENTS


@pytest.mark.parametrize("layout", [
    pytest.param(PackedLinear, marks=needs_onednn), pytest.param(PanelLinear, marks=needs_panels)])
def test_engine_on_laid_out_weights_generates_what_dense_weights_do(
        tmp_path, monkeypatch, layout: type) -> None:
    """Greedy output of a model with every linear laid out (attention projections, MLP,
    tied output head) equals the dense model's, and nothing dense is left behind (the
    tiny model's weights are all below oneDNN's size floor: lifted here)."""
    monkeypatch.setattr(cpu_linear, "PACK_MIN_ELEMENTS", 0)
    if layout is PackedLinear:
        monkeypatch.setattr(cpu_linear, "panels_available", lambda: False)
    model = make_tiny_model("llama", tmp_path / "llama")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (3 * i + j) % 200 for j in range(11 + 9 * i)] for i in range(4)]
    packed = LLM(model, num_blocks=128, block_size=4, device="cpu", cpu_kernels="vendor")
    dense = LLM(model, num_blocks=128, block_size=4, cpu_prepack=False, device="cpu")
    linears = [m for m in packed.engine.model.modules()
               if isinstance(m, (nn.Linear, PackedLinear, PanelLinear))]
    assert linears and all(isinstance(m, layout) for m in linears)
    got = [c.token_ids for c in packed.generate(prompts, params)]
    want = [c.token_ids for c in dense.generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("smallest", [1, 6])
def test_row_buckets_are_few_and_pad_little(smallest: int) -> None:
    sizes = range(1, 4097)
    buckets = {padded_rows(r, smallest) for r in sizes}
    assert all(r <= padded_rows(r, smallest) <= max(r * 1.125, smallest) for r in sizes)
    assert all(padded_rows(r, smallest) == r for r in range(smallest, 33))  # decode: exact
    assert all(padded_rows(r, smallest) == smallest for r in range(1, smallest))
    assert all(padded_rows(b, smallest) == b for b in buckets)
    assert len(buckets) <= 32 + 8 * 7


@needs_onednn
def test_small_batches_pad_to_six_rows_on_amd_only() -> None:
    """oneDNN runs 6 rows faster than 1-4 on the AMD EPYC this was measured on; other
    vendors keep exact buckets. The padded rows change no result (a row's output does
    not depend on the others: test_packed_linear_matches_f_linear)."""
    assert cpu_linear.min_rows("AuthenticAMD") == 6
    assert cpu_linear.min_rows("GenuineIntel") == 1 and cpu_linear.min_rows("") == 1
    assert cpu_linear.min_rows(cpuinfo("vendor_id")) == cpu_linear.MIN_ROWS
    assert padded_rows(1) == cpu_linear.MIN_ROWS
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.skipif(not __import__("server.memwatch").memwatch.rss_bytes(),
                    reason="needs /proc")
def test_every_row_count_twice_does_not_grow_the_process() -> None:
    """A server's steps have any row count; oneDNN keeps per-shape state, and glibc
    kept gigabytes of what that fragmented (docs/memory.md). Through the buckets a
    second pass over the same row counts must not grow the process."""
    from server.memwatch import rss_bytes

    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(256, 768))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the growth needs a second OpenMP thread, as a server has
    try:
        with torch.inference_mode():
            for rnd in range(2):
                for rows in range(1, 1500, 2):
                    packed(torch.randn(rows, 256))
                if rnd == 0:
                    after_first = rss_bytes()
    finally:
        torch.set_num_threads(threads)
    grew = rss_bytes() - after_first  # type: ignore[operator]
    assert grew < 64 * 2**20, f"RSS grew {grew / 2**20:.0f} MiB on the second pass"
