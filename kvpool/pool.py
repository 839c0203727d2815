"""The block pool: a free list, reference counts and exact accounting of block ids.

A block holds `block_size` token slots of K and V for *one* layer and all kv heads.
Block ids are global, so memory is fungible between layers and requests: a layer that
keeps fewer tokens (an eviction policy, a sliding window) simply holds fewer blocks.
A full-cache request holds `num_layers` blocks per logical block of tokens. The bytes
the ids index are the model runner's `attention.storage.KVStorage`; the pool keeps a
reference to it (`storage`) only so that the moves kvpool decides (compaction,
copy-on-write, RoPE shift, swap) reach it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

import torch

from attention.storage import KVStorage, PoolExhausted
from native.build import load_ops
from native.host import int64_tensor

__all__ = ["BlockPool", "PoolExhausted", "load_mark"]


def load_mark() -> bool:
    """Build and load the tables' C++ passes (csrc/tables_cpu.cpp: marking, freeing,
    compaction, the decode append, reference counts) once; False keeps the torch forms
    (no compiler, or KVSERVE_CPU_KERNEL=0)."""
    return load_ops("kvserve_tables_cpu")


class BlockPool:
    """The blocks' metadata: free list, reference counts and the prefix cache.

    The pool hands out and takes back block ids (ref-counted, so prefix sharing can hold
    one block from several requests); which request or layer owns a block is recorded
    by that request's `SeqCache`, never here.

    Prefix cache (003_12df107fdefa535c.txt, "prefix caching"): a logical block of
    prompt tokens is identified by a chain hash; the `num_layers` blocks that hold it are
    registered together as one *group* under that hash. When their last owner lets go
    they are not wiped but parked, least recently used first, in `_cached`: still
    free (allocatable), but a later request with the same prefix can take them back.
    Allocation uses never-hashed blocks first and then recycles the oldest parked ones,
    forgetting their group; a parked block of a sliding-window lane (`optional_lanes`)
    leaves its group alone, its entry -1: a prefix hit needs only a window's pages of such
    a lane (kvpool/windows.py), so the group still serves the hits that need it not.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 storage: KVStorage | None = None) -> None:
        """`storage`: the tensors these ids index (None: ids alone, for the scheduler's
        and the tables' arithmetic); its block count and size must match."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if storage is not None and (storage.num_blocks, storage.block_size) != (num_blocks,
                                                                                block_size):
            raise ValueError("the storage's blocks differ from the pool's")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = storage
        self.ref = torch.zeros(num_blocks, dtype=torch.int32)
        # Stack order: the lowest ids are handed out first (stable, easy to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but hashed, LRU first
        # prefix hash -> block ids [L]. Plain tuples, not tensors, on purpose: groups
        # live for minutes (until their blocks are recycled) and up to num_blocks / L of
        # them accumulate. A small tensor per group is three C++ allocations (TensorImpl,
        # storage, data) on the engine thread's malloc arena, scattered between each
        # step's short-lived activation buffers; every one of them pins the freed buffers
        # around it, so glibc cannot hand that memory back and the process grew by ~20%
        # RSS over a 10-minute soak while the cache filled (docs/memory.md, "Process
        # memory"). Tuples of small ints live in CPython's own pools instead.
        self.groups: dict[int, tuple[int, ...]] = {}
        self.hash_of: dict[int, int] = {}  # block id -> prefix hash
        # Lanes (a group's positions) whose blocks a group may lose one by one: sliding-
        # window lanes (set by the KV-cache manager).
        self.optional_lanes: frozenset[int] = frozenset()

    @property
    def num_free(self) -> int:
        """Allocatable blocks, including parked prefix-cache blocks."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a reusable prefix."""
        return len(self._cached)

    def allocate(self, n: int) -> torch.Tensor:
        """n fresh block ids (ref count 1) as an int64 tensor."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        ids = int64_tensor(self.take(n))
        self.ref[ids] = 1
        return ids

    def take(self, n: int) -> list[int]:
        """n block ids off the free list, for a caller that sets their reference counts
        to 1 itself in the same pass that uses them (SlotTables.append_decode's C++
        form); until it does they are neither free nor counted."""
        if n > self.num_free:
            raise PoolExhausted(f"asked for {n} blocks, {self.num_free} free")
        if n <= 0:
            return []
        while len(self._free) < n:  # recycle the least recently used cached prefix
            self._recycle(next(iter(self._cached)))
        ids = self.peek(n)
        del self._free[-n:]
        return ids

    def peek(self, n: int) -> list[int]:
        """The ids `take` would hand out next, up to n of them (none of the parked prefix
        blocks), left free: for a pass that counts what it needs as it links them (the
        C++ decode append), which then takes the first so many."""
        return self._free[-n:][::-1] if n > 0 else []

    def incref(self, ids: torch.Tensor) -> None:
        self.ref.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def release(self, ids: torch.Tensor) -> None:
        """Drop one reference to each id; ids whose count reaches zero become free."""
        if ids.numel() == 0:
            return
        if ids.device.type == "cpu" and ids.dtype == torch.int64 and load_mark():
            # one C++ pass (csrc/tables_cpu.cpp::release_refs): the torch form's five
            # dispatches cost more than their work on the few ids a plan frees
            dead = torch.ops.kvserve_tables.release_refs(self.ref, ids).tolist()
        else:
            self.ref.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
            dead = ids[self.ref[ids] == 0].unique().tolist()
        if not self.hash_of:
            self._free.extend(dead)
            return
        for b in dead:
            if b in self.hash_of:
                self._cached[b] = None
            else:
                self._free.append(b)

    # ---- prefix cache ----------------------------------------------------------------
    def register(self, h: int, ids: torch.Tensor) -> None:
        """Publish a computed, immutable group of blocks under prefix hash h (-1 for a
        sliding-window lane whose block is already gone)."""
        group = tuple(ids.tolist())
        if h in self.groups or any(b in self.hash_of for b in group):
            return
        self.groups[h] = group
        for b in group:
            if b >= 0:
                self.hash_of[b] = h

    def acquire(self, h: int, skip: Collection[int] = ()) -> torch.Tensor | None:
        """Take a reference on the blocks cached under h (None on a miss), but those of
        the lanes in `skip` (-1 there); returns a new tensor of their ids, the caller's
        to keep or drop."""
        group = self.groups.get(h)
        if group is None:
            return None
        if skip:
            group = tuple(-1 if i in skip else b for i, b in enumerate(group))
        for b in group:
            self._cached.pop(b, None)
        ids = torch.tensor(group, dtype=torch.int64)
        self.incref(ids[ids >= 0])
        return ids

    def forget(self, h: int) -> None:
        """Drop a cached group (recycled, or about to be written: copy-on-write)."""
        for b in self.groups.pop(h):
            if b < 0:
                continue
            del self.hash_of[b]
            if b in self._cached:
                del self._cached[b]
                self._free.append(b)

    def _recycle(self, b: int) -> None:
        """Make parked block b free: its group forgotten, or where b is a sliding-window
        lane's only its entry (the group's other pages still serve the hits that need
        none of that lane's older pages)."""
        h = self.hash_of[b]
        group = self.groups[h]
        lane = group.index(b)
        if lane not in self.optional_lanes:
            self.forget(h)
            return
        self.groups[h] = (*group[:lane], -1, *group[lane + 1:])
        del self.hash_of[b]
        del self._cached[b]
        self._free.append(b)

    def check_invariants(self, owned: Iterable[torch.Tensor]) -> None:
        """Raise AssertionError unless the free list and ref counts match `owned`.

        `owned` yields every block-id tensor held by a live request (one entry per
        reference). Checked: no id both free and owned, ref count == number of owners,
        no id lost (free + owned covers the pool), no duplicates in the free list.
        """
        counts = torch.zeros(self.num_blocks, dtype=torch.int32)
        for ids in owned:
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        free_ids = self._free + list(self._cached)
        assert len(set(free_ids)) == len(free_ids), "duplicate ids in the free lists"
        assert all(b in self.hash_of for b in self._cached), "a parked block lost its hash"
        assert all(self.hash_of[int(b)] == h for h, ids in self.groups.items() for b in ids
                   if b >= 0)
        free = torch.zeros(self.num_blocks, dtype=torch.bool)
        free[torch.tensor(free_ids, dtype=torch.int64)] = True
        assert not (free & (counts > 0)).any(), "a block is both free and owned"
        assert torch.equal(counts, self.ref), "ref counts differ from the owners"
        assert bool((free | (counts > 0)).all()), "a block is neither free nor owned (leak)"
