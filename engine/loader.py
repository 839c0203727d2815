"""Load a local Hugging Face checkpoint (config.json + *.safetensors) into an engine model.

The module is built on the meta device (no random init, no double memory), then every
tensor is read from safetensors, cast, moved, and assigned by name. Names must match
exactly: anything missing or left over is an error, so a layout we do not understand
fails loudly instead of generating garbage.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import threading
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import ModelConfig, load_model_config
from engine.models import build_model
from engine.mxfp4 import dequantize_weights, quant_method

# Buffers some older checkpoints saved that are recomputed, never loaded.
_IGNORED = re.compile(r"\.(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias)$")
# transformers 5 renames Pythia's `embed_out` to `lm_head` in memory; accept either on disk.
_RENAMES = {"GPTNeoXForCausalLM": {"lm_head.weight": "embed_out.weight"}}
# A multimodal checkpoint served for its text: the language model's tensors under their
# text-model names (transformers 5 writes `model.language_model.*`, older files
# `language_model.model.*`), the vision tower and projector not read (the server takes
# text content only).
_PREFIXES = {"Gemma3ForConditionalGeneration": (
    ("model.language_model.", "model."), ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."))}
_SKIPPED = {"Gemma3ForConditionalGeneration": re.compile(
    r"^(model\.)?(vision_tower|multi_modal_projector)\.")}


_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
             "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
             "kaiming_normal_", "orthogonal_", "sparse_")
_init_lock = threading.Lock()


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's functions as no-ops while the model is built on the meta device.

    Why: meta tensors hold no values, so initializing them is pointless, and under a
    device context torch routes `init.normal_` & co. through `torch._refs`, which imports
    torch._dynamo, which imports Triton whenever it is installed: on a CPU server that
    added ~1 s of start-up and ~30 lines of "nanobind: leaked ..." at exit. Every
    parameter is then loaded from the checkpoint (a missing one is an error), so no
    initial value is ever used. (transformers' `no_init_weights` does the same.)"""
    with _init_lock:
        saved = {n: getattr(nn.init, n) for n in _INIT_FNS if hasattr(nn.init, n)}
        try:
            for n in saved:
                setattr(nn.init, n, _keep)
            yield
        finally:
            for n, fn in saved.items():
                setattr(nn.init, n, fn)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def safetensors_files(path: str) -> list[str]:
    """The shard files of a checkpoint: from model.safetensors.index.json, else *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path!r} (only safetensors checkpoints are supported; "
            "convert .bin weights with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def _read_weights(
    path: str, config: ModelConfig, dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    renames = _RENAMES.get(config.architecture, {})
    prefixes = _PREFIXES.get(config.architecture, ())
    skipped = _SKIPPED.get(config.architecture)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if _IGNORED.search(name) or (skipped is not None and skipped.match(name)):
                    continue
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                for old, new in prefixes:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                weights[renames.get(name, name)] = tensor.to(device)
    if quant_method(config.hf_config) == "mxfp4":  # gpt-oss's experts (model_config checks)
        dequantize_weights(weights, dtype)
    return weights


def load_model(
    path: str, dtype: torch.dtype | None = None, device: str = "cpu",
    max_model_len: int | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Model in eval mode with weights in `dtype` (None = the checkpoint's) on `device`.
    `max_model_len`: the context the engine serves (ModelConfig.max_model_len)."""
    config = load_model_config(path, max_model_len)
    dtype = dtype or config.dtype
    with torch.device("meta"), _no_init():
        model = build_model(config)
    weights = _read_weights(path, config, dtype, device)

    embed_name, head_name = model.embedding_weight_names()
    tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
    if tied:
        weights.pop(head_name, None)  # the head *is* the embedding, as transformers ties it

    # Checkpoint names: a stacked parameter (llama's qkv_proj) is read as its parts.
    stacked: dict[str, list[str]] = (model.stacked_params()
                                     if hasattr(model, "stacked_params") else {})
    expected = {part for name, _ in model.named_parameters()
                for part in stacked.get(name, [name])}
    if tied:
        expected.discard(head_name)
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    if missing or unexpected:
        hint = ""
        if missing == [head_name]:
            hint = " (the output head is missing and tie_word_embeddings is false)"
        raise ValueError(
            f"checkpoint {path!r} does not match {config.architecture}{hint}: "
            f"missing {_short(missing)}, unexpected {_short(unexpected)}"
        )
    for name, parts in stacked.items():
        shapes = {tuple(weights[p].shape[1:]) for p in parts}
        if len(shapes) > 1:
            raise ValueError(f"{name}: its parts {parts} differ in shape beyond dim 0")
        tensor = torch.cat([weights.pop(p) for p in parts])
        shape = model.get_parameter(name).shape
        if len(shape) == tensor.dim() + 1 and tensor.numel() == shape.numel():
            tensor = tensor.view(shape)  # E experts' tensors as one [E, ...] (models/moe.py)
        weights[name] = tensor
    for name, tensor in weights.items():
        expected_shape = model.get_parameter(name).shape
        if tensor.shape != expected_shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                f"{tuple(expected_shape)} (config.json inconsistent with the weights?)"
            )

    model.load_state_dict(weights, strict=False, assign=True)
    if tied:
        _tie(model, embed_name, head_name)
    model.to(device)  # non-persistent buffers (RoPE tables) were built on CPU
    assert not any(p.is_meta for p in model.parameters()), "a parameter was left unloaded"
    model.eval()
    model.requires_grad_(False)
    return model, config


def _tie(model: nn.Module, embed_name: str, head_name: str) -> None:
    module_name, _, attr = head_name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, model.get_parameter(embed_name))


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
