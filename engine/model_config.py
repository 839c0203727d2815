"""What the engine needs to know about a checkpoint, resolved once from its config files.

The runner and the KV pool size everything from `ModelConfig` (layers, kv heads, head_dim,
per-layer sliding windows), so the resolution rules live here and mirror what transformers
itself does for each architecture; `hf_config` is kept for the model modules.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import transformers

from engine.mxfp4 import quant_method

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GPTNeoXForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # its text part; images are refused (engine/models/gemma.py)
    "GptOssForCausalLM",
)

_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",  # its MLPs sparse: engine/models/moe.py
    "MixtralForCausalLM": "llama",
    "GPTNeoXForCausalLM": "gpt_neox",
    "Phi3ForCausalLM": "llama",
    "Olmo2ForCausalLM": "olmo2",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Gemma3ForConditionalGeneration": "gemma",
    "GptOssForCausalLM": "gpt_oss",
}

# Used only when config.json has no `architectures` entry (some hand-made configs).
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
}


@dataclass
class ModelConfig:
    """Shape and policy facts of one checkpoint.

    `sliding_windows[i]` is None for full attention or `w`: a query at position p attends to
    keys at positions p-w+1 .. p (w tokens, itself included), as transformers' mask does
    (`kv_idx > q_idx - sliding_window`).
    """

    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    sliding_windows: list[int | None]
    eos_token_ids: list[int]
    dtype: torch.dtype
    hf_config: transformers.PretrainedConfig
    # The longest sequence the engine serves (load_model's max_model_len; default
    # max_position_embeddings): longrope picks its factor set by it (engine/rope.py).
    max_model_len: int | None = None
    # The attention softmax's scale: None is head_dim ** -0.5 (set after init); a family
    # may set another (Gemma's query_pre_attn_scalar ** -0.5).
    attn_scale: float | None = None
    # Gemma 2's attention logit soft-capping: scores = cap * tanh(scores * scale / cap),
    # before the mask and softmax; None: none. (Learned attention sinks are weights: the
    # model owns them, `attention_sinks(layer)` in engine/models/llama.py's AttnFn.)
    attn_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is None:
            self.max_model_len = self.max_position_embeddings
        if self.attn_scale is None:
            self.attn_scale = self.head_dim**-0.5


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def _architecture(raw: dict, path: str) -> str:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(raw.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        found = archs[0] if archs else f"model_type={raw.get('model_type')!r}"
        raise ValueError(
            f"unsupported model architecture {found} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _dtype(hf: transformers.PretrainedConfig, raw: dict) -> torch.dtype:
    # transformers 5 exposes `config.dtype` (older files say "torch_dtype"; both are read).
    value = getattr(hf, "dtype", None) or raw.get("dtype") or raw.get("torch_dtype")
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown checkpoint dtype {value!r}")
    return dtype


def _sliding_windows(arch: str, hf: transformers.PretrainedConfig) -> list[int | None]:
    """Per-layer windows exactly as each transformers model class applies them."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        # These models apply `sliding_window` to every layer and ignore `layer_types`
        # (Qwen3-MoE's config sets it to None unless `use_sliding_window`).
        return [window] * n
    if arch == "Phi3ForCausalLM":  # Phi3Model's mask slides every layer when it is set
        return [window] * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM") or (
            _FAMILY[arch] == "gemma"):
        # The config already folded `use_sliding_window`/`max_window_layers` (Qwen) or
        # `sliding_window_pattern` (Gemma) into `layer_types` (gpt-oss's default:
        # sliding, full, sliding, ...); Qwen's sets
        # `sliding_window` to None when sliding is off.
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n
        return [window if t == "sliding_attention" and window else None for t in layer_types]
    return [None] * n


def _check_quantization(arch: str, hf: transformers.PretrainedConfig, path: str) -> None:
    """A quantized checkpoint is refused by name, except gpt-oss's MXFP4 experts, which
    the loader dequantizes (engine/mxfp4.py)."""
    method = quant_method(hf)
    if method is None or (method == "mxfp4" and arch == "GptOssForCausalLM"):
        return
    where = "supported only for gpt-oss's experts" if method == "mxfp4" else "not supported"
    raise ValueError(f"{path}: quantization_config.quant_method {method!r} is {where} "
                     f"({arch}); serve an unquantized (bf16/fp16/fp32) checkpoint")


def load_model_config(path: str, max_model_len: int | None = None) -> ModelConfig:
    """Read config.json (+ generation_config.json) of a local checkpoint directory.
    `max_model_len`: the context the engine serves (default max_position_embeddings)."""
    raw = _read_json(os.path.join(path, "config.json"))
    if raw is None:
        raise FileNotFoundError(f"no config.json in {path!r}")
    # Check the architecture on the raw JSON first: AutoConfig would fail with a less
    # helpful message on a model_type it does not know.
    arch = _architecture(raw, path)
    hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    _check_quantization(arch, hf, path)
    family = _FAMILY[arch]
    top = hf  # eos and dtype may sit on the outer config of a multimodal checkpoint
    if arch == "Gemma3ForConditionalGeneration":
        hf = hf.text_config

    num_heads = hf.num_attention_heads
    if family == "gpt_neox":
        head_dim = hf.hidden_size // num_heads  # GPT-NeoX has no head_dim override
        num_kv_heads = num_heads
    else:
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads

    eos: list[int] = []
    gen = _read_json(os.path.join(path, "generation_config.json")) or {}
    ids = _as_id_list(getattr(top, "eos_token_id", None)) + _as_id_list(hf.eos_token_id)
    for token_id in ids + _as_id_list(gen.get("eos_token_id")):
        if token_id not in eos:
            eos.append(token_id)

    return ModelConfig(
        architecture=arch,
        family=family,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        sliding_windows=_sliding_windows(arch, hf),
        eos_token_ids=eos,
        dtype=_dtype(top, raw),
        hf_config=hf,
        max_model_len=max_model_len,
        attn_scale=(hf.query_pre_attn_scalar**-0.5 if family == "gemma" else None),
        # Gemma 2's attention caps its logits; Gemma 3's config has the field, and
        # transformers' Gemma 3 attention never reads it
        attn_softcap=(float(hf.attn_logit_softcapping)
                      if arch == "Gemma2ForCausalLM" and hf.attn_logit_softcapping else None),
    )
