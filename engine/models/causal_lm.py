"""What a decoder model offers the loader and the runner beyond its layers, written once:
the tied-embedding names, the checkpoint tensors stacked into one parameter, the output
head's logits and greedy ids, and the forward most families share (embeddings, layers
that each take `(x, rope, attn)`, the final norm). A family overrides what it does
differently (Llama's fused residual, Gemma's scaled embeddings and capped logits)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.cpu_linear import greedy_ids
from engine.models.moe import SparseMoe

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attn(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]; k arrives rotated.

The callback applies layer `layer`'s whole attention rule, so a model states its variants
once, not per call: the scale (`ModelConfig.attn_scale`), Gemma 2's logit soft-capping
(`ModelConfig.attn_softcap`), the sliding window (`ModelConfig.sliding_windows[layer]`)
and learned attention sinks, which are weights: a model whose attention has them defines
`attention_sinks(layer) -> Tensor | None` ([num_heads], a logit per query head, as
gpt-oss's `self.sinks`), which the runner reads once at start (docs/architecture.md,
"Attention variants")."""
CosSin = tuple[torch.Tensor, torch.Tensor]


def stacked_params(layers: nn.ModuleList) -> dict[str, list[str]]:
    """`model.layers.{i}.self_attn.qkv_proj` and `.mlp.gate_up_proj` (weight, and bias
    where it has one) -> the checkpoint's q/k/v and gate/up tensors stacked into each; a
    sparse MLP's experts as its block says (`SparseMoe.stacked_params`)."""
    stacked: dict[str, list[str]] = {}
    for i, layer in enumerate(layers):
        modules = [("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))]
        if isinstance(layer.mlp, SparseMoe):
            stacked.update(layer.mlp.stacked_params(f"model.layers.{i}.mlp"))
        else:
            modules.append(("mlp.gate_up_proj", ("gate_proj", "up_proj")))
        for module, parts in modules:
            prefix, _, _ = module.rpartition(".")
            for kind in ("weight", "bias"):
                if getattr(layer.get_submodule(module), kind) is not None:
                    stacked[f"model.layers.{i}.{module}.{kind}"] = [
                        f"model.layers.{i}.{prefix}.{p}.{kind}" for p in parts]
    return stacked


class CausalLM(nn.Module):
    """model(input_ids [T], positions [T], attn) -> final-normed hidden [T, hidden], over
    `self.model` (embed_tokens, layers, norm), `self.lm_head` and `self.rotary`, which the
    family's __init__ sets."""

    model: nn.Module
    lm_head: nn.Linear
    rotary: nn.Module

    def embedding_weight_names(self) -> tuple[str, str]:
        """(input embedding, output head) parameter names, for tied checkpoints."""
        return "model.embed_tokens.weight", "lm_head.weight"

    def stacked_params(self) -> dict[str, list[str]]:
        """Parameter name -> the checkpoint tensors stacked into it, in order (dim 0)."""
        return stacked_params(self.model.layers)  # type: ignore[arg-type]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """`max_position`: the largest position, known on the host (no device sync)."""
        rope = self.rotary.cos_sin(positions, max_position=max_position)  # type: ignore[operator]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:  # type: ignore[union-attr]
            x = layer(x, rope, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N] each row's argmax token, without the logits, where the
        head can (`greedy_ids`); else None."""
        return greedy_ids(self.lm_head, hidden)
