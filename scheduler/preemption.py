"""Swap or recompute? The cost model behind `--preemption-mode auto`.

Swapping a victim costs a fixed latency per swap (launching copies, synchronising) plus
copying its blocks to host and back (bytes ÷ copy bandwidth, twice); recomputing costs prefilling its prompt and generated tokens again (tokens ×
prefill time per token). Both rates are measured at start-up and refined online (an
exponential moving average over real steps), so the choice follows the machine: on a
GPU with a slow bus long contexts favour recompute less than short ones, on a CPU a
memcpy is almost always cheaper. 003_12df107fdefa535c.txt, "swap vs recompute".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.runner import ModelRunner, SeqInput
from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from kvpool.swap import SwapSpace, measure_copy_bandwidth

MODES = ("swap", "recompute", "auto")


@dataclass
class CostModel:
    copy_bytes_per_s: float
    prefill_s_per_token: float
    swap_latency_s: float = 0.0  # fixed cost of one swap-out + swap-in
    smoothing: float = 0.1  # EMA weight of a new observation
    choices: dict[str, int] | None = None

    def swap_cost(self, nbytes: int) -> float:
        return self.swap_latency_s + 2 * nbytes / self.copy_bytes_per_s

    def recompute_cost(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def choose(self, nbytes: int, tokens: int) -> str:
        mode = "swap" if self.swap_cost(nbytes) < self.recompute_cost(tokens) else "recompute"
        if self.choices is None:
            self.choices = {}
        self.choices[mode] = self.choices.get(mode, 0) + 1
        return mode

    def crossover_tokens(self, bytes_per_token: float) -> float:
        """Context length above which swapping is cheaper than recomputing (inf: never).

        Short contexts recompute (the swap's fixed latency dominates); long ones swap,
        as long as copying a token is cheaper than prefilling it."""
        margin = self.prefill_s_per_token - 2 * bytes_per_token / self.copy_bytes_per_s
        return self.swap_latency_s / margin if margin > 0 else float("inf")

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        a = self.smoothing
        self.prefill_s_per_token = (1 - a) * self.prefill_s_per_token + a * seconds / tokens

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        a = self.smoothing
        self.copy_bytes_per_s = (1 - a) * self.copy_bytes_per_s + a * nbytes / seconds


def calibrate(runner: ModelRunner, pool: BlockPool, swap: SwapSpace, num_layers: int,
              tokens: int = 128) -> CostModel:
    """Measure both rates once at start-up on this machine (an empty pool is assumed)."""
    bw = measure_copy_bandwidth(pool)
    tokens = max(1, min(tokens, pool.num_blocks // num_layers * pool.block_size // 2))
    cache = SeqCache(pool, num_layers)
    ids = [1] * tokens
    runner.execute([SeqInput(ids, 0, cache.append(torch.arange(tokens)), cache, True)])  # warm-up
    cache.release()
    t = time.perf_counter()
    runner.execute([SeqInput(ids, 0, cache.append(torch.arange(tokens)), cache, True)])
    per_token = (time.perf_counter() - t) / tokens
    t = time.perf_counter()
    cache.swap_out(swap)
    cache.swap_in(swap)
    latency = max(0.0, time.perf_counter() - t - 2 * cache.num_blocks * swap.bytes_per_block / bw)
    cache.release()
    swap.bytes_out = swap.bytes_in = 0
    return CostModel(copy_bytes_per_s=bw, prefill_s_per_token=per_token, swap_latency_s=latency)
