"""Gemma 2 (arXiv 2408.00118) and Gemma 3 text (arXiv 2503.19786) decoders over packed tokens.

Where they depart from Llama, as transformers' modeling_gemma2/3 do it:
- embeddings scaled by sqrt(hidden), the factor rounded to the model's dtype first;
- RMSNorm scaling by (1 + weight) in float32, rounded once (`rms_norm_f32`, offset 1);
- four norms a layer, a sandwich: x + post_attn(attn(input(x))), then
  x + post_ff(mlp(pre_ff(x)));
- a gelu_pytorch_tanh gated MLP, and the softmax scale query_pre_attn_scalar ** -0.5
  (`ModelConfig.attn_scale`, which the runner hands the kernels);
- sliding-window and full layers interleaved by `layer_types` (ModelConfig.sliding_windows);
- tied embeddings, and the logits soft-capped by final_logit_softcapping if set.
Gemma 3 adds QK-norm per head and a RoPE of its own for the sliding layers (base
rope_local_base_freq, never scaled); the full layers' set may be scaled (linear on 4B+).
Gemma 2 soft-caps the attention logits (attn_logit_softcapping: `ModelConfig.attn_softcap`,
which the attention kernels apply); Gemma 3's attention ignores the field, as
transformers' does.

Gemma3ForConditionalGeneration is served for its text part: the loader reads the
language model's tensors and skips the vision tower; the server takes text content only
(an image part is a 400).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu_linear import greedy_ids
from engine.layer_ops import rms_norm_f32
from engine.model_config import ModelConfig
from engine.models.causal_lm import AttnFn, CausalLM, CosSin
from engine.models.llama import LlamaAttention, LlamaFlags, LlamaMLP
from engine.rope import RotaryEmbedding

_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def check_gemma_config(config: ModelConfig) -> None:
    """What kvserve cannot run yet is a start-up error naming it, not a wrong answer."""
    hf = config.hf_config
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{config.architecture}: use_bidirectional_attention (an embedding "
                         "model's non-causal attention) is not supported for generation")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32 (the weight is stored as the offset from 1)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_f32(x, self.weight, self.eps, offset=1.0)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's (1 + weight) RMSNorm on q and k per head (Gemma 3)."""

    def __init__(self, config: ModelConfig, layer: int, qk_norm: bool) -> None:
        bias = bool(config.hf_config.attention_bias)
        super().__init__(config, LlamaFlags(qkv_bias=bias, o_bias=bias, mlp_bias=False,
                                            qk_norm=False), layer)
        if qk_norm:  # per head, over head_dim
            eps = config.hf_config.rms_norm_eps
            self.q_norm = GemmaRMSNorm(config.head_dim, eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        h, hf = config.hidden_size, config.hf_config
        no_bias = LlamaFlags(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
        self.self_attn = GemmaAttention(config, layer, qk_norm)
        self.mlp = LlamaMLP(config, no_bias, act=hf.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(h, hf.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, hf.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, hf.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)


class GemmaForCausalLM(CausalLM):
    """model(input_ids [T], positions [T], attn) -> final-normed hidden [T, hidden].

    `rotary` is the full layers' RoPE (what the engine's RoPE-wide features read);
    Gemma 3's sliding layers rotate by `rotary_local`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_gemma_config(config)
        hf = config.hf_config
        self.config = config
        gemma3 = config.architecture in _GEMMA3
        self.model = GemmaModel(config, qk_norm=gemma3)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # transformers' Gemma3ForConditionalGeneration never soft-caps its logits (its
        # checkpoints set no cap); the text-only class does when the config asks
        self.softcap = (None if config.architecture == "Gemma3ForConditionalGeneration"
                        else hf.final_logit_softcapping)
        rope = dict(head_dim=config.head_dim, max_positions=config.max_position_embeddings,
                    context=config.max_model_len)
        self.rotary = RotaryEmbedding(hf, **rope, layer_type="full_attention" if gemma3 else None)
        self.rotary_local = (RotaryEmbedding(hf, **rope, layer_type="sliding_attention")
                             if gemma3 else None)
        self.local = [t == "sliding_attention" for t in hf.layer_types]  # whatever the window

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """`max_position`: the largest position, known on the host (no device sync)."""
        full = self.rotary.cos_sin(positions, max_position=max_position)
        local = (full if self.rotary_local is None
                 else self.rotary_local.cos_sin(positions, max_position=max_position))
        x = self.model.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden) held as a float32 tensor cast to the
        # model's dtype: the same rounding here
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype).item()
        for layer, is_local in zip(self.model.layers, self.local):
            x = layer(x, local if is_local else full, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, soft-capped in the model's dtype as
        transformers does: cap * tanh(logits / cap)."""
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N] each row's argmax token, where the head can (`greedy_ids`).
        Not under soft-capping: tanh saturates, and transformers' argmax is over the
        capped logits, where two raw ones may tie."""
        return None if self.softcap is not None else greedy_ids(self.lm_head, hidden)
