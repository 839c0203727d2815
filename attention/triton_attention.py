"""Triton kernels for attention over the paged pool (GPU path of `paged_attention`).

Same contract as `attention.torch_attention.paged_attention` (the torch path is the reference):
visibility is decided by slot positions alone (filled, causal, optional window), so
decode, chunked prefill over a cached prefix and evicted slots are one code path.

Design, and why:
- One program owns a (sequence, kv head, tile of query rows). The rows are the
  `Tq × G` queries of a GQA group flattened t-major (row = t*G + g), so each K/V tile
  is loaded once for all query heads that share it. That is what makes decode
  (Tq = 1) efficient: G rows per program instead of G programs re-reading the cache.
- The program walks the sequence's logical slots in tiles of BLOCK_N, addressing
  every slot through the block table (`table[s // block_size]`), so BLOCK_N does not
  depend on the pool's block size (4, 8, 16 all work) and -1 table pads cost nothing
  but a skipped tile. Tiles where no row sees any slot (evicted, beyond the causal
  edge or outside the window) are skipped before K/V are loaded.
- Online softmax in base 2 with fp32 accumulation; every load is upcast to fp32.
- One-token rows (decode steps, the CUDA graphs' only kind) run `_decode_kernel`, the
  same maths with a loop that keeps several loads in flight (its docstring says how):
  1.5x the general kernel's speed at the 160M model's decode shape on an H200.
- Flash-decoding split: when (sequences × kv heads) cannot fill the GPU, the slot
  range is split across programs and a small kernel merges the partial (acc, max,
  sum) triples. Decode with few long sequences would otherwise use a few SMs.
- `return_probs` is a second pass run only when asked: with the row log-sum-exp from
  the first pass known, each program recomputes one slot tile's scores for every
  query head of its group and writes the summed probabilities. No atomics, so the
  statistic that drives eviction is deterministic.

- A quantized pool (attention/quant.py) is decoded in `_load_rows` as each tile is loaded:
  codes times their fp16 scale, fp8 e4m3 decoded from its bits (so the interpreter and
  GPUs without fp8 loads read it alike). Nothing is widened outside the tile.

Rows that see no slot at all give zeros (as the SDPA branch of the reference does;
its explicit-softmax branch gives NaN there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from attention.cpu_attention import kernel_available, paged_attention_cpu
from attention.quant import QuantCache
from attention.torch_attention import paged_attention
from attention.triton_kernels import (
    LOG2E,
    _attn_kernel,
    _combine_kernel,
    _decode_kernel,
    _probs_kernel,
)

try:  # CPU installs may lack triton: they still import this module and use torch.
    import triton
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

# One-token rows run `_decode_kernel` unless this is False: loadtest/bench_gpu's row that
# measures the general kernel in the same run.
DECODE_KERNEL = True


def _pow2(n: int, lo: int = 16) -> int:
    """Tile sizes are powers of two, at least 16 (the smallest tl.dot operand)."""
    return max(lo, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: splitting buys nothing there


def _auto_splits(programs: int, n_tiles: int, device: torch.device) -> int:
    """Split the slot range only when the grid cannot fill the GPU (long decode).

    Aim for ~2 waves of programs, and keep >= 4 slot tiles per split so the merge
    stays cheap next to the work it parallelises.
    """
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), n_tiles // 4, 64))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    return_probs: bool = False,
    quant: QuantCache | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    slot_count: torch.Tensor | None = None,
    sum_heads: bool = False,
    mass_rows: torch.Tensor | None = None,
    tiles: tuple[int, ...] | None = None,
    decode: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of `attention.torch_attention.paged_attention` (same arguments and
    results, `softcap` and `sinks` included).

    `num_splits` (keyword only) forces the split-KV factor; None picks it from the
    grid size and the GPU's SM count. `slot_count` (keyword only): a one-element int
    tensor on the device; only the first `slot_count[0]` slots of every row are read
    (a CUDA graph's tables have a fixed width, wider than the step's; the count is read
    on the device at replay, engine/cuda_graphs.py); with `return_probs`, the mass
    beyond it is zero. `sum_heads`: the mass summed over every head,
    [B, Tq, 1, S] (the C++ kernel's flag: what a policy that reads no head apart takes).
    `mass_rows` ([B] int32 on the device): only rows b with mass_rows[b] != 0 get mass, the rest
    zeros (a graph's batch where some requests ask for it). `decode`: one query
    token a row runs `_decode_kernel` (None: whenever Tq == 1, unless `DECODE_KERNEL`
    is off; False forces the general kernel, the benchmark's comparison). `tiles`:
    (BLOCK_N, num_warps, num_stages) of the attention pass instead of the defaults (the
    GPU benchmark's sweep, benchmarks/bench_gpu_kernels.py). Every tensor is addressed
    through its strides, so views need no copy (q sliced out of a fused qkv
    projection, k_cache = kv[0]).
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use attention.torch_attention.paged_attention")
    b, tq, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if quant is not None:  # fp8 codes travel as bytes and are decoded by their bits
        k_scale, v_scale, mode = quant.k_scale, quant.v_scale, quant.fmt.code
        if mode == 2:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        gs = quant.fmt.group_size(d)
    else:
        k_scale = v_scale = k_cache  # placeholders, never read
        mode, gs = 0, d
    sc_strides = k_scale.stride() if quant is not None else (0, 0, 0, 0)
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    g = hq // hkv
    nb = table.shape[1]
    s_len = nb * bs
    if slot_pos.shape != (b, s_len) or q_pos.shape != (b, tq):
        raise ValueError("slot_pos must be [B, NB*block_size] and q_pos [B, Tq]")
    dev = q.device
    out = torch.empty((b, tq, hq, d), dtype=q.dtype, device=dev)
    probs = (torch.zeros((b, tq, 1 if sum_heads else hkv, s_len), dtype=torch.float32,
                         device=dev) if return_probs else None)
    if out.numel() == 0 or s_len == 0:
        return out.zero_(), probs

    block_d = _pow2(d)
    rows = tq * g
    decode = (tq == 1 and DECODE_KERNEL) if decode is None else decode
    if decode:
        if tq != 1:
            raise ValueError("the decode kernel takes one query token a row")
        block_m = _pow2(g)  # the group's rows, padded (GP)
        # The H200 sweep of commit 65b60e2 (64 x 384 slots, head_dim 64): 128 slots a tile for
        # MHA (0.030 ms a layer against 0.035 at 64), 64 for G = 4 (0.020 against 0.023)
        default_n = 128 if g == 1 and block_d <= 64 else 64 if block_d <= 64 else 32
        m_tiles = 1
    else:
        block_m = min(_pow2(rows), 64)
        default_n = 64 if block_d <= 64 else 32
        m_tiles = triton.cdiv(rows, block_m)
    block_n, warps, stages = tiles[:3] if tiles else (default_n, 4, None)
    block_n = min(block_n, _pow2(s_len))
    n_tiles = triton.cdiv(s_len, block_n)
    if num_splits is None:
        num_splits = _auto_splits(m_tiles * b * hkv, n_tiles, dev)
    tiles_per_split = triton.cdiv(n_tiles, max(1, min(num_splits, n_tiles)))
    splits = triton.cdiv(n_tiles, tiles_per_split)  # no empty splits
    # 16-bit inputs carry <= 10 mantissa bits, so tf32 tensor-core dots lose nothing on
    # q·k (and ~5e-4 relative on p·v); fp32 inputs get exact IEEE dots, like torch.
    precision = "ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32"
    lse = torch.empty((b, tq, hq), dtype=torch.float32, device=dev) if return_probs else out
    if splits > 1:
        o_part = torch.empty((b * hkv, splits, rows, block_d), dtype=torch.float32, device=dev)
        m_part = torch.empty((b * hkv, splits, rows), dtype=torch.float32, device=dev)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out  # unused placeholders
    scale_log2 = float(scale) * LOG2E
    win = int(window) if window is not None else 0
    # the attention variants: a sink a query head, [Hq] or [B, Hq]; soft-capping
    if sinks is not None:
        sk_strides = (0, sinks.stride(0)) if sinks.dim() == 1 else sinks.stride()
    else:
        sinks, sk_strides = q, (0, 0)  # a placeholder, never read
    cap = float(softcap) if softcap is not None else 1.0
    feats = dict(HAS_CAP=softcap is not None, HAS_SINKS=sinks is not q)

    s_lens = q_pos if slot_count is None else slot_count  # SLEN: unread if None
    launch = {"num_warps": warps, **({} if stages is None else {"num_stages": stages})}
    if decode:
        _decode_kernel[(b * hkv, splits)](
            q, k_cache, v_cache, k_scale, v_scale, table, slot_pos, q_pos, out, lse, o_part,
            m_part, l_part, s_lens, sinks, q.stride(0), q.stride(2), q.stride(3),
            *k_cache.stride(), *v_cache.stride(), *sc_strides, *table.stride(),
            *slot_pos.stride(), q_pos.stride(0), out.stride(0), out.stride(2), out.stride(3),
            *sk_strides, scale_log2, win, s_len, hkv, tiles_per_split, cap * LOG2E, 2.0 / cap,
            G=g, GP=block_m, BS=bs, D=d, BLOCK_D=block_d, BLOCK_N=block_n,
            HAS_WINDOW=window is not None, SPLIT=splits > 1, STORE_LSE=return_probs,
            PRECISION=precision, QUANT=mode, GS=gs, DYN_S=slot_count is not None, **feats,
            **launch,
        )
    else:
        _attn_kernel[(m_tiles, b * hkv, splits)](
            q, k_cache, v_cache, k_scale, v_scale, table, slot_pos, q_pos, out, lse, o_part,
            m_part, l_part, s_lens, sinks,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *sc_strides,
            *table.stride(), *slot_pos.stride(), *q_pos.stride(), *out.stride(), *sk_strides,
            scale_log2, win, tq, s_len, hkv, tiles_per_split, cap * LOG2E, 2.0 / cap,
            G=g, BS=bs, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            HAS_WINDOW=window is not None, SPLIT=splits > 1, STORE_LSE=return_probs,
            PRECISION=precision, QUANT=mode, GS=gs, DYN_S=slot_count is not None, **feats,
            **launch,
        )
    if splits > 1:
        _combine_kernel[(m_tiles, b * hkv)](
            o_part, m_part, l_part, out, lse, *out.stride(), tq, hkv, splits,
            G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, STORE_LSE=return_probs, num_warps=4,
        )
    if return_probs:
        block_t = min(_pow2(tq), 32)
        _probs_kernel[(n_tiles, b if sum_heads else b * hkv, triton.cdiv(tq, block_t))](
            q, k_cache, k_scale, table, slot_pos, q_pos, lse, probs,
            *q.stride(), *k_cache.stride(), *sc_strides,
            *table.stride(), *slot_pos.stride(), *q_pos.stride(),
            q_pos if slot_count is None else slot_count,  # SLEN, ROWS: unread if None
            q_pos if mass_rows is None else mass_rows, scale_log2, win, tq, s_len, hkv,
            cap * LOG2E, 2.0 / cap,
            G=g, BS=bs, D=d, BLOCK_D=block_d, BLOCK_T=block_t, BLOCK_N=block_n,
            HAS_WINDOW=window is not None, PRECISION=precision, QUANT=mode, GS=gs,
            SUM_KV=sum_heads, DYN_S=slot_count is not None, HAS_ROWS=mass_rows is not None,
            HAS_CAP=softcap is not None, num_warps=4,
        )
    return out, probs


def select_attention(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The attention function for tensors on `device`: Triton on CUDA; on CPU the C++
    decode kernel when it builds (attention/cpu_attention.py), else the torch path."""
    if device.type == "cuda" and triton is not None:
        return paged_attention_triton
    if device.type == "cpu" and kernel_available():
        return paged_attention_cpu
    return paged_attention
