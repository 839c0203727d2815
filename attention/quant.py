"""Quantized KV blocks: INT8, FP8 (e4m3) and INT4 with scales stored beside the blocks.

Why: the seed paper (003_12df107fdefa535c.txt, "KV cache quantization") lists
quantization beside paging, preemption and eviction — INT8 halves the bytes of a 16-bit
cache and INT4 quarters them, with small quality loss when the scales are fine-grained.
It multiplies with eviction: a 25% budget in INT8 holds an eighth of a full bf16 cache.

Layout (one `BlockPool`): the codes live in `kv[2, N, bs, Hkv, Dp]` and their scales in
`scales[2, N, bs, Hkv, NG]` (fp16), so a block id addresses both and whatever moves a
block (compaction, copy-on-write, swap, prefix sharing) moves its scales with it.
- int8: symmetric, one scale per (token, kv head): x ≈ code * s, code in [-127, 127].
- fp8_e4m3: torch.float8_e4m3fn codes, one scale per (token, kv head) mapping the
  head's absolute maximum to 448 (e4m3's largest finite value): x ≈ code * s.
- int4: symmetric, one scale per group of 32 channels (the whole head when head_dim
  < 32), codes in [-7, 7] stored offset by 8, two per byte (channel 2i in the low
  nibble, 2i+1 in the high one): Dp = head_dim / 2.

Keys are quantized after RoPE (what the pool stores). A scale rounded to fp16 is what
the codes are computed against, so dequantization is exactly code * stored scale.
Dequantization happens only for what an attention call or a statistic reads; the pool
is never widened whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
_FP8_MAX = 448.0


@dataclass(frozen=True)
class KVFormat:
    """A quantized pool format. `code` is what the C++ and Triton kernels switch on."""

    name: str
    storage: torch.dtype  # element type of the code tensor
    qmax: float  # largest code magnitude
    code: int  # 1 int8, 2 fp8_e4m3, 3 int4
    group: int | None = None  # channels per scale (None: the whole head)

    def packed_dim(self, head_dim: int) -> int:
        return head_dim // 2 if self.code == 3 else head_dim

    def group_size(self, head_dim: int) -> int:
        return head_dim if self.group is None else min(self.group, head_dim)

    def num_groups(self, head_dim: int) -> int:
        return head_dim // self.group_size(head_dim)

    def check(self, head_dim: int) -> None:
        if self.code == 3 and (head_dim % 2 or head_dim % self.group_size(head_dim)):
            raise ValueError(f"{self.name} needs an even head_dim divisible by its group "
                             f"({self.group}); got {head_dim}")

    def bytes_per_slot(self, num_kv_heads: int, head_dim: int) -> int:
        """K or V bytes of one token in one layer, codes and scales together."""
        code_bytes = num_kv_heads * self.packed_dim(head_dim) * self.storage.itemsize
        return code_bytes + num_kv_heads * self.num_groups(head_dim) * SCALE_DTYPE.itemsize


FORMATS: dict[str, KVFormat] = {
    "int8": KVFormat("int8", torch.int8, 127.0, 1),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, _FP8_MAX, 2),
    "int4": KVFormat("int4", torch.uint8, 7.0, 3, group=32),
}
FORMATS["fp8"] = FORMATS["fp8_e4m3"]  # vLLM's spelling


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float) -> (codes [..., Dp] in fmt.storage, scales [..., NG] fp16)."""
    d = x.shape[-1]
    gs = fmt.group_size(d)
    xf = x.float().reshape(*x.shape[:-1], d // gs, gs)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    s = (amax / fmt.qmax).clamp(max=torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)
    sf = s.float()
    y = xf / torch.where(sf > 0, sf, torch.ones_like(sf))
    scales = s.squeeze(-1)
    if fmt.code == 2:
        codes = y.clamp(-_FP8_MAX, _FP8_MAX).to(fmt.storage).reshape(x.shape)
        return codes, scales
    q = y.round().clamp(-fmt.qmax, fmt.qmax).reshape(x.shape)
    if fmt.code == 1:
        return q.to(torch.int8), scales
    u = (q + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: KVFormat,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: codes [..., Dp], scales [..., NG] -> [..., D] in dtype."""
    if fmt.code == 3:
        lo = (codes & 0xF).to(torch.int8) - 8
        hi = (codes >> 4).to(torch.int8) - 8
        vals = torch.stack((lo, hi), dim=-1).flatten(-2).float()
    else:
        vals = codes.float()
    d = vals.shape[-1]
    ng = scales.shape[-1]
    out = vals.view(*vals.shape[:-1], ng, d // ng) * scales.float()[..., None]
    return out.reshape(vals.shape).to(dtype)


@dataclass(frozen=True)
class QuantCache:
    """What an attention function needs besides the code tensors: the format and the
    scale tensors [num_blocks, bs, Hkv, NG] of K and V (views of the pool's)."""

    fmt: KVFormat
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def gather_dequant(cache: torch.Tensor, scale: torch.Tensor, table: torch.Tensor,
                   fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """The blocks a call reads ([B, NB] ids, -1 = none) widened to dtype: [B, NB*bs, H, D].
    Only those blocks are dequantized (the torch path gathers them anyway)."""
    b, nb = table.shape
    ids = table.clamp(min=0).reshape(-1)
    codes = cache.index_select(0, ids)
    sc = scale.index_select(0, ids)
    out = dequantize(codes, sc, fmt, dtype)
    return out.view(b, nb * cache.shape[1], cache.shape[2], out.shape[-1])
