"""The slot tables' eviction passes: carrying out a group's drop mask (`evict_mask`)
and freeing the blocks no live slot is left in (`free_dead_blocks`), each one C++ call
on CPU (`csrc/tables_cpu.cpp`: `evict_rows`, `free_dead`) with its torch form beside it.
A mixin of `SlotTables`, apart from the rows' layout and the decode append."""

from __future__ import annotations

import torch

from kvpool.pool import BlockPool
from kvpool.rows import (
    LIVE,
    NBLOCKS,
    NEXT,
    CacheRow,
    layer_mask,
    over_state,
    put_rows,
    take_rows,
)
from native.host import bool_tensor, int64_tensor


class EvictionPasses:
    """`SlotTables`' eviction; reads its `table`, `slot_pos`, `sizes`, `sz`, `state`,
    `bs` and `num_layers`, and asks its `native()` whether the C++ passes serve."""

    def evict_mask(self, pool: BlockPool, caches: list[CacheRow],
                   dead: torch.Tensor) -> list[tuple[int, int, list[int]]]:
        """Mark the slots where `dead` [L, R, W] is True dead (W a multiple of the block
        size, at least every cache's held width) and free the blocks that leaves without
        a live slot; per cache (slots evicted over all layers, blocks freed, slots
        evicted in each layer: the layers a compaction or re-rotation revisits). The one
        way a policy's plan reaches the pool: a fixed number of ops for any batch.
        The C++ form (csrc/tables_cpu.cpp::evict_rows) marks and frees in one call, the
        torch form is `_mark_dead` then `free_dead_blocks`; both take the dead slots off
        the rows' live counts (`sizes`)."""
        rows = int64_tensor([c.row for c in caches])
        alike = bool_tensor([c.alike for c in caches])
        if dead.device.type == "cpu" and self.native():  # marking and freeing, one pass
            states, columns = self.native_states()
            info, ids = torch.ops.kvserve_tables.evict_rows(
                self.table, self.slot_pos, self.sizes, states, columns, rows, dead, alike,
                self.bs)
            pool.release(ids)
            per_cache = info.tolist()
        else:
            per_cache = self._evict_torch(pool, caches, rows, dead, alike)
        done = []
        for c, (died, freed, same, *by_layer) in zip(caches, per_cache):
            if died:
                c.alike = c.alike and bool(same)
                c.uniform = c.intact = False
            done.append((died, freed, by_layer))
        return done

    def _evict_torch(self, pool: BlockPool, caches: list[CacheRow], rows: torch.Tensor,
                     dead: torch.Tensor, alike: torch.Tensor) -> list[list[int]]:
        """`evict_rows`' torch form: per cache [slots that died over all layers, blocks
        freed, whether every layer lost the same slots, then the slots that died in each
        layer]."""
        counts, emptied, same = self._mark_dead(rows, dead, alike)
        if not any(map(any, counts)):
            return [[0, 0, True, *k] for k in counts]
        hit = [i for i, e in enumerate(emptied.tolist()) if e]
        freed = dict(zip(hit, self.free_dead_blocks(pool, [caches[i] for i in hit]))) if hit else {}
        return [[sum(k), freed.get(i, 0), s, *k] for i, (k, s) in enumerate(zip(counts, same))]

    def _mark_dead(self, rows: torch.Tensor, dead: torch.Tensor, alike: torch.Tensor
                   ) -> tuple[list[list[int]], torch.Tensor, list[bool]]:
        """`evict_mask`'s marking as torch ops (csrc/tables_cpu.cpp's contract): per cache
        the slots that died per layer, whether a block lost its last live slot, and
        (alike caches) whether every layer lost the same slots."""
        nl, r, w = dead.shape
        sp = self.slot_pos[:, :, :w].index_select(1, rows)  # [L, R, W]
        d = dead & (sp >= 0)
        died = d.sum(dim=2).t()  # [R, L]
        counts = died.tolist()
        if not any(map(any, counts)):
            return counts, torch.zeros(r, dtype=torch.bool), [True] * r
        self.sizes[:, LIVE].index_add_(0, rows, -died)
        sp.masked_fill_(d, -1)
        self.slot_pos[:, :, :w].index_copy_(1, rows, sp)
        same = [True] * r
        which = alike.nonzero().flatten().tolist()
        if which:  # only an alike cache needs to know: every layer lost the same slots
            sub = d[:, which]
            for i, s in zip(which, (sub == sub[:1]).all(dim=2).all(dim=0).tolist()):
                same[i] = s
        shape = (nl, r, w // self.bs, self.bs)
        emptied = (d.view(shape).any(dim=3) & ~(sp.view(shape) >= 0).any(dim=3)).any(dim=2).any(dim=0)
        return counts, emptied, same

    def free_dead_blocks(self, pool: BlockPool, caches: list[CacheRow],
                         layers: list[int] | None = None) -> list[int]:
        """Return every block of `caches` (only `layers`, if given) with no live slot to
        the pool and close the gaps in their tables, keeping the order of the rest;
        returns the blocks freed per cache. A tail block with room for appends stays."""
        # Only the blocks these caches hold: the tables' width may be twice that.
        nl, bs = self.num_layers, self.bs
        rows = [c.row for c in caches]
        row_t = int64_tensor(rows)
        if self.table.device.type == "cpu" and self.native():  # one pass (csrc/tables_cpu.cpp)
            states, columns = self.native_states()  # it shortens the rows' sizes too
            ids, ndead = torch.ops.kvserve_tables.free_dead(
                self.table, self.slot_pos, self.sizes, states, columns, row_t,
                layer_mask(nl, layers), bs)
            pool.release(ids)
            return ndead.sum(dim=0).tolist()
        sizes = self.sizes.index_select(0, row_t)
        nb, nxt = sizes[:, NBLOCKS].t(), sizes[:, NEXT].t()  # [L, R] each
        w = int(nb.max())
        table = take_rows(self.table, rows, w)  # [L, R, w]
        pos = take_rows(self.slot_pos, rows, w * bs).view(nl, len(caches), w, bs)
        cols = torch.arange(w)
        held = cols < nb[..., None]
        alive = (pos >= 0).any(dim=3)
        # The tail block still takes appends while it has room.
        alive |= (cols == (nb - 1).clamp(min=0)[..., None]) & (nxt < nb * bs)[..., None]
        dead = held & ~alive
        if layers is not None:
            dead &= layer_mask(nl, layers)[:, None, None]
        counts = dead.sum(dim=2).t().tolist()  # [R][L]
        if not any(map(any, counts)):
            return [0] * len(caches)
        freed_ids = table[dead]
        # Kept columns first, in order; the freed ones and the spare ones after them.
        kept = held & ~dead
        order = torch.where(kept, cols, w + cols).argsort(dim=2)
        k = kept.sum(dim=2, keepdim=True)
        beyond = cols >= k
        table = table.gather(2, order).masked_fill_(beyond, -1)
        pos = pos.gather(2, order[..., None].expand(-1, -1, -1, bs))
        pos.masked_fill_(beyond[..., None], -1)
        put_rows(self.table, rows, table)
        put_rows(self.slot_pos, rows, pos.view(nl, len(caches), w * bs))
        for t in self.state.values():  # each token's state moves with it
            extra = t.shape[3:]
            st = take_rows(t, rows, w * bs).view(nl, len(caches), w, bs, *extra)
            st = st.gather(2, over_state(order[..., None].expand(-1, -1, -1, bs), extra))
            put_rows(t, rows, st.view(nl, len(caches), w * bs, *extra))
        return self._freed(pool, caches, freed_ids, counts)

    def _freed(self, pool: BlockPool, caches: list[CacheRow], ids: torch.Tensor,
               counts: list[list[int]]) -> list[int]:
        """The torch form of `free_dead_blocks`' bookkeeping (the C++ pass does it in
        place): release `ids` and shorten each cache by its dead blocks per layer
        (`counts` [R][L]); returns the blocks freed per cache."""
        if not any(map(any, counts)):
            return [0] * len(caches)
        pool.release(ids)
        bs, nl, sz = self.bs, self.num_layers, self.sz
        for c, per_layer in zip(caches, counts):
            if any(per_layer):
                o = c.row * 3 * nl
                for layer, x in enumerate(per_layer):
                    sz[o + NBLOCKS * nl + layer] -= x
                    sz[o + NEXT * nl + layer] -= x * bs
        return [sum(x) for x in counts]
