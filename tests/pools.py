"""A block pool with its storage, as tests build them: the KV tensors (the runner's
`KVStorage`) and the block ids' metadata (kvpool's `BlockPool`) that index them."""

from __future__ import annotations

import torch

from attention.storage import KVStorage
from kvpool.pool import BlockPool


def make_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
              scratch: bool = False) -> BlockPool:
    storage = KVStorage(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                        device=device, scratch=scratch)
    return BlockPool(num_blocks, block_size, storage=storage)


def run_within_reservations(eng) -> int:
    """Step `eng` until its requests finish, checking every step that no running request
    holds more than its reservation (an eighth more while nobody waits: the spare blocks
    it may borrow); returns the most that ran at once. Ends with no preemption and every
    block back."""
    most = 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, eng.num_running)
        for r in eng.scheduler.running:
            limit = r.reserve_blocks + (0 if eng.scheduler.waiting else r.reserve_blocks // 8)
            assert r.cache.num_blocks <= limit, (r.request_id, r.cache.num_blocks)
    assert sum(eng.stats().preemptions_total.values()) == 0
    assert eng.pool.num_used == 0
    return most
