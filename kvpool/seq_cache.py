"""One request's view of the pool: per layer, an ordered list of blocks and the
original token position held by every slot of those blocks.

Slots are appended in order (slot j of layer l lives in block `table[l, j // bs]` at
offset `j % bs`). Eviction marks slots dead (`slot_pos = -1`) without moving data; a
block whose slots are all dead is returned to the pool at once and its column removed
from that layer's table. Every layer has its own table because policies keep different
tokens (and pyramid budgets different counts) per layer; a full-cache request keeps all
layers identical, and then appending is a handful of tensor ops, not a loop.
"""

from __future__ import annotations

import torch

from kvpool.pool import BlockPool


class SeqCache:
    def __init__(self, pool: BlockPool, num_layers: int, capacity_blocks: int = 4) -> None:
        self.pool = pool
        self.num_layers = num_layers
        self.bs = pool.block_size
        cap = max(1, capacity_blocks)
        self.table = torch.full((num_layers, cap), -1, dtype=torch.int64)
        self.slot_pos = torch.full((num_layers, cap * self.bs), -1, dtype=torch.int64)
        self.nblocks = torch.zeros(num_layers, dtype=torch.int64)
        self.next_slot = torch.zeros(num_layers, dtype=torch.int64)  # appended slots

    # ---- sizes -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks held in all layers together."""
        return int(self.nblocks.sum())

    @property
    def max_blocks(self) -> int:
        return int(self.nblocks.max())

    def live_tokens(self) -> int:
        """Live slots over all layers (a full-cache request: layers × tokens)."""
        return int((self.slot_pos >= 0).sum())

    def blocks_needed(self, n: int) -> int:
        """Blocks that appending n tokens to every layer would allocate."""
        free_in_tail = self.nblocks * self.bs - self.next_slot
        return int(((n - free_in_tail).clamp(min=0) + self.bs - 1).div(self.bs, rounding_mode="floor").sum())

    def owned_blocks(self) -> torch.Tensor:
        """Every block id held, one entry per reference (for invariant checks)."""
        cols = torch.arange(self.table.shape[1])
        return self.table[cols[None, :] < self.nblocks[:, None]]

    # ---- growth ------------------------------------------------------------------
    def _grow(self, blocks: int) -> None:
        cap = self.table.shape[1]
        if blocks <= cap:
            return
        new_cap = max(blocks, 2 * cap)
        table = torch.full((self.num_layers, new_cap), -1, dtype=torch.int64)
        table[:, :cap] = self.table
        pos = torch.full((self.num_layers, new_cap * self.bs), -1, dtype=torch.int64)
        pos[:, : cap * self.bs] = self.slot_pos
        self.table, self.slot_pos = table, pos

    def append(self, positions: torch.Tensor) -> torch.Tensor:
        """Give n new tokens (original `positions`, [n]) a slot in every layer.

        Allocates blocks as needed (raises PoolExhausted, leaving the cache unchanged,
        if the pool cannot supply them) and returns physical slot ids [L, n] to which
        the runner writes the tokens' K and V.
        """
        n = positions.numel()
        need = ((n - (self.nblocks * self.bs - self.next_slot)).clamp(min=0) + self.bs - 1) // self.bs
        total = int(need.sum())
        if total:
            ids = self.pool.allocate(total)
            self._grow(int((self.nblocks + need).max()))
            first = int(need[0])
            if bool((need == first).all()) and bool((self.nblocks == self.nblocks[0]).all()):
                nb = int(self.nblocks[0])
                self.table[:, nb : nb + first] = ids.view(self.num_layers, first)
            else:  # layers diverged (eviction): place each layer's share
                off = 0
                for layer in range(self.num_layers):
                    k, nb = int(need[layer]), int(self.nblocks[layer])
                    self.table[layer, nb : nb + k] = ids[off : off + k]
                    off += k
            self.nblocks += need
        j = self.next_slot[:, None] + torch.arange(n)  # [L, n] logical slot index
        blocks = self.table.gather(1, j // self.bs)
        self.slot_pos.scatter_(1, j, positions.to(torch.int64).expand(self.num_layers, n))
        self.next_slot += n
        return blocks * self.bs + j % self.bs

    # ---- shrinking -----------------------------------------------------------------
    def evict(self, layer: int, slots: torch.Tensor) -> int:
        """Mark logical slots of one layer dead; free blocks left with no live slot.

        Returns the number of blocks freed. The tail block is kept while it still has
        room for appends, so a request never reallocates the block it is filling.
        """
        self.slot_pos[layer, slots] = -1
        return self._free_dead_blocks(layer)

    def drop_before(self, layer: int, min_pos: int) -> int:
        """Evict every slot of `layer` whose position is < min_pos (sliding windows)."""
        pos = self.slot_pos[layer]
        dead = (pos >= 0) & (pos < min_pos)
        if not bool(dead.any()):
            return 0
        pos[dead] = -1
        return self._free_dead_blocks(layer)

    def _free_dead_blocks(self, layer: int) -> int:
        nb = int(self.nblocks[layer])
        if nb == 0:
            return 0
        alive = (self.slot_pos[layer, : nb * self.bs].view(nb, self.bs) >= 0).any(dim=1)
        tail_has_room = int(self.next_slot[layer]) < nb * self.bs
        if tail_has_room:
            alive[nb - 1] = True
        if bool(alive.all()):
            return 0
        dead_ids = self.table[layer, :nb][~alive]
        keep = alive.nonzero().squeeze(1)
        k = keep.numel()
        self.table[layer, :k] = self.table[layer, keep]
        self.table[layer, k:nb] = -1
        pos = self.slot_pos[layer, : nb * self.bs].view(nb, self.bs)[keep].reshape(-1)
        self.slot_pos[layer, : k * self.bs] = pos
        self.slot_pos[layer, k * self.bs : nb * self.bs] = -1
        self.next_slot[layer] -= (nb - k) * self.bs
        self.nblocks[layer] = k
        self.pool.release(dead_ids)
        return int(dead_ids.numel())

    def release(self) -> None:
        """Give every block back to the pool (request finished, aborted or preempted)."""
        self.pool.release(self.owned_blocks())
        self.table.fill_(-1)
        self.slot_pos.fill_(-1)
        self.nblocks.zero_()
        self.next_slot.zero_()
