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

from attention.swap import measure_copy_bandwidth
from engine.runner import ModelRunner
from engine.step import SeqInput
from kvpool.manager import KVCacheManager

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


def calibrate(runner: ModelRunner, kv: KVCacheManager, tokens: int = 128) -> CostModel:
    """Measure both rates once at start-up on this machine (an empty pool and a manager
    with swap space are assumed)."""
    swap = kv.swap
    assert swap is not None
    bw = measure_copy_bandwidth(runner.storage)
    tokens = max(1, min(tokens, kv.num_blocks // kv.num_layers * kv.block_size // 2))
    cache = kv.new_cache(tokens)
    ids = [1] * tokens
    runner.execute([SeqInput(ids, 0, kv.allocate(cache, 0, tokens), cache, True)])  # warm-up
    kv.release(cache)
    t = time.perf_counter()
    runner.execute([SeqInput(ids, 0, kv.allocate(cache, 0, tokens), cache, True)])
    per_token = (time.perf_counter() - t) / tokens
    t = time.perf_counter()
    kv.swap_out(cache)
    kv.swap_in(cache)
    latency = max(0.0, time.perf_counter() - t - 2 * cache.num_blocks * swap.bytes_per_block / bw)
    kv.release(cache)
    swap.bytes_out = swap.bytes_in = 0
    return CostModel(copy_bytes_per_s=bw, prefill_s_per_token=per_token, swap_latency_s=latency)
