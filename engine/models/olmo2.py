"""OLMo 2 decoder (allenai, arXiv 2501.00656) over packed tokens.

Where it departs from Llama: the norms come after the sublayers, not before (x + norm(attn(x)),
then x + norm(mlp(x)); no input norm), QK-norm is one RMSNorm over the whole q (and k)
projection rather than per head, and its RMSNorm scales in float32 before rounding
(`rms_norm_f32`). q/k/v and gate/up are held stacked as in llama.py.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layer_ops import rms_norm_f32, rotary_
from engine.model_config import ModelConfig
from engine.models.causal_lm import AttnFn, CausalLM, CosSin
from engine.models.llama import LlamaFlags, LlamaMLP
from engine.rope import RotaryEmbedding


class Olmo2RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_f32(x, self.weight, self.eps)


class Olmo2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        bias, eps = bool(config.hf_config.attention_bias), config.hf_config.rms_norm_eps
        self.layer, self.head_dim = layer, d
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.qkv_split = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = nn.Linear(h, sum(self.qkv_split), bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = Olmo2RMSNorm(self.num_heads * d, eps)  # over all heads at once
        self.k_norm = Olmo2RMSNorm(self.num_kv_heads * d, eps)

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = self.q_norm(q.contiguous()).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary_(q, k, *rope)
        out = attn(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = config.hf_config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, layer)
        self.mlp = LlamaMLP(config, LlamaFlags(qkv_bias=False, o_bias=False, mlp_bias=False,
                                               qk_norm=False))
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, attn))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Olmo2RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)


class Olmo2ForCausalLM(CausalLM):
    """model(input_ids [T], positions [T], attn) -> final-normed hidden [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Olmo2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim,
                                      config.max_position_embeddings, context=config.max_model_len)
