"""Host swap space for preempted requests (003_12df107fdefa535c.txt, "swap vs recompute").

Blocks of the same shape as the device pool's, in host memory (pinned when the pool is
on CUDA, so copies run at full PCIe bandwidth). A preempted request's blocks are copied
here and freed on the device; before it resumes they are copied back.
"""

from __future__ import annotations

import time

import torch

from attention.storage import KVStorage, PoolExhausted


class SwapSpace:
    def __init__(self, storage: KVStorage, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        pin = storage.kv.is_cuda
        # The pool's block tensors (codes, and scales for a quantized pool) in host
        # memory: swapped blocks come back byte for byte.
        self.tensors = [torch.zeros((2, num_blocks, *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
                        for t in (storage.kv, storage.scales) if t is not None]
        self.kv = self.tensors[0]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.bytes_per_block = storage.block_bytes
        self.bytes_out = 0
        self.bytes_in = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise PoolExhausted(f"swap space: asked for {n} blocks, {len(self._free)} free")
        ids = torch.tensor(self._free[-n:][::-1], dtype=torch.int64)
        del self._free[-n:]
        return ids

    def release(self, ids: torch.Tensor) -> None:
        self._free.extend(ids.tolist())

    def store(self, ids: torch.Tensor, data: list[torch.Tensor]) -> None:
        """Host blocks `ids` <- `KVStorage.read_blocks` output. The copy to the host
        blocks: an asynchronous one hands the host scatter a buffer the GPU has not
        filled yet, and the blocks came back as garbage (every swap test failed on an
        H200 before commit 2e25e93)."""
        for t, d in zip(self.tensors, data):
            t[:, ids] = d.cpu()

    def load(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Host blocks `ids`, for `KVStorage.write_blocks`."""
        return [t[:, ids] for t in self.tensors]


def measure_copy_bandwidth(storage: KVStorage, nbytes: int = 8 << 20) -> float:
    """Bytes per second of a device -> host copy of pool-shaped data (for the swap cost
    model). On CPU this is a memcpy; on CUDA a pinned device-to-host transfer."""
    n = max(1, min(storage.num_blocks, nbytes // max(1, storage.block_bytes)))
    src = storage.kv[:, :n]
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return src.numel() * src.element_size() / max(best, 1e-9)
