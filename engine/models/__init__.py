"""Model classes by family; each takes a `ModelConfig` and follows the packed-token contract
(see `engine.models.llama.LlamaForCausalLM`)."""

from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.gemma import GemmaForCausalLM
from engine.models.gpt_neox import GPTNeoXForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import AttnFn, LlamaForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gpt_neox": GPTNeoXForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "gemma": GemmaForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate (uninitialised-weight) model for `config.family`."""
    return MODEL_CLASSES[config.family](config)


__all__ = ["MODEL_CLASSES", "AttnFn", "GPTNeoXForCausalLM", "GemmaForCausalLM",
           "GptOssForCausalLM", "LlamaForCausalLM", "Olmo2ForCausalLM", "build_model"]
