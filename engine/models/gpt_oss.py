"""gpt-oss (OpenAI, arXiv 2508.10925) over packed tokens, as transformers' modeling_gpt_oss
computes it.

Where it departs from Llama:
- q/k/v and o projections with biases (`attention_bias`);
- a learned attention sink per query head (`self_attn.sinks`): a logit that joins each
  softmax's denominator with no value. The model keeps the weights and answers
  `attention_sinks(layer)`; the runner hands them to every attention call (AttnFn);
- sliding-window (128 in the releases) and full layers alternating by `layer_types`
  (ModelConfig.sliding_windows);
- yarn RoPE over the whole head; transformers' `_apply_rotary_emb` rotates the two halves
  of each head by un-duplicated cos/sin, which is the "rotate_half" layout `rotary_` has;
- RMSNorm scaling in float32 before rounding (OLMo 2's, `rms_norm_f32`; transformers also
  keeps the norms' weights in float32), no fused residual add;
- every MLP a sparse block (engine/models/moe.py's gpt-oss variant: router bias, top-k of
  the logits then softmax, expert biases, clamped interleaved SwiGLU, [E, in, out]).

MXFP4 checkpoints (the releases' experts) are dequantized at load (engine/mxfp4.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.causal_lm import AttnFn, CausalLM, CosSin
from engine.models.llama import LlamaAttention, LlamaFlags
from engine.models.moe import sparse_moe
from engine.models.olmo2 import Olmo2RMSNorm
from engine.rope import RotaryEmbedding


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases everywhere and the layer's sinks [num_heads]."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        bias = bool(config.hf_config.attention_bias)
        super().__init__(config, LlamaFlags(qkv_bias=bias, o_bias=bias, mlp_bias=False,
                                            qk_norm=False), layer)
        self.sinks = nn.Parameter(torch.empty(config.num_heads))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = config.hf_config.rms_norm_eps
        self.self_attn = GptOssAttention(config, layer)
        mlp = sparse_moe(config, layer)
        assert mlp is not None, "every gpt-oss layer is sparse"
        self.mlp = mlp
        self.input_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Olmo2RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)


class GptOssForCausalLM(CausalLM):
    """model(input_ids [T], positions [T], attn) -> final-normed hidden [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GptOssModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim,
                                      config.max_position_embeddings,
                                      context=config.max_model_len)

    def attention_sinks(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s sink logits [num_heads] (AttnFn's contract)."""
        return self.model.layers[layer].self_attn.sinks
