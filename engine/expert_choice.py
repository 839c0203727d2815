"""Which kernel runs each stacked projection of a mixture-of-experts block on the CPU:
torch's grouped mm or kvserve's grouped panels, chosen by timing both on this CPU, as
engine/linear_choice.py chooses the linear layers' layouts (whose conventions this keeps).

Why: the experts are most of an MoE model's weights, and on the CPU `torch._grouped_mm`
is ATen's loop of `mm_out` (MKL), which takes its slow paths on AMD CPUs; kvserve's panel
kernel was 1.3-2.8x as fast over the same rows on an AMD Zen 3 (engine/models/moe.py),
but neither is known to win everywhere.

How (`choose_experts`, at load, before the linear layers: `choose_kernels`): the
`gate_up_proj` and `down_proj` of every `Experts` block are grouped by stacked shape
(experts, out, in, dtype, top-k, storage). For each shape, the most weight first, both
kernels are timed on its first block's weight (`PanelExperts` built from it, one at a
time) on the rows its experts see in a step: 1, 8, 32 and 64 tokens and a prefill chunk
of 512, each token routed to top-k experts drawn at random (uniform, without repeats),
their tokens x top-k rows sorted by expert as the block sorts them. Each kernel's score
is the weighted time over those token counts, with linear_choice's weights, its row
counts capped as there (max_num_seqs, max_num_batched_tokens); the lowest wins unless the
vendor rule's kernel (`vendor_layout`: panels where the linear layers of that dtype take
panels here, `panels_for`; else grouped mm) is within `MARGIN`; the same budget, cache
(per machine fingerprint, its own scheme) and drop rule. `--cpu-kernels vendor`, a shape
past the budget and a failed measurement take the vendor rule.

Each choice is logged ("CPU experts: 16x512x512 fp32 top-2 x4 -> panels (0.60 ms vs
grouped mm 1.52; measured)") and kept with the linear layers' on the engine
(`EngineCore.linear_choices`, bench_offline's report).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.cpu_experts import PanelExperts
from engine.cpu_linear import panels_available, panels_for
from engine.linear_choice import (
    BUDGET_S,
    DROP,
    DROP_FROM,
    LONG_CALL_S,
    MARGIN,
    REPS,
    ChoiceCache,
    LinearChoice,
    choose_linears,
    kernel_mode,
    measure_calls,
    row_weights,
    settle,
    short_dtype,
)
from engine.models.moe import Experts

PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass
class ExpertsChoice(LinearChoice):
    """One stacked projection shape's kernel (`layout`: "panels" or "grouped_mm"):
    `out_features` x `in_features` per expert, `layers` the blocks' projections of this
    shape; `times_ms` keyed by tokens (each routed to `top_k` experts)."""

    experts: int = 0
    top_k: int = 0
    transposed: bool = False  # stored [E, in, out] (gpt-oss)

    @property
    def key(self) -> str:
        return (f"experts {self.experts}x{self.out_features}x{self.in_features} {self.dtype}"
                f" top{self.top_k}" + (" transposed" if self.transposed else ""))

    def label(self) -> str:
        return (f"CPU experts: {self.experts}x{self.out_features}x{self.in_features} "
                f"{short_dtype(self.dtype)} top-{self.top_k} x{self.layers}")


def vendor_layout(weight: torch.Tensor) -> str:
    """The vendor rule's kernel for a stacked projection: panels where a linear layer of
    its dtype takes them here (`panels_for`, measured on these CPUs' linear layers), else
    grouped mm."""
    return "panels" if weight.device.type == "cpu" and panels_for(weight.dtype) else "grouped_mm"


def candidates(weight: torch.Tensor) -> list[str]:
    """The kernels this CPU can run a stacked projection on, the vendor rule's first."""
    found = ["panels"] if weight.dtype in (torch.float32, torch.bfloat16) and \
        panels_available() else []
    rule = vendor_layout(weight)
    return sorted([*found, "grouped_mm"], key=lambda n: n != rule)


def routed_inputs(weight: torch.Tensor, experts: int, top_k: int, transposed: bool,
                  weights: dict[int, float]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For each token count of `weights`: (x [tokens * top_k, in], offs [E]), the tokens
    routed to `top_k` of the experts at random, their rows sorted by expert. A generator
    of its own: the process's random stream is left as it was."""
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for tokens in weights:
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k).indices.flatten()
        ends = torch.searchsorted(ids.sort().values, torch.arange(experts), right=True)
        x = torch.randn(tokens * top_k, weight.shape[1 if transposed else 2], generator=gen)
        inputs[tokens] = (x.to(weight.dtype), ends.to(torch.int32))
    return inputs


def kernel_of(layout: str, weight: torch.Tensor, transposed: bool) -> Any:
    """A stacked projection's call (x, offs) -> [rows, out] on `layout`."""
    if layout == "panels":
        return PanelExperts(weight, transposed)
    w = weight if transposed else weight.transpose(1, 2)  # [E, in, out], as the block calls it
    return lambda x, offs: torch._grouped_mm(x, w, offs=offs)


def _timed(cands: list[str], weights: dict[int, float], weight: torch.Tensor, experts: int,
           top_k: int, transposed: bool) -> tuple[dict, dict, dict]:
    """`measure_calls` of each candidate kernel on tokens routed at random (`settle`'s
    measurement: made only when nothing cached or ruled decides)."""
    return measure_calls(cands, weights,
                         functools.partial(kernel_of, weight=weight, transposed=transposed),
                         routed_inputs(weight, experts, top_k, transposed, weights), "tokens")


def _projections(model: nn.Module) -> Iterator[tuple[Experts, str, tuple]]:
    """Each dense CPU stacked projection of `model`: (block, name, its shape's key)."""
    for m in model.modules():
        if not isinstance(m, Experts):
            continue
        for name in PROJECTIONS:
            w = getattr(m, name)
            if isinstance(w, nn.Parameter) and w.device.type == "cpu":
                out, inp = (w.shape[2], w.shape[1]) if m.spec.transposed else w.shape[1:]
                yield m, name, (w.shape[0], out, inp, w.dtype, m.spec.top_k, m.spec.transposed,
                                m.spec.bias)


def choose_experts(model: nn.Module, kernels: str | None = None, max_seqs: int | None = None,
                   max_tokens: int | None = None, budget_s: float = BUDGET_S
                   ) -> list[ExpertsChoice]:
    """Lay out every CPU `Experts` projection of `model` in panels, in place, where its
    shape's choice (measured, cached, or the vendor rule: the module's docstring) is
    panels; returns the choices, one per distinct stacked shape, the most weight first."""
    mode = kernel_mode(kernels)
    groups: dict[tuple, list[tuple[Experts, str]]] = {}
    for block, name, key in _projections(model):
        groups.setdefault(key, []).append((block, name))
    weights = row_weights(max_seqs, max_tokens, False)  # by tokens (each top_k rows)
    cache = ChoiceCache(f"experts v1 tokens {weights} uniform routing reps {REPS}/{LONG_CALL_S}"
                        f" margin {MARGIN} drop {DROP}/{DROP_FROM}")
    deadline = time.perf_counter() + budget_s
    choices = []
    for (e, out, inp, dtype, k, transposed, bias), members in sorted(
            groups.items(), key=lambda g: -len(g[1]) * g[0][0] * g[0][1] * g[0][2]):
        first = getattr(*members[0])
        choice = ExpertsChoice(out, inp, str(dtype).removeprefix("torch."), bias, False,
                               len(members), vendor_layout(first), "vendor", experts=e,
                               top_k=k, transposed=transposed)
        cands = candidates(first)
        settle(choice, cands, cache, mode, deadline, budget_s, "CPU experts",
               functools.partial(_timed, cands, weights, first, e, k, transposed))
        del first  # each block's dense stack goes as it is laid out: no copy held over
        if choice.layout == "panels":
            for block, name in members:
                block.lay_out_panels(name)
            choice.variant = "bf16 pairs" if getattr(members[0][0], members[0][1]).pairs else ""
        choice.log()
        choices.append(choice)
    cache.save()
    return choices


def choose_kernels(model: nn.Module, kernels: str | None = None, max_seqs: int | None = None,
                   max_tokens: int | None = None, budget_s: float = BUDGET_S
                   ) -> list[LinearChoice]:
    """Every CPU kernel choice of `model` within one budget: its experts' first
    (`choose_experts`: most of an MoE model's weights), then its linear layers'
    (`choose_linears`) in what is left; the choices in that order."""
    start = time.perf_counter()
    experts = choose_experts(model, kernels, max_seqs, max_tokens, budget_s)
    left = max(0.0, budget_s - (time.perf_counter() - start))
    return [*experts, *choose_linears(model, kernels, max_seqs, max_tokens, left)]
