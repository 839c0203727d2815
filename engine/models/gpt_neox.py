"""GPT-NeoX / Pythia decoder over packed tokens.

Differences from the Llama family that matter here: a fused `query_key_value` whose output
is laid out per head as [q | k | v] (HF views it [T, heads, 3 * head_dim]), partial rotary
(only the first `rotary_pct` of each head is rotated), LayerNorm with bias, a plain GELU
MLP, optional parallel residual, and an untied output head named `embed_out`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from engine.cpu_linear import greedy_ids
from engine.model_config import ModelConfig
from engine.models.causal_lm import AttnFn, CosSin
from engine.rope import RotaryEmbedding, apply_rotary


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, bias = config.hidden_size, bool(getattr(config.hf_config, "attention_bias", True))
        self.layer, self.num_heads, self.head_dim = layer, config.num_heads, config.head_dim
        self.query_key_value = nn.Linear(h, 3 * h, bias=bias)
        self.dense = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.query_key_value(x).view(t, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attn(self.layer, q, k, v.contiguous())
        return self.dense(out.reshape(t, self.num_heads * self.head_dim))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, m = config.hidden_size, config.hf_config.intermediate_size
        self.dense_h_to_4h = nn.Linear(h, m)
        self.dense_4h_to_h = nn.Linear(m, h)
        self.act = ACT2FN[config.hf_config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = config.hf_config.layer_norm_eps
        self.use_parallel_residual = bool(config.hf_config.use_parallel_residual)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attention = GPTNeoXAttention(config, layer)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        a = self.attention(self.input_layernorm(x), rope, attn)
        if self.use_parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x)), summed as HF does
            return self.mlp(self.post_attention_layernorm(x)) + a + x
        a = a + x
        return self.mlp(self.post_attention_layernorm(a)) + a


class GPTNeoXModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.hf_config.layer_norm_eps
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, i) for i in range(config.num_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=eps)


class GPTNeoXForCausalLM(nn.Module):
    """model(input_ids [T], positions [T], attn) -> final-normed hidden [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.gpt_neox = GPTNeoXModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.hf_config, config.head_dim, config.max_position_embeddings, partial_default=True
        )

    def embedding_weight_names(self) -> tuple[str, str]:
        """(input embedding, output head) parameter names, for tied checkpoints."""
        return "gpt_neox.embed_in.weight", "embed_out.weight"

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """`max_position`: the largest position, known on the host (no device sync)."""
        rope = self.rotary.cos_sin(positions, max_position=max_position)  # shared by all layers
        x = self.gpt_neox.embed_in(input_ids)
        for layer in self.gpt_neox.layers:
            x = layer(x, rope, attn)
        return self.gpt_neox.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.embed_out(hidden).float()

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N] each row's argmax token, without the logits, where the
        head can (`greedy_ids`); else None."""
        return greedy_ids(self.embed_out, hidden)
