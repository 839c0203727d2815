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


def reference_attention(case: dict, window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention as the model classes write it, one query head at a time in float64, for
    a case of `make_case`'s form: each query's visible slots by position (filled, causal,
    inside the window), logits q·k·scale, soft-capped as transformers' Gemma 2 does (cap ·
    tanh(logits / cap)), a softmax whose denominator adds exp(sink) of the head's learned
    sink (transformers' GptOssAttention: `sinks` [Hq] or [B, Hq]), the values weighted.
    -> (out [B, Tq, Hq, D], mass [B, Tq, Hkv, S]: each slot's probability summed over
    its kv group), zeros on padded query rows and on a row that sees nothing."""
    q, k_cache, v_cache = case["q"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu()
    table, slot_pos, q_pos = case["table"].cpu(), case["slot_pos"].cpu(), case["q_pos"].cpu()
    b, tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    out = torch.zeros(b, tq, hq, d, dtype=torch.float64)
    mass = torch.zeros(b, tq, hkv, slot_pos.shape[1], dtype=torch.float64)
    for i in range(b):
        k = k_cache[table[i].clamp(min=0)].reshape(-1, hkv, d).double()
        v = v_cache[table[i].clamp(min=0)].reshape(-1, hkv, d).double()
        pos = slot_pos[i]
        for t in range(tq):
            p = int(q_pos[i, t])
            if p >= PAD_QUERY_POS:
                continue
            seen = (pos >= 0) & (pos <= p)
            if window is not None:
                seen &= pos > p - window
            idx = seen.nonzero()[:, 0]
            for h in range(hq):
                logits = (k[idx, h // g] @ q[i, t, h].double()) * case["scale"]
                if softcap is not None:
                    logits = torch.tanh(logits / softcap) * softcap
                if sinks is not None:
                    sink = float(sinks[h] if sinks.dim() == 1 else sinks[i, h])
                    top = max([sink, *logits.tolist()])
                    e = torch.exp(logits - top)
                    prob = e / (e.sum() + torch.exp(torch.tensor(sink - top, dtype=torch.float64)))
                elif len(idx) == 0:
                    continue
                else:
                    prob = torch.softmax(logits, dim=0)
                out[i, t, h] = prob @ v[idx, h // g]
                mass[i, t, h // g, idx] += prob
    return out, mass
