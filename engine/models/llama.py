"""Llama-family decoder (Llama 1/2/3, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, and the
mixture-of-experts Qwen3-MoE and Mixtral) over packed tokens.

One module with per-architecture flags, because they differ only in biases, QK-norm,
partial rotary, whether the checkpoint stores q/k/v and gate/up fused (Phi-3), whether
a layer's MLP is a sparse block of experts (engine/models/moe.py; Qwen3-MoE's attention
is Qwen3's, Mixtral's Mistral's), and sliding windows (the latter is the attention
callback's business). Parameter names
match the Hugging Face checkpoints, so the loader copies tensors by name, except that q/k/v
and gate/up are held stacked (`qkv_proj`, `gate_up_proj`: one GEMM each instead of three
and two, as vLLM stacks them; `stacked_params` tells the loader which checkpoint tensors
make each). On a CPU a GEMM of a few rows is a parallel region of its own, and 85 of
them a step became 49. The model never sees the KV cache: per layer it hands rotated
q/k and v to `attn(layer, q, k, v)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from engine.layer_ops import add_rms_norm, rms_norm, rotary_, silu_and_mul
from engine.model_config import ModelConfig
from engine.models.causal_lm import AttnFn, CausalLM, CosSin, stacked_params
from engine.models.moe import sparse_moe
from engine.rope import RotaryEmbedding


@dataclass(frozen=True)
class LlamaFlags:
    """Where the architectures differ (read from transformers' modeling files)."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    # Phi-3: the checkpoint holds qkv_proj and gate_up_proj already stacked, and the
    # default RoPE honours partial_rotary_factor (Phi-4-mini rotates 3/4 of each head).
    phi3: bool = False

    @staticmethod
    def from_config(config: ModelConfig) -> LlamaFlags:
        hf, arch = config.hf_config, config.architecture
        if arch == "Phi3ForCausalLM":  # no biases anywhere in Phi3Attention / Phi3MLP
            return LlamaFlags(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                              phi3=True)
        if arch == "Qwen2ForCausalLM":  # hard-coded in Qwen2Attention
            return LlamaFlags(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
        if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            return LlamaFlags(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
        bias = bool(getattr(hf, "attention_bias", False))
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            return LlamaFlags(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        return LlamaFlags(qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias, qk_norm=False)


class RMSNorm(nn.Module):
    """transformers' RMSNorm (engine/layer_ops.py). Given the residual stream, it first
    adds x to it and returns (normed, new residual): the add fused with the norm, as
    vLLM does, so a layer's residual add is not a pass of its own."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, flags: LlamaFlags, layer: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.qkv_split = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = nn.Linear(h, sum(self.qkv_split), bias=flags.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=flags.o_bias)
        if flags.qk_norm:
            eps = config.hf_config.rms_norm_eps
            self.q_norm = RMSNorm(d, eps)
            self.k_norm = RMSNorm(d, eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary_(q, k, *rope)
        out = attn(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up stacked; `act` names the activation
    (default the config's hidden_act)."""

    def __init__(self, config: ModelConfig, flags: LlamaFlags, act: str | None = None) -> None:
        super().__init__()
        h, m = config.hidden_size, config.hf_config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * m, bias=flags.mlp_bias)
        self.down_proj = nn.Linear(m, h, bias=flags.mlp_bias)
        self.act = act or config.hf_config.hidden_act
        self.act_fn = ACT2FN[self.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate).mul_(up))  # act's output is fresh: in place


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, flags: LlamaFlags, layer: int) -> None:
        super().__init__()
        eps = config.hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(config, flags, layer)
        moe = sparse_moe(config, layer)
        self.mlp = LlamaMLP(config, flags) if moe is None else moe
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: CosSin,
                attn: AttnFn) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual before it): the stream is x + residual,
        and the next norm adds them (the first layer gets residual=None)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, flags: LlamaFlags) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, flags, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """model(input_ids [T], positions [T], attn) -> final-normed hidden [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.flags = LlamaFlags.from_config(config)
        self.model = LlamaModel(config, self.flags)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.hf_config, config.head_dim, config.max_position_embeddings,
            partial_default=self.flags.phi3, context=config.max_model_len,
        )

    def stacked_params(self) -> dict[str, list[str]]:
        """Parameter name -> the checkpoint tensors stacked into it, in order (dim 0)."""
        if self.flags.phi3:  # stacked on disk already, under the same names
            return {}
        return stacked_params(self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """`max_position`: the largest position, known on the host (no device sync)."""
        rope = self.rotary.cos_sin(positions, max_position=max_position)  # shared by all layers
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, attn)
        return self.model.norm(x, residual)[0]
