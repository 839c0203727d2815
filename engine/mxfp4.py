"""MXFP4 checkpoints (OCP Microscaling Formats spec v1.0; gpt-oss's released experts),
dequantized at load to the model's dtype.

A tensor `W` is stored as `W_blocks` (uint8 [..., G, 16]: 32 FP4 E2M1 values per group
of the input dim, two per byte, the low nibble first) and `W_scales` (uint8 [..., G]: a
shared power of two per group, biased by 127); the leading dims are [E, out], so the
dequantized [E, out, in] is transposed to the model's [E, in, out]. The rule and the
layout are transformers' `convert_moe_packed_tensors` (integrations/mxfp4.py). Every
FP4 value times a power of two is exact in bf16 and fp32, so the result is the weight
the checkpoint means, not an approximation of it; serving it costs bf16's memory (about
4x MXFP4's): kvserve has no FP4 kernel.
"""

from __future__ import annotations

import torch

# E2M1: sign, 2 exponent bits, 1 mantissa bit; code i -> FP4_VALUES[i]
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def quant_method(hf_config: object) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (a dict or an object), or None."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 blocks [E, out, G, 16] and scales [E, out, G] -> [E, in = 32 G, out] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} / {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} are not [E, out, G, 16] and [E, out, G]")
    e, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(e, groups * 32, rows, dtype=dtype, device=blocks.device)
    for i in range(e):  # an expert at a time: the int64 codes of all would be 8 B a weight
        codes = torch.stack((blocks[i] & 0x0F, blocks[i] >> 4), dim=-1).long()  # low first
        values = lut[codes].flatten(-2)  # [out, G, 32]
        values = torch.ldexp(values, (scales[i].to(torch.int32) - 127).unsqueeze(-1).float())
        out[i] = values.flatten(-2).t()
    return out


def dequantize_weights(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Every `W_blocks` / `W_scales` pair in `weights` replaced by `W`, in place; a
    lone half is left for the loader to name as unexpected."""
    for name in [n for n in weights if n.endswith(BLOCKS)]:
        base = name.removesuffix(BLOCKS)
        if base + SCALES in weights:
            weights[base] = dequantize(weights.pop(name), weights.pop(base + SCALES), dtype)
