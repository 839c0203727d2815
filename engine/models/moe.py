"""Sparse mixture-of-experts block: a router picks k of E experts per token, each an MLP
with its own weights, and the token's output is their weighted sum (Shazeer et al.,
arXiv 1701.06538; Mixtral, arXiv 2401.04088). Used by Qwen3-MoE and Mixtral (llama.py),
and written so that gpt-oss can use it as it is (its router bias, top-k then softmax,
expert biases, clamped interleaved SwiGLU; weights stored [E, in, out]).

Routing follows transformers' modeling files exactly (ties aside, the same top-k):
- Qwen3-MoE (`Qwen3MoeTopKRouter`): softmax over all E logits in float32, top-k of the
  probabilities, renormalised to sum 1 iff `norm_topk_prob`; no shared expert. A layer is
  sparse unless it is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0; the
  others keep a dense MLP of `intermediate_size`.
- Mixtral (`MixtralTopKRouter`): the same, always renormalised.
- gpt-oss (`GptOssTopKRouter`): logits with a bias, top-k of the logits, softmax over the
  k chosen in the logits' dtype.

Experts' weights are one stacked parameter per projection, `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I] (nn.Linear's [out, in] per expert; gpt-oss: [E, H, 2I] and
[E, I, H], `transposed`), and the routed rows run as grouped GEMMs: the (token, choice)
pairs sorted by expert, one `torch._grouped_mm` per projection over the experts'
contiguous runs (`offs`: where each run ends), never a Python loop over experts or
tokens. On the CPU torch's grouped mm is ATen's C++ loop of `mm_out`, one per expert, into
slices of one output (aten/src/ATen/native/GroupedMMUtils.h). Measured against the
alternatives (one thread, E=16, H=512, I=256, k=4, fp32; 1 / 4 / 32 / 256 tokens):
grouped mm 1.3 / 5.3 / 16 / 17 ms, a Python loop over experts (transformers') 2.0 / 6.4 /
17 / 24, rows sorted into an expert-padded [E, max rows, H] buffer and `torch.bmm` 6.2 /
11 / 17 / 28 (the padding and the scatter), the experts' weights gathered per (token,
choice) and `bmm` 8.1 / 32 / 574 (it copies every weight it reads). Over [E, out, in]
weights (transposed views) grouped mm is also bit-equal to transformers' per-expert
`F.linear` in fp32. An empty expert costs one empty `mm_out` (~3 us): at Qwen3-30B-A3B's
decode shape (E=128, k=8, H=2048, 1,536 gate/up rows, bf16) the call took 13-17 ms
against 14-18 for the 8 products alone. On CUDA the same call runs torch's grouped GEMM
kernel (sm90 and bf16; elsewhere its fallback, the same per-expert loop behind a host
sync); sorting by expert and `searchsorted` for the offsets keep the step free of host
syncs. The CUDA path is untested on a GPU.

On the CPU each stacked projection runs on one of two kernels, chosen per stacked shape at
start by timing both on the rows its experts see (engine/expert_choice.py, cached per
machine; `--cpu-kernels vendor`: panels where the linear layers take panels,
`panels_for`): `torch._grouped_mm` as above, or kvserve's panel GEMM (`PanelExperts`,
engine/cpu_experts.py: each expert's weight in `PanelLinear`'s 16-column panels, laid out
once at load and the dense stack dropped, and one `linear_panels_grouped` call whose C++
loops over the experts, skipping empty ones, each expert's columns split over the thread
team as a linear layer's are). Routing, sorting, `offs`, biases, activation and the
`index_add_` are the same on both. Measured on an AMD EPYC (Zen 3, AVX2, a 2-core machine
shared with other jobs: runs differ by up to ~2x, ranges of 2-3), issue 66's moe shape
(E=16, H=512, I=256, k=2, fp32), tokens routed uniformly at random, panels' speed over
grouped mm's at 1 / 8 / 32 / 64 / 512 tokens:
- each projection alone, one thread: gate/up 1.6 / 1.9-2.3 / 2.5-2.6 / 2.7-2.8 /
  1.1-1.3x, down 1.8-2.5 / 1.9-2.7 / 2.4-5.2 / 2.1-4.3 / 1.35x; two threads: gate/up
  1.6-2.1 / 2.9-3.4 / 3.9-4.5 / 3.3-3.4 / 1.3-1.5x, down 2.2-2.4 / 3.2 / 3.3-6.8 /
  2.6-2.8 / 1.2-1.45x (down at 64 tokens: 0.9 ms grouped mm, 0.35 panels);
- the whole `Experts.forward`, one thread: 1.5-1.9 / 2.2-2.6 / 2.6-3.0 / 2.3-2.8 /
  1.1-1.3x (panels 0.21-0.24 / 0.6-1.4 / 1.9-2.0 / 2.3-3.4 / 12-16 ms); two threads
  with the engine's waits (engine/cpu_threads.py: offline's spin, serve's poll) 1.2-1.6 /
  2.6-3.5 / 2.6-4.5 / 2.5-3.1 / 1.3x. Under OpenMP's default waits (a ~15 ms spin)
  512 tokens ran 0.84-1.22x, the projections still faster alone: torch's ops between
  them, it seems, waiting on cores the team's polling threads held.
- bf16 (panels widened as read; torch's bf16 grouped mm emulated): one thread 1.9 /
  3.0 / 5.5 / 7.2 / 8.4x, two threads 1.5 / 2.1 / 2.4 / 3.0 / 3.8x.
fp32 answers differ from grouped mm's by the summation order (1e-6 relative here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from engine.cpu_experts import PanelExperts
from engine.layer_ops import silu_and_mul
from engine.model_config import ModelConfig


@dataclass(frozen=True)
class MoeSpec:
    """One architecture's sparse block (read from its transformers modeling file)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # one expert's
    topk_of_logits: bool = False  # gpt-oss: top-k of the logits, softmax over those k
    renormalize: bool = True  # softmax over all, top-k, then rescale the k to sum 1
    bias: bool = False  # the router and the experts have biases (gpt-oss)
    act: str = "silu"  # or "swiglu_clamped" (gpt-oss: clamped, `alpha`, `up + 1`)
    alpha: float = 1.702
    limit: float = 7.0
    interleaved: bool = False  # gate and up alternate along 2I (gpt-oss), else two halves
    transposed: bool = False  # weights [E, in, out] (gpt-oss), else [E, out, in]
    router: str = "gate"  # the router's module name in the checkpoint
    # Per-expert checkpoint tensors (gate, up, down) under `module`.experts.{e}., stacked
    # at load; None: stored stacked under this block's own names.
    per_expert: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    module: str = "mlp"


def moe_spec(arch: str, hf: PretrainedConfig) -> MoeSpec | None:
    """The sparse block of `arch`, or None for a dense architecture."""
    if arch == "Qwen3MoeForCausalLM":
        return MoeSpec(hf.num_experts, hf.num_experts_per_tok, hf.hidden_size,
                       hf.moe_intermediate_size, renormalize=bool(hf.norm_topk_prob))
    if arch == "MixtralForCausalLM":
        return MoeSpec(hf.num_local_experts, hf.num_experts_per_tok, hf.hidden_size,
                       hf.intermediate_size, per_expert=("w1", "w3", "w2"),
                       module="block_sparse_moe")
    if arch == "GptOssForCausalLM":
        return MoeSpec(hf.num_local_experts, hf.num_experts_per_tok, hf.hidden_size,
                       hf.intermediate_size, topk_of_logits=True, renormalize=False,
                       bias=True, act="swiglu_clamped", alpha=hf.swiglu_alpha, limit=hf.swiglu_limit,
                       interleaved=True, transposed=True, router="router", per_expert=None)
    return None


def sparse_layer(arch: str, hf: PretrainedConfig, layer: int) -> bool:
    """Whether `layer` is sparse (Qwen3MoeDecoderLayer's rule; every layer elsewhere)."""
    if arch != "Qwen3MoeForCausalLM":
        return True
    step = hf.decoder_sparse_step
    return (layer not in (hf.mlp_only_layers or []) and hf.num_experts > 0
            and (layer + 1) % step == 0)


def sparse_moe(config: ModelConfig, layer: int) -> SparseMoe | None:
    """`layer`'s sparse block, or None where the architecture or the layer is dense."""
    spec = moe_spec(config.architecture, config.hf_config)
    if spec is None or not sparse_layer(config.architecture, config.hf_config, layer):
        return None
    return SparseMoe(spec)


class Router(nn.Module):
    """x [T, H] -> (weights [T, k] float32, expert ids [T, k]). `F.linear` as transformers
    computes the logits (not a CPU panel layout), so near-ties fall the same way."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        if self.spec.topk_of_logits:
            top, ids = logits.topk(self.spec.top_k, dim=-1)
            return top.softmax(dim=-1).float(), ids
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> None:
    """Fail once, clearly, where this torch has no grouped mm for the device and dtype."""
    try:
        a = torch.ones(2, 8, device=device_type, dtype=dtype)
        b = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], device=device_type, dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        raise RuntimeError(
            f"mixture-of-experts models need torch._grouped_mm on {device_type} for {dtype} "
            f"(torch >= 2.9 on the CPU); this torch is {torch.__version__}: {e}") from e


class Experts(nn.Module):
    """The E experts' MLPs as stacked weights; forward(x, weights, ids) -> [T, H]. Each
    projection's stack is a parameter (torch._grouped_mm) or, once laid out on the CPU,
    a `PanelExperts` (`lay_out_panels`)."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        gate_up, down = ((e, h, 2 * i), (e, i, h)) if spec.transposed else ((e, 2 * i, h), (e, h, i))
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up))
        self.down_proj = nn.Parameter(torch.empty(down))
        if spec.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.act_fn = None if spec.act in ("silu", "swiglu_clamped") else ACT2FN[spec.act]

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        elif spec.act == "silu":
            return silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if spec.act == "swiglu_clamped":  # GptOssExperts._apply_gate
            gate = gate.clamp(max=spec.limit)
            up = up.clamp(min=-spec.limit, max=spec.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * spec.alpha))
        act = F.silu if self.act_fn is None else self.act_fn
        return act(gate) * up

    def lay_out_panels(self, name: str) -> None:
        """Projection `name` ("gate_up_proj" or "down_proj") in panels from here on
        (engine/cpu_experts.py), its dense stacked weight dropped (memory does not double)."""
        laid = PanelExperts(getattr(self, name), self.spec.transposed)
        delattr(self, name)
        setattr(self, name, laid)

    def _project(self, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [N, in] (rows sorted by expert, expert e's ending at offs[e]) through projection
        `name`'s stacked weights: in panels where they were laid out so
        (engine/expert_choice.py), else one torch._grouped_mm."""
        w = getattr(self, name)
        if isinstance(w, PanelExperts):
            return w(x, offs)
        _grouped_mm_runs(x.device.type, x.dtype)
        if not self.spec.transposed:  # [E, out, in] -> [E, in, out] views, no copy
            w = w.transpose(1, 2)
        return torch._grouped_mm(x, w, offs=offs)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        # (token, choice) pairs grouped by expert: expert e's rows end at offs[e].
        sorted_ids, order = ids.flatten().sort(stable=True)
        experts = torch.arange(self.spec.num_experts, device=x.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        tokens = order // k  # each sorted pair's token
        h = self._project("gate_up_proj", x[tokens], offs)
        if self.spec.bias:
            h = h + self.gate_up_proj_bias[sorted_ids]
        y = self._project("down_proj", self._act(h), offs)
        if self.spec.bias:
            y = y + self.down_proj_bias[sorted_ids]
        # Each pair's output scaled in place (fp32: y itself) and added into its token's
        # row in float32, as transformers' index_add_. Putting the pairs back in (token,
        # choice) order, then a [T, k, H] product and its sum, were three passes over fresh
        # buffers: E=16, H=512, I=256, k=2, fp32, one thread (AMD Zen 3) the experts took
        # 63-71 ms at 2,048 tokens, 23-30 at 512; now 49-51 and 19, level at 1-64, the same
        # bits (k = 2). On CUDA index_add_ adds with atomics: from k = 3 the order of a
        # row's adds, so its rounding, may differ run to run.
        out = torch.zeros(t, y.shape[-1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, y.float().mul_(weights.flatten()[order].unsqueeze(-1)))
        return out.to(x.dtype)


class SparseMoe(nn.Module):
    """x [T, H] -> [T, H]: the router (under the checkpoint's name, `gate` or `router`)
    and the experts."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.add_module(spec.router, Router(spec))
        self.experts = Experts(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = getattr(self, self.spec.router)(x)
        return self.experts(x, weights, ids)

    def stacked_params(self, prefix: str) -> dict[str, list[str]]:
        """This block's parameters (under `prefix`, e.g. "model.layers.3.mlp") -> the
        checkpoint tensors stacked into each, in order: expert e's gate then up rows of
        `gate_up_proj`, its `down_proj`; the loader views the concatenation as [E, ...]."""
        spec = self.spec
        if spec.per_expert is None:
            return {}
        ckpt = prefix.removesuffix(".mlp") + "." + spec.module
        gate, up, down = spec.per_expert
        experts = range(spec.num_experts)
        stacked = {
            f"{prefix}.experts.gate_up_proj": [
                f"{ckpt}.experts.{e}.{p}.weight" for e in experts for p in (gate, up)],
            f"{prefix}.experts.down_proj": [f"{ckpt}.experts.{e}.{down}.weight" for e in experts],
        }
        if ckpt != prefix:  # Mixtral's block_sparse_moe: the router's name too
            stacked[f"{prefix}.{spec.router}.weight"] = [f"{ckpt}.{spec.router}.weight"]
        return stacked
