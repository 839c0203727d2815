"""gpt-oss beyond the parity suites (tests/test_models.py: logits; tests/test_parity.py:
greedy generation, per-layer and per-head pools; tests/test_moe.py: its block and bf16):
MXFP4 checkpoints dequantized at load as transformers dequantizes them, and quantized
checkpoints kvserve cannot serve refused by name.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine.loader import load_model
from engine.model_config import load_model_config
from engine.mxfp4 import dequantize
from tests.test_models import run_packed


def _set_quantization(path: str, config: dict) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        raw = json.load(f)
    raw["quantization_config"] = config
    with open(file, "w") as f:
        json.dump(raw, f)


def make_mxfp4_model(path: str) -> str:
    """The tiny gpt-oss with its experts stored as the releases store them: random FP4
    codes and per-32 scales (2^-5 .. 2^-3) under `*_blocks` / `*_scales`, the rest bf16."""
    make_tiny_model("gpt_oss", path, dtype=torch.bfloat16, intermediate_size=64)
    file = os.path.join(path, "model.safetensors")
    weights, gen = load_file(file), torch.Generator().manual_seed(7)
    for name in [n for n in weights if n.endswith(("gate_up_proj", "down_proj"))]:
        e, d_in, d_out = weights.pop(name).shape  # [E, in, out]; stored [E, out, in / 32, 16]
        weights[name + "_blocks"] = torch.randint(0, 256, (e, d_out, d_in // 32, 16),
                                                  generator=gen, dtype=torch.uint8)
        weights[name + "_scales"] = torch.randint(122, 125, (e, d_out, d_in // 32),
                                                  generator=gen, dtype=torch.uint8)
    save_file(weights, file, metadata={"format": "pt"})
    _set_quantization(path, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]})
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_transformers(dtype):
    """Codes of every nibble and scales either side of 2^0, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 40, 2), generator=gen, dtype=torch.uint8)
    ours = dequantize(blocks, scales, dtype)
    assert ours.shape == (3, 64, 40) and ours.dtype == dtype
    assert torch.equal(ours, convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype))
    with pytest.raises(ValueError, match=r"not \[E, out, G, 16\]"):
        dequantize(blocks[..., :8], scales, dtype)


def test_mxfp4_checkpoint_equals_transformers_dequantized(tmp_path):
    """The engine loads an MXFP4 gpt-oss (experts dequantized to the served dtype) and
    gives transformers' logits with its own dequantization (Mxfp4Config(dequantize=True))."""
    path = make_mxfp4_model(str(tmp_path))
    model, config = load_model(path, dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (6, 64, 128) and experts.down_proj.shape == (6, 64, 64)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    seqs = [torch.randint(5, 250, (40,), generator=torch.Generator().manual_seed(1))]
    with torch.inference_mode():
        ref = hf(seqs[0][None]).logits[0].float()
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(run_packed(model, config, seqs), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("family", "method", "match"), [
    ("gpt_oss", "gptq", "'gptq' is not supported"),
    ("qwen3_moe", "mxfp4", "'mxfp4' is supported only for gpt-oss's experts"),
])
def test_other_quantized_checkpoints_are_refused(tmp_path, family, method, match):
    path = make_tiny_model(family, tmp_path, num_hidden_layers=1)
    _set_quantization(path, {"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=match):
        load_model_config(path)
