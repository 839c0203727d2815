"""Rotary position embeddings, shared by every model family.

Frequencies come from transformers' own `ROPE_INIT_FUNCTIONS` (llama3, linear, yarn, ...),
so scaled variants match transformers bit for bit; only the unscaled "default" type is
computed here, as each transformers model class does it. Keys leave the model already
rotated at their positions; `rotate` with `scaled=False` also re-rotates stored keys by a
position delta (rotations compose: R(a) R(b) = R(a + b)), which the RoPE-shift feature uses.

Keys are cached rotated, so a type's frequencies must not change with the sequence
length. Dynamic NTK does (it rescales the base by the current length: every cached key
would have to be rotated again), so it is refused. LongRoPE (Phi-3, arXiv 2402.13753)
has two fixed sets, short and long factors, which transformers switches between by the
current length (recomputing the whole cache when a sequence crosses
original_max_position_embeddings); kvserve picks one set for the engine's life, as vLLM
does: long if the served context is longer than original_max_position_embeddings, else
short. It matches transformers for every sequence when the context is at most the
original length, and for sequences longer than it otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Its frequencies change with the current sequence length, which stored rotated keys
# cannot follow.
_REJECTED = ("dynamic",)


def rope_frequencies(
    hf_config: PretrainedConfig, head_dim: int, *, partial_default: bool,
    layer_type: str | None = None, context: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32 on CPU, attention_scaling) for a config.

    `partial_default`: whether the "default" type honours `partial_rotary_factor`
    (GPT-NeoX and Phi-3 do, the Llama family ignores it), as in the transformers classes.
    `layer_type`: the key of `rope_parameters` when it holds one set per layer type
    (Gemma 3: "sliding_attention", "full_attention"). `context`: the longest sequence the
    engine serves, which picks longrope's factor set (see the module docstring).
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _REJECTED or (rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS):
        raise ValueError(
            f"unsupported rope_type {rope_type!r}: its frequencies follow the current sequence "
            "length (dynamic NTK), which keys cached already rotated cannot follow, or it is "
            f"unknown; supported: default, "
            f"{', '.join(k for k in ROPE_INIT_FUNCTIONS if k not in _REJECTED)}"
        )
    # Escape any surrounding meta-device context (the loader builds modules on meta).
    with torch.device("cpu"):
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            factor = params.get("partial_rotary_factor", 1.0) if partial_default else 1.0
            dim = int(head_dim * factor)
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return inv_freq, 1.0
        kwargs: dict = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type == "longrope":  # long factors iff context > original_max_position_embeddings
            kwargs["seq_len"] = context
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
        return inv_freq.float(), float(scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x [T, H, D] ("rotate_half" layout).

    cos/sin are [T, rotary_dim // 2] float32; like transformers they are cast to x's dtype
    first, so bf16/fp16 results match transformers too. Dims past rotary_dim pass through.
    """
    half = cos.shape[-1]
    cos = cos.to(x.dtype).unsqueeze(1)
    sin = sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin per position: a table up to `max_positions`, computed on the fly beyond it
    (or for negative deltas), in float32 either way."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        *,
        partial_default: bool = False,
        layer_type: str | None = None,
        context: int | None = None,
    ) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(
            hf_config, head_dim, partial_default=partial_default, layer_type=layer_type,
            context=max_positions if context is None else context,
        )
        self.rotary_dim = 2 * inv_freq.numel()
        with torch.device("cpu"):
            freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, *, scaled: bool = True, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] int positions -> (cos, sin), each [T, rotary_dim // 2] float32.
        `max_position`: the largest of the (non-negative) positions, where the caller
        knows it on the host; else it is read from the tensor (a device sync on a GPU,
        which a CUDA graph cannot do)."""
        in_table = False
        if max_position is not None:
            in_table = max_position < self.cos_table.shape[0]
        elif positions.numel() > 0:
            lo, hi = (int(v) for v in torch.aminmax(positions))
            in_table = lo >= 0 and hi < self.cos_table.shape[0]
        if in_table:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        else:
            freqs = positions.float()[:, None] * self.inv_freq
            cos, sin = freqs.cos(), freqs.sin()
        if scaled and self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, *, scaled: bool = True
    ) -> torch.Tensor:
        """x [T, H, D] rotated to `positions` [T]. Use scaled=False to re-rotate stored keys
        by a delta: the attention scaling (yarn) is already in them."""
        cos, sin = self.cos_sin(positions, scaled=scaled)
        return apply_rotary(x, cos, sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
