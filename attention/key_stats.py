"""Key statistics a policy reads every step, computed by the pool over its keys in place
(`csrc/storage_cpu.cpp`, built on first use).

Why: KeyDiff (Park et al. 2025; a baseline of 001_01037b507c6df960.txt §5.2, App. A.2)
scores each token by its key's cosine with the mean unit key of its layer's live
tokens. That anchor moves every step, so every live key is read every step; but asked
for the keys themselves (`Needs.keys`), the engine copied them all into a padded fp32
[rows, slots, Hkv, D] tensor and the policy made about six passes over it — about 67%
of a decode step at 16 requests of ~1k tokens (issue 18). The pool owns K, so it
computes the statistic where K lies: two reads of each row's keys, one float out per
slot (`Needs.key_diversity`, `RowsView.key_diversity`). On decode steps the CPU decode
kernel runs the same code (csrc/key_diversity.h) over each sequence's keys right after
its attention read them (`attention.cpu_attention.paged_decode_key_diversity`), so the keys
come from DRAM once a step; this op serves prompt steps and the other paths.

`policies.norms.keydiff_scores` is the reference and the fallback: without a compiler,
with KVSERVE_CPU_KERNEL=0, for a quantized pool (whose keys attention sees dequantized)
or a pool on another device, the bridge (kvpool/policy_rows.py) gathers the keys and
calls it. tests/test_key_stats.py checks that both agree.
"""

from __future__ import annotations

import torch

from native.build import load_ops

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def load_storage_ops() -> bool:
    """Build and load the storage's C++ ops (csrc/storage_cpu.cpp: KeyDiff's key statistics
    and the K/V write) once; False keeps the torch forms (no compiler, or
    KVSERVE_CPU_KERNEL=0)."""
    return load_ops("kvserve_storage_cpu")


def native_key_diversity(k_cache: torch.Tensor) -> bool:
    """The C++ op serves this K plane: a float pool on the CPU, and the op loaded."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in _FLOATS
            and load_storage_ops())


def key_diversity(k_cache: torch.Tensor, table: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """KeyDiff's score of each slot of rows of blocks, from the keys in place.

    k_cache [blocks, bs, Hkv, D] (fp32, bf16 or fp16); table [N, nb] int64 physical
    block ids (-1: none); positions [N, W] int64 (-1: a dead slot; W <= nb·bs) ->
    [N, W] float32: -mean over kv heads of cos(k_i, anchor_h), anchor_h the normalised
    mean of the row's live unit keys (`policies.norms.keydiff_scores`' maths, fp32);
    0 on dead slots. Callers check `native_key_diversity` first."""
    return torch.ops.kvserve_storage.key_diversity(k_cache, table, positions)
