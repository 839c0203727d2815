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
