"""MoE experts on kvserve's panel kernel: the grouped op
(`torch.ops.kvserve_layer.linear_panels_grouped`, engine/csrc/layer_ops_cpu.cpp) against
per-expert `F.linear`, `PanelExperts` (engine/cpu_experts.py) in both storage layouts,
an `Experts` block on panels against the same block on torch._grouped_mm, and the choice
between them measured, cached and reported (engine/expert_choice.py). Whole models on
panels through the engine against transformers: tests/test_parity.py (the conftest's
vendor rule lays the experts out in panels wherever the linear layers take panels)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from engine import cpu_linear
from engine.cpu_experts import PanelExperts
from engine.expert_choice import (
    ExpertsChoice,
    candidates,
    choose_experts,
    vendor_layout,
)
from engine.linear_choice import MARGIN, row_weights
from engine.models.moe import MoeSpec, SparseMoe
from tests.panels import LAYOUTS, needs_panels


def _reference(x: torch.Tensor, w: torch.Tensor, ends: list[int], bias: torch.Tensor | None
               ) -> torch.Tensor:
    """Each expert's rows through its own F.linear ([E, out, in] weights), in fp32."""
    out, start = [], 0
    for e, end in enumerate(ends):
        out.append(nn.functional.linear(x[start:end].float(), w[e].float(),
                                        None if bias is None else bias[e].float()))
        start = end
    return torch.cat(out) if out else x.new_zeros(0, w.shape[1], dtype=torch.float32)


def _close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to its rounding; bf16 within a bf16 ulp of the fp32 sum (the same bf16 products
    summed in fp32, rounded once)."""
    assert out.dtype == dtype and out.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    elif want.numel():
        assert (out.float() - want.to(dtype).float()).abs().max() <= want.abs().max() * 2 ** -7


# Row ends of 6 experts: empty ones between, first and last; one with all rows (300:
# blocked steps); every expert a few rows; no rows at all.
ENDS = [[0, 3, 3, 17, 17, 20], [0, 0, 300, 300, 300, 300], [1, 2, 8, 14, 40, 75],
        [0, 0, 0, 0, 0, 0]]


@needs_panels
@LAYOUTS
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [64, 72])  # whole panels (fp32 made in place) and 4.5 panels
def test_grouped_op_equals_each_experts_f_linear(dtype, pairs, fma, transposed, bias, out
                                                 ) -> None:
    gen = torch.Generator().manual_seed(out + 2 * bias + 4 * transposed)
    k = 800 if pairs else 400  # in pairs: a block of 384 pairs and a tail past 300 rows
    w = (torch.randn(6, out, k, generator=gen) * 0.05).to(dtype)  # [E, out, in]
    b = (torch.randn(6, out, generator=gen)).to(dtype) if bias else None
    stored = w.transpose(1, 2).contiguous() if transposed else w
    laid = PanelExperts(stored, transposed, pairs=pairs, fma=fma)
    assert (laid.in_features, laid.out_features, laid.pairs, laid.fma) == (k, out, pairs, fma)
    assert laid.panels.shape == (6, *cpu_linear.panel_shape(out, k, pairs))
    for ends in ENDS:
        x = torch.randn(ends[-1], k, generator=gen).to(dtype)
        offs = torch.tensor(ends, dtype=torch.int32)
        want = _reference(x, w, ends, b)
        got = torch.ops.kvserve_layer.linear_panels_grouped(
            x, laid.panels, offs, b, out, laid.fma, laid.prefetch_from, laid.whole_k_to)
        _close(got, want, dtype)
        if b is None:  # the module's forward: the same op without a bias
            assert torch.equal(laid(x, offs), got)


@needs_panels
def test_each_expert_is_laid_out_as_its_own_panel_layer() -> None:
    """Expert e's panels are what `PanelLinear` makes of its weight alone, from either
    storage layout."""
    w = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(0))
    for stored, transposed in ((w, False), (w.transpose(1, 2).contiguous(), True)):
        laid = PanelExperts(stored, transposed)
        for e in range(3):
            linear = nn.Linear(24, 40, bias=False)
            linear.weight.data = w[e].clone()
            assert torch.equal(laid.panels[e], cpu_linear.PanelLinear(linear).panels)


@needs_panels
def test_bad_offsets_are_refused_clearly() -> None:
    laid = PanelExperts(torch.randn(3, 32, 16))
    op = torch.ops.kvserve_layer.linear_panels_grouped
    x = torch.randn(5, 16)
    for offs, match in (([2, 1, 5], "offs must rise"), ([1, 2, 4], r"end at x's rows \(5\)"),
                        ([-1, 2, 5], "offs must rise"), ([2, 5], "int32 \\[E\\]")):
        with pytest.raises(RuntimeError, match=match):
            op(x, laid.panels, torch.tensor(offs, dtype=torch.int32), None, 32)
    with pytest.raises(RuntimeError, match="int32"):
        op(x, laid.panels, torch.tensor([1, 2, 5]), None, 32)  # int64
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[E, N\]"):
        op(x, laid.panels, torch.tensor([1, 2, 5], dtype=torch.int32), torch.zeros(32), 32)


SPECS = {
    "qwen3_moe": MoeSpec(8, 2, 64, 48),
    # gpt-oss: router bias, top-k then softmax, expert biases, clamped interleaved SwiGLU,
    # weights [E, in, out]
    "gpt_oss": MoeSpec(6, 3, 64, 48, topk_of_logits=True, renormalize=False, bias=True,
                       act="swiglu_clamped", limit=1.5, interleaved=True, transposed=True,
                       router="router", per_expert=None),
}


def _block(case: str, dtype: torch.dtype) -> SparseMoe:
    block = SparseMoe(SPECS[case])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() < 3 else 0.15))
    return block.to(dtype).eval()


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(SPECS))
def test_experts_on_panels_equal_experts_on_grouped_mm(case, dtype) -> None:
    """A block whose projections were laid out in panels answers as the same block on
    torch._grouped_mm, from 1 token (most experts empty) to 300; the dense stacked
    weights are gone."""
    dense, laid = _block(case, dtype), _block(case, dtype)
    for name in ("gate_up_proj", "down_proj"):
        laid.experts.lay_out_panels(name)
        assert isinstance(getattr(laid.experts, name), PanelExperts)
    assert not any(p.dim() == 3 for p in laid.parameters())  # no dense copy left
    for tokens in (1, 3, 64, 300):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        with torch.inference_mode():
            want, got = dense(x), laid(x)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # two bf16 GEMMs, each rounded once, in another summation order
            assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2


class TwoBlocks(nn.Module):
    """Two Qwen3-MoE-like blocks (one stacked shape each for gate/up and down) and one
    gpt-oss-like block (its own shapes, stored transposed)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_block("qwen3_moe", dtype) for _ in range(2)])
        self.oss = _block("gpt_oss", dtype)


def _kernels(model: TwoBlocks) -> list[type]:
    return [type(getattr(b.experts, n)) for b in (*model.blocks, model.oss)
            for n in ("gate_up_proj", "down_proj")]


def test_each_stacked_shape_is_measured_recorded_and_reused(choice_cache) -> None:
    model, ref = TwoBlocks(), TwoBlocks()
    choices = choose_experts(model)
    assert [(c.experts, c.out_features, c.in_features, c.top_k, c.transposed, c.layers)
            for c in choices] == [(8, 96, 64, 2, False, 2), (8, 64, 48, 2, False, 2),
                                  (6, 96, 64, 3, True, 1), (6, 64, 48, 3, True, 1)]
    weights = row_weights(None, None, False)
    for c in choices:
        assert isinstance(c, ExpertsChoice) and c.key.startswith("experts ")
        cands = candidates(ref.blocks[0].experts.gate_up_proj)
        if len(cands) == 1:
            assert (c.layout, c.source) == ("grouped_mm", "only")
            continue
        assert c.source == "measured" and set(c.times_ms) == set(cands)
        for name, score in c.score_ms.items():  # timed at every token count, weighted
            assert list(c.times_ms[name]) == list(weights)
            assert score == pytest.approx(sum(w * c.times_ms[name][t] for t, w in weights.items()),
                                          rel=1e-3, abs=1e-5)
        best = min(c.score_ms, key=c.score_ms.__getitem__)
        assert c.layout == best or c.score_ms[cands[0]] <= c.score_ms[best] * (1 + MARGIN)
        assert c.line().startswith(f"CPU experts: {c.experts}x{c.out_features}x{c.in_features} fp32 ")
        assert "; measured" in c.line() and "grouped mm" in c.line()
    want = [PanelExperts if c.layout == "panels" else nn.Parameter for c in choices
            for _ in range(c.layers)]
    got = _kernels(model)
    assert sorted(map(str, got)) == sorted(map(str, want))
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for ours, theirs in ((model.blocks[1], ref.blocks[1]), (model.oss, ref.oss)):
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    if len(candidates(ref.oss.experts.down_proj)) > 1:
        (machine,) = json.loads(choice_cache.read_text())["machines"].values()
        assert set(machine["shapes"]) == {c.key for c in choices}
        again = TwoBlocks()
        cached = choose_experts(again)
        assert [c.source for c in cached] == ["cached"] * 4
        assert [(c.layout, c.times_ms) for c in cached] == [(c.layout, c.times_ms) for c in choices]
        assert _kernels(again) == got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vendor_mode_and_a_spent_budget_take_the_vendor_rule(choice_cache, dtype) -> None:
    rule = vendor_layout(TwoBlocks(dtype).blocks[0].experts.gate_up_proj)
    assert rule == ("panels" if cpu_linear.panels_for(dtype) else "grouped_mm")
    for kw in ({"kernels": "vendor"}, {"budget_s": 0.0}):
        model = TwoBlocks(dtype)
        choices = choose_experts(model, **kw)
        assert {c.source for c in choices} == {"vendor"}
        assert {c.layout for c in choices} == {rule}
        laid = PanelExperts if rule == "panels" else nn.Parameter
        assert _kernels(model) == [laid] * 6
    assert not choice_cache.exists()


@needs_panels
def test_an_engine_reports_its_experts_choices_and_generates_alike(choice_cache, tmp_path) -> None:
    """An MoE engine on the default (measure) records its experts' choices beside its
    linear layers' (`choose_kernels`), and with its experts forced onto panels generates
    what the engine without laid-out kernels does."""
    from engine.sampling import SamplingParams
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("qwen3_moe", tmp_path / "moe")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (3 * i + j) % 200 for j in range(11 + 9 * i)] for i in range(3)]
    llm = LLM(model, num_blocks=128, block_size=4, device="cpu", max_num_seqs=16)
    experts = [c for c in llm.engine.linear_choices if isinstance(c, ExpertsChoice)]
    assert len(experts) == 2 and {c.source for c in experts} == {"measured"}
    assert llm.engine.linear_choices[:2] == experts  # the experts first
    assert all(set(t) <= {1, 8, 512} for c in experts for t in c.times_ms.values())
    if not cpu_linear.panels_for(torch.float32):
        pytest.skip("the vendor rule keeps fp32 experts on grouped mm here")
    panels = LLM(model, num_blocks=128, block_size=4, device="cpu", cpu_kernels="vendor")
    assert {c.layout for c in panels.engine.linear_choices[:2]} == {"panels"}
    dense = LLM(model, num_blocks=128, block_size=4, device="cpu", cpu_prepack=False)
    assert dense.engine.linear_choices == []
    assert [c.token_ids for c in panels.generate(prompts, params)] == \
        [c.token_ids for c in dense.generate(prompts, params)]
