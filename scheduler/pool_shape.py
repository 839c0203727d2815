"""The KV pool's shape, decided once by the engine core: what a page holds
(`EngineConfig.kv_layout`), how many lanes a request's tables have, and how many pages
the pool gets and why (attention/sizing.py's rule, or the user's size)."""

from __future__ import annotations

import torch

from attention.sizing import (
    CPU_FRACTION,
    CUDA_FRACTION,
    WHERE,
    KVSizing,
    activation_reserve,
    auto_pool_blocks,
    moe_token_bytes,
)
from attention.storage import KVStorage
from engine.model_config import ModelConfig
from engine.models.moe import moe_spec
from kvpool.windows import lane_windows, longest_request, request_blocks, vllm_block_lanes
from native.memory import available_bytes, device_memory, gib, parse_bytes
from policies.catalog import parse_kv_policy
from scheduler.engine_config import KV_LAYOUTS, EngineConfig


def heads_per_page(config: EngineConfig, mc: ModelConfig) -> int:
    """The kv heads one page of the pool holds (`EngineConfig.kv_layout`)."""
    if config.kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, not {config.kv_layout!r}")
    return 1 if config.kv_layout == "head" else mc.num_kv_heads


# A per-layer pool's block: vLLM's default page.
LAYER_PAGE_TOKENS = 16
# A per-head page's K bytes the default page size reaches: the decode kernel reads a page
# as one run, and a per-head page is a kv head's share of a per-layer block. Measured
# (benchmarks/bench_decode_kernel.py --per-head, docs/benchmarks.md "Per-head KV"): 16-token
# pages of 2-4 KiB of K cost the kernel 1.04-1.32x a per-layer pool's; 8 KiB pages
# 0.90-0.98x, at head dims 32 (fp32), 64 and 128 (bf16).
HEAD_PAGE_BYTES = 8 << 10
# ... and where requests evict by default (`--default-kv-policy` other than full): each
# lane of a bounded request holds its bound and a partly filled page, so the page is
# memory every lane gives up; 4 KiB pages (32 tokens at the 3m's head dim 32 in fp32)
# cost the kernel 0.97-1.09x a per-layer pool's.
EVICTING_PAGE_BYTES = 4 << 10
HEAD_PAGE_TOKENS = (16, 32, 64)


def page_tokens(config: EngineConfig, mc: ModelConfig, kv_dtype: torch.dtype | str) -> int:
    """The tokens a page holds: `--block-size` if given; else 16 on a per-layer pool,
    and on a per-head pool the fewest of 16, 32, 64 whose page holds HEAD_PAGE_BYTES of
    K, or EVICTING_PAGE_BYTES where the default kv_policy evicts. No more: a coarser
    page frees later, leaves more of each lane's last page empty and shares a prefix
    in coarser steps (under memory pressure the 3m model's 64-token per-head pages held
    21 bounded requests where a per-layer pool held 27: docs/memory.md)."""
    if config.block_size is not None:
        return config.block_size
    if config.kv_layout != "head":
        return LAYER_PAGE_TOKENS
    evicts = parse_kv_policy(config.default_kv_policy or "full").name != "full"
    page_bytes = EVICTING_PAGE_BYTES if evicts else HEAD_PAGE_BYTES
    for tokens in HEAD_PAGE_TOKENS:  # bytes_per_block counts K and V
        if KVStorage.bytes_per_block(tokens, 1, mc.head_dim, kv_dtype) >= 2 * page_bytes:
            return tokens
    return HEAD_PAGE_TOKENS[-1]


def reserve_slack(config: EngineConfig, mc: ModelConfig) -> int | None:
    """The tokens a bounded request's reservation leaves free in each lane past its
    bound (KVCacheManager.reservation): a page on a per-layer pool (None), at most a
    per-layer page's 16 on a per-head pool, whose pages are longer."""
    if num_lanes(config, mc) == mc.num_layers:
        return None
    assert config.block_size is not None, "call once page_tokens has fixed the page"
    return min(config.block_size, LAYER_PAGE_TOKENS)


def num_lanes(config: EngineConfig, mc: ModelConfig) -> int:
    """The tables' lanes: a request holds a page list and a length in each."""
    return mc.num_layers * mc.num_kv_heads // heads_per_page(config, mc)


def windows_of(config: EngineConfig, mc: ModelConfig) -> list[int | None]:
    """Per lane, the sliding window it keeps (kvpool/windows.py), None for a lane that
    keeps the whole context: every lane without hybrid memory (`hybrid_kv_cache`)."""
    lanes = num_lanes(config, mc)
    if not config.hybrid_kv_cache:
        return [None] * lanes
    return lane_windows(mc.sliding_windows, lanes // mc.num_layers)


def step_activations(config: EngineConfig, mc: ModelConfig, itemsize: int) -> int:
    """Bytes the largest step's activations take (attention/sizing.py's reserve): a dense
    MLP's or attention's widest row, or a sparse block's `top_k` experts' rows a token."""
    hf = mc.hf_config
    widest = max(mc.hidden_size, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim,
                 2 * int(getattr(hf, "intermediate_size", None) or 4 * mc.hidden_size))
    moe = moe_spec(mc.architecture, hf)
    sparse = 0 if moe is None else moe_token_bytes(moe.hidden_size, moe.intermediate_size,
                                                   moe.top_k, itemsize)
    return activation_reserve(config.max_num_batched_tokens, widest, itemsize,
                              config.max_num_seqs, mc.vocab_size, token_bytes=sparse)


def size_kv_pool(config: EngineConfig, mc: ModelConfig, device: torch.device,
                 max_model_len: int, kv_dtype: torch.dtype | str, act_itemsize: int
                 ) -> KVSizing:
    """The pool's size and why: `num_blocks` if given, else `kv_cache_memory`, else
    attention/sizing.py's rule over the memory available now (call it once the weights
    are loaded). Raises KVPoolTooSmall when that does not hold one request of
    `max_model_len` tokens."""
    bs, layers = page_tokens(config, mc, kv_dtype), num_lanes(config, mc)
    per_block = KVStorage.bytes_per_block(bs, heads_per_page(config, mc), mc.head_dim, kv_dtype)
    windows, chunk = windows_of(config, mc), config.max_num_batched_tokens
    # a request of the whole context, its windowed lanes holding their windows
    one = request_blocks(max_model_len, windows, chunk, bs)

    def sized(source: str, blocks: int, why: str, seen: int = 0, seen_in: str = ""
              ) -> KVSizing:
        return KVSizing(source, blocks, per_block, blocks * bs // layers, why, seen, seen_in,
                        context=max_model_len, requests=blocks // one,
                        longest=longest_request(blocks, windows, chunk, bs, max_model_len),
                        windows=tuple(mc.sliding_windows), hybrid=config.hybrid_kv_cache,
                        block_lanes=vllm_block_lanes(windows))

    if config.num_blocks is not None:
        return sized("num_blocks", config.num_blocks, "--num-blocks")
    if config.kv_cache_memory is not None:
        return sized("kv_cache_memory", parse_bytes(config.kv_cache_memory) // per_block,
                     f"--kv-cache-memory {config.kv_cache_memory}")
    reserve = step_activations(config, mc, act_itemsize)
    cap = config.max_num_seqs * one
    held = "activations"
    if device.type == "cuda":
        free, total = device_memory(device)
        auto = auto_pool_blocks(free, per_block, cap, reserve, CUDA_FRACTION, total=total,
                                min_blocks=one, where=f"on {device}", context=max_model_len,
                                reserved_for=held)
        why = (f"auto: {CUDA_FRACTION:.0%} of {gib(total)} on {device}, "
               f"{gib(total - free)} in use after the weights")
        seen, seen_in = free, "cuda"
    else:
        if config.preemption_mode != "recompute":  # swap space is host memory too
            reserve += parse_bytes(config.swap_space)
            held = "activations and --swap-space"
        avail = available_bytes()
        where = f"available after the weights ({WHERE.get(avail.source, avail.source)})"
        auto = auto_pool_blocks(avail.bytes, per_block, cap, reserve, CPU_FRACTION,
                                min_blocks=one, where=where, context=max_model_len,
                                reserved_for=held)
        why = f"auto: {CPU_FRACTION:.0%} of {gib(avail.bytes)} {where}"
        seen, seen_in = avail.bytes, avail.source
    why += f", minus {gib(reserve)} for {held}"
    if auto.capped:
        why += f"; capped at {config.max_num_seqs} sequences × {max_model_len} tokens"
    return sized("auto", auto.num_blocks, why, seen, seen_in)
