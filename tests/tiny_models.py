"""Tiny random-weight Hugging Face checkpoints (+ a byte-level tokenizer) for CPU tests.

`make_tiny_model(family, path)` writes config.json, generation_config.json,
model.safetensors and tokenizer files into `path`, entirely offline and deterministic
(seeded), so the engine, the server and parity tests can all load the same directory.
Weights are drawn wider than transformers' init (std 0.02) and biases/norm gains are
non-trivial, so attention is sharp and a wrong RoPE, mask or bias shows up in the logits.
"""

from __future__ import annotations

import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from loadtest.random_models import CHAT_TEMPLATE, SPECIAL_TOKENS

# Token ids 0..4 are specials, 5..260 the 256 bytes: vocab_size = 261 for every family.
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

TINY_FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gpt_neox", "llama_tied",
                 "phi3", "phi3_long", "olmo2", "gemma2", "gemma3", "gemma3_mm", "qwen3_moe",
                 "mixtral", "gpt_oss")

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)
_GQA = dict(num_key_value_heads=2)
_GEMMA = {**_COMMON, **_GQA, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 24,
          "tie_word_embeddings": True}


def _longrope(factor: float | None) -> dict:
    """Phi-3's longrope over a 16-dim head rotated at 3/4 (6 frequencies): distinct short
    and long factors, so using the wrong set shows."""
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
              "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]}
    return params if factor is None else {**params, "factor": factor}

# family -> (transformers config class name, config kwargs)
_FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {**_COMMON, **_GQA}),
    # Llama 3.1 rope scaling; original context 64 puts frequencies in all three bands.
    # Also biases on attention and MLP, and head_dim != hidden / heads.
    "llama3": (
        "LlamaConfig",
        {
            **_COMMON,
            **_GQA,
            "head_dim": 32,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", {**_COMMON, **_GQA, "sliding_window": 24}),
    # Layer 0 full, layers 1-2 sliding (Qwen2 slides on layers >= max_window_layers).
    "qwen2": (
        "Qwen2Config",
        {
            **_COMMON,
            **_GQA,
            "use_sliding_window": True,
            "sliding_window": 24,
            "max_window_layers": 1,
        },
    ),
    "qwen3": ("Qwen3Config", {**_COMMON, **_GQA, "head_dim": 32}),
    "gpt_neox": (
        "GPTNeoXConfig",
        {**_COMMON, "num_hidden_layers": 2, "rotary_pct": 0.5, "use_parallel_residual": True},
    ),
    "llama_tied": (
        "LlamaConfig",
        {**_COMMON, **_GQA, "num_hidden_layers": 2, "tie_word_embeddings": True},
    ),
    # Phi-3/Phi-4-mini: fused qkv_proj and gate_up_proj on disk, 3/4 of each head rotated,
    # longrope, every layer sliding. original == max positions: transformers and kvserve
    # both use the short factors at every length (the explicit factor still scales).
    "phi3": ("Phi3Config", {**_COMMON, **_GQA, "sliding_window": 24,
                            "original_max_position_embeddings": 256,
                            "rope_parameters": _longrope(4.0)}),
    # Served past original_max_position_embeddings (64): the long factors, as transformers
    # uses them for sequences longer than 64 (tests give such prompts only).
    "phi3_long": ("Phi3Config", {**_COMMON, **_GQA, "original_max_position_embeddings": 64,
                                 "rope_parameters": _longrope(None)}),
    "olmo2": ("Olmo2Config", {**_COMMON, **_GQA}),
    # Alternating sliding (24) / full layers, query_pre_attn_scalar != head_dim, logit
    # soft-capping, and attention soft-capping at 10 (the release's 50 moves these
    # log-probabilities by 0.4 already; 10 by up to 10).
    "gemma2": ("Gemma2Config", {**_GEMMA, "attn_logit_softcapping": 10.0,
                                "final_logit_softcapping": 30.0, "rope_theta": 10000.0}),
    # sliding, full, sliding; the local RoPE base apart, linear scaling on the full layers.
    "gemma3": ("Gemma3TextConfig", {**_GEMMA, "final_logit_softcapping": 30.0,
                                    "sliding_window_pattern": 2, "rope_parameters": {
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 10000.0}}}),
    # Gemma3ForConditionalGeneration: the same text model beside a tiny SigLIP tower.
    "gemma3_mm": ("Gemma3Config", {}),
    # Mixture of experts: 8 experts, 2 a token, renormalised; layer 1 a dense MLP.
    "qwen3_moe": ("Qwen3MoeConfig", {**_COMMON, **_GQA, "head_dim": 32, "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # 4 experts, 2 a token, every layer sliding (24).
    "mixtral": ("MixtralConfig", {**_COMMON, **_GQA, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "intermediate_size": 96,
                                  "sliding_window": 24}),
    # gpt-oss: biased q/k/v/o, learned sinks (drawn wide, see _randomize), sliding (24) /
    # full / sliding layers, yarn past 64 positions (head_dim 32 != hidden / heads),
    # 6 experts, 2 a token, with SwiGLU clamps that bite (1.5; 7.0 in the releases).
    "gpt_oss": ("GptOssConfig", {**_COMMON, **_GQA, "head_dim": 32, "sliding_window": 24,
                                 "num_local_experts": 6, "num_experts_per_tok": 2,
                                 "intermediate_size": 48, "swiglu_limit": 1.5,
                                 "rope_parameters": {
                                     "rope_type": "yarn", "rope_theta": 150000.0,
                                     "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False,
                                     "original_max_position_embeddings": 64}}),
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges (one token per byte) plus the special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() >= 2:
            p.copy_(noise * (0.5 if "embed" in name else 0.12))
        elif name.endswith("bias"):
            p.copy_(noise * 0.1)
        elif name.endswith("sinks"):  # gpt-oss: some heads' sinks take most of the mass
            p.copy_(noise * 2.0)
        else:  # norm gains
            p.copy_(1.0 + 0.1 * noise)


def make_tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")
    cls_name, kwargs = _FAMILY_CONFIGS[family]
    kwargs = {**kwargs, **overrides}
    if family == "gemma3_mm":  # overrides go to the text model
        text = make_tiny_config("gemma3", **overrides)
        vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                         mm_tokens_per_image=4, boi_token_index=IM_START_ID,
                                         eoi_token_index=IM_END_ID, image_token_index=3,
                                         eos_token_id=EOS_ID)
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_model(
    family: str,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
) -> str:
    """Write a tiny checkpoint for `family` (see TINY_FAMILIES) into `path`; returns `path`.

    `overrides` go to the transformers config (e.g. num_hidden_layers=2,
    use_parallel_residual=False, tie_word_embeddings=True, sliding_window=8).
    generation_config.json lists eos [</s>, <|im_end|>].
    """
    path = str(path)
    config = make_tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = [EOS_ID, IM_END_ID]
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def submit_each(llms: list, configs: list[dict], seed: int, max_tokens: int = 60) -> None:
    """The same greedy requests (one per kv_policy config, prompts of 30 + 7·i random
    tokens) to every engine of a side-by-side test, so their steps can be compared."""
    from engine.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    for i, cfg in enumerate(configs):
        prompt = torch.randint(5, 250, (30 + 7 * i,), generator=gen).tolist()
        for llm in llms:
            llm.engine.add_request(f"r{i}", prompt, SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False),
                kv_policy=resolved(llm.engine, cfg))


def resolved(engine, kv_policy):
    """`kv_policy` (a name, an object) as `EngineCore.add_request` takes it: the config
    that `scheduler/resolve.py`, the one path the server and `LLM` take, resolves for
    `engine`'s model. Tests that add requests to an engine directly go through it too."""
    from scheduler.resolve import resolve_request

    return resolve_request(engine.limits, kv_policy).kv_policy
