"""A mixture-of-experts block's stacked projection (all E experts' weights of one of
`gate_up_proj`, `down_proj`: engine/models/moe.py's `Experts`) in kvserve's 16-column
panels, for the CPU: `PanelExperts`, whose forward is one grouped call over the rows of
every expert (`torch.ops.kvserve_layer.linear_panels_grouped`, engine/csrc/layer_ops_cpu.cpp).

Each expert's weight is laid out as `PanelLinear` lays out one layer's (engine/cpu_linear.py:
`panel_settings`, `panel_shape`, `lay_out_panels`), the E of them one after another, and the
op loops over the experts in C++, each through the same panel GEMM a linear layer runs on,
its own team splitting the expert's columns. The interface is `torch._grouped_mm`'s (rows
sorted by expert, `offs` their ends), the grouped GEMM that MoE kernels are built on
(MegaBlocks, arXiv 2211.15841). Whether a projection runs so or on
`torch._grouped_mm` is measured at start (engine/expert_choice.py); the figures are in
moe.py's docstring.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu_linear import lay_out_panels, panel_settings, panel_shape
from native.build import load_ops
from native.huge_pages import huge_page_empty


class PanelExperts(nn.Module):
    """One stacked projection of E experts in panels: forward(x [N, in] rows sorted by
    expert, offs [E] int32 row ends) -> [N, out] (no bias: the block adds its own, as it
    does after torch._grouped_mm). Built from `weight`, [E, out, in] (nn.Linear's, per
    expert) or with `transposed` [E, in, out] (gpt-oss's storage); the caller drops the
    dense weight, so the two are not held at once but while one is laid out."""

    def __init__(self, weight: torch.Tensor, transposed: bool = False, pairs: bool | None = None,
                 fma: bool | None = None) -> None:
        super().__init__()
        if not load_ops("kvserve_layer_ops_cpu"):
            raise RuntimeError("panels need the C++ layer ops (native.build: no compiler?)")
        w = weight.detach()
        self.num_experts = w.shape[0]
        self.out_features, self.in_features = (w.shape[2], w.shape[1]) if transposed else w.shape[1:]
        self.dtype = w.dtype
        self.pairs, self.fma, self.prefetch_from, self.whole_k_to = panel_settings(
            w.dtype, self.in_features, pairs, fma)
        laid = huge_page_empty(
            (self.num_experts, *panel_shape(self.out_features, self.in_features, self.pairs)), w.dtype)
        for e in range(self.num_experts):  # at load: each expert's [out, in] (a view)
            lay_out_panels(w[e].t() if transposed else w[e], laid[e])
        self.register_buffer("panels", laid, persistent=False)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve_layer.linear_panels_grouped(
            x.contiguous(), self.panels, offs, None, self.out_features, self.fma,
            self.prefetch_from, self.whole_k_to)

    def extra_repr(self) -> str:
        pairs = " pairs" + (", longer steps by FMAs" if self.fma else "") if self.pairs else ""
        return (f"experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, 16-column panels, "
                f"{str(self.dtype).removeprefix('torch.')}{pairs}")
