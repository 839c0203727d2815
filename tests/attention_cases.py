"""Attention inputs shared by the kernel tests (Triton and the CPU decode kernel)."""

from __future__ import annotations

import torch

from attention.torch_attention import PAD_QUERY_POS

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(
    prefixes: list[int],
    chunks: list[int],
    *,
    bs: int = 4,
    hq: int = 4,
    hkv: int = 2,
    d: int = 8,
    extra_blocks: int = 0,
    evict: dict[int, list[int]] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = DEV,
) -> dict:
    """Sequences with `prefixes[i]` cached tokens plus a chunk of `chunks[i]` queries.

    The chunk's own keys are already in the cache (the runner writes before attending),
    so sequence i holds positions 0 .. prefix+chunk-1 in shuffled pool blocks. Queries
    are padded to the longest chunk with PAD_QUERY_POS. `evict` maps a sequence to the
    logical slots marked dead; `extra_blocks` adds -1 columns to the table. `device`:
    the Triton tests' default (CUDA where there is one); the CPU kernel's tests pass "cpu".
    """
    g = torch.Generator().manual_seed(seed)
    lens = [p + c for p, c in zip(prefixes, chunks)]
    nblocks = [-(-n // bs) for n in lens]
    nb = max(nblocks) + extra_blocks
    num_blocks = sum(nblocks) + 3
    ids = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lens), nb), -1, dtype=torch.int64)
    slot_pos = torch.full((len(lens), nb * bs), -1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        table[i, : nblocks[i]] = ids[used : used + nblocks[i]]
        used += nblocks[i]
        slot_pos[i, :n] = torch.arange(n)
        for s in (evict or {}).get(i, []):
            slot_pos[i, s] = -1
    tq = max(chunks)
    q_pos = torch.full((len(lens), tq), PAD_QUERY_POS, dtype=torch.int64)
    for i, (p, c) in enumerate(zip(prefixes, chunks)):
        q_pos[i, :c] = torch.arange(p, p + c)
    # q sliced out of a fused qkv-like tensor: strided, as the model runner hands it over.
    fused = torch.randn(len(lens), tq, hq + 2, d, generator=g)
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g)
    return {
        "q": fused[:, :, :hq].to(device, dtype), "k_cache": kv[0].to(device, dtype),
        "v_cache": kv[1].to(device, dtype), "table": table.to(device),
        "slot_pos": slot_pos.to(device), "q_pos": q_pos.to(device), "scale": d**-0.5,
    }
