"""Packing a cache's live tokens into its first blocks (`compact`): what keeps a policy
that evicts scattered tokens within its reservation.

Why a module of its own: the tables (kvpool/tables.py) say where every token is and
change by small marks (an append, an eviction, freeing an emptied block); compaction is
the one change that moves tokens' K/V between blocks, with its C++ pass, its torch form
and copy-on-write for blocks shared through the prefix cache.
"""

from __future__ import annotations

import torch

from kvpool.pool import BlockPool
from kvpool.rows import NEXT, CacheRow, layer_mask, over_state
from kvpool.tables import SlotTables, load_mark
from native.host import int64_tensor


def compact(tables: SlotTables, pool: BlockPool, caches: list[CacheRow],
            layers: list[int] | None = None) -> list[int]:
    """Pack every (cache, layer)'s live tokens, in order, into its first blocks and
    free the rest (all layers, or only `layers`); returns blocks freed per cache.
    Lazy Pruning's amortisation (000_8900623ad98b28fb.txt §3: partly dead blocks
    become full ones) and PagedEviction's kept order aligned with physical blocks
    (001_01037b507c6df960.txt Alg. 2-3).

    In place, so it needs no free block: it is what keeps a scattered-eviction
    policy within its reservation when the pool is full. Tokens only move to lower
    slots, and the one gather reads every source before the scatter writes, so
    overlapping moves are safe; one gather and one scatter move the tokens of every
    (cache, layer) at once. A destination block shared through the prefix cache is
    copied first (copy-on-write), and a published one unpublished; when the pool
    cannot lend the copies, the caches that need them are left as they are."""
    if (tables.table.device.type == "cpu" and pool.storage.device.type == "cpu" and not pool.hash_of
            and load_mark()):  # the C++ pass moves K/V in host memory alone
        done = _compact_native(tables, pool, caches, layers)
        if done is not None:  # None: a destination block is shared (copy-on-write)
            return done
    nl, bs, w = tables.num_layers, tables.bs, tables.width
    s_len = w * bs
    rows = int64_tensor([c.row for c in caches])
    nxt = tables.sizes[:, NEXT].index_select(0, rows).t()  # [L, R]
    sp = tables.slot_pos.index_select(1, rows)  # [L, R, S]
    live = sp >= 0
    n = live.sum(dim=2)
    hole = n != nxt
    if layers is not None:
        hole &= layer_mask(nl, layers)[:, None]
    ar = torch.arange(s_len)
    order = torch.where(live, ar, s_len + ar).argsort(dim=2)  # live first, in order
    moved = (ar < n[..., None]) & (order != ar) & hole[..., None]
    table = tables.table.index_select(1, rows)  # [L, R, W]
    dst_col = (ar // bs).expand_as(sp)
    dest = moved.view(*moved.shape[:2], w, bs).any(dim=3)  # [L, R, W] columns written
    if _copy_on_write(tables, pool, caches, table, dest, hole):
        table = tables.table.index_select(1, rows)  # the copies' ids
    moved &= hole[..., None]
    counts = hole.t().tolist()
    if not any(map(any, counts)):
        return [0] * len(caches)
    src = table.gather(2, order // bs) * bs + order % bs
    dst = table.gather(2, dst_col) * bs + ar % bs
    pool.storage.copy_slots(dst[moved], src[moved])
    keep = ar < torch.where(hole, n, nxt)[..., None]
    sp = torch.where(hole[..., None], sp.gather(2, order), sp).masked_fill_(~keep, -1)
    want = torch.where(hole, -(-n // bs), torch.tensor([c.nblocks for c in caches]).t())
    gone = torch.arange(w) >= want[..., None]
    pool.release(table[gone & (table >= 0)])
    tables.table.index_copy_(1, rows, table.masked_fill(gone, -1))
    tables.slot_pos.index_copy_(1, rows, sp)
    for t in tables.state.values():  # each token's state moves with it
        extra = t.shape[3:]
        st = t.index_select(1, rows)
        moved_st = st.gather(2, over_state(order, extra))
        t.index_copy_(1, rows, torch.where(over_state(hole[..., None], extra, expand=False),
                                           moved_st, st))
    freed = []
    for c, h, nb, k, size in zip(caches, counts, want.t().tolist(), n.t().tolist(),
                                 [c.nblocks for c in caches]):
        if any(h):
            c.alike = False  # layers are packed each on their own
        c.next_slot = [k_ if h_ else s_ for k_, h_, s_ in zip(k, h, c.next_slot)]
        c.nblocks = nb
        freed.append(sum(size) - sum(nb))
    return freed


def _compact_native(tables: SlotTables, pool: BlockPool, caches: list[CacheRow],
                    layers: list[int] | None) -> list[int] | None:
    """`compact` in one C++ pass (csrc/tables_cpu.cpp::compact_rows: positions, state,
    K/V and the rows' sizes moved slot by slot, no sort, no index tensors), for a
    pool without published blocks; None, with nothing changed, when a destination
    block is shared: the torch form copies it first."""
    rows = int64_tensor([c.row for c in caches])
    states, columns = tables.native_states()
    declined, ids, gone, _, hole = torch.ops.kvserve_tables.compact_rows(
        tables.table, tables.slot_pos, tables.sizes, states, columns, pool.storage.slot_arrays(), rows,
        layer_mask(tables.num_layers, layers), pool.ref, tables.bs)
    if declined:
        return None
    pool.release(ids)
    # [L, R] results read as host lists: a torch reduction more is a cold op (~10 us)
    for c, h in zip(caches, zip(*hole.tolist())):
        if any(h):
            c.alike = False  # layers are packed each on their own
    return [sum(g) for g in zip(*gone.tolist())]


def _copy_on_write(tables: SlotTables, pool: BlockPool, caches: list[CacheRow],
                   table: torch.Tensor, dest: torch.Tensor, hole: torch.Tensor) -> bool:
    """Make the blocks a compaction writes (`dest` columns of the caches' `table`
    rows, [L, R, W]) writable: a block another request holds gets a private copy, a
    published one leaves the prefix cache. Clears `hole` for the caches whose copies
    the pool cannot lend. Returns whether any table entry changed."""
    blocks = table[dest]
    if blocks.numel() == 0:
        return False
    cand = blocks.unique()
    refs = pool.ref[cand].tolist()
    ids = cand.tolist()
    shared = {b for b, r in zip(ids, refs) if r > 1}
    for b in ids:
        if b not in shared and b in pool.hash_of:
            pool.forget(pool.hash_of[b])
    if not shared:
        return False
    where = (torch.isin(table, torch.tensor(sorted(shared))) & dest).nonzero().tolist()
    if len(where) > pool.num_free:  # the pool cannot lend the copies
        for layer, r, _ in where:
            hole[layer, r] = False
        return False
    for layer, r, col in where:
        b = int(table[layer, r, col])
        if int(pool.ref[b]) > 1:  # still shared (an earlier copy may have been ours)
            new = pool.allocate(1)
            pool.storage.copy_blocks(new, torch.tensor([b]))
            tables.table[layer, caches[r].row, col] = new[0]
            pool.release(torch.tensor([b]))
        elif b in pool.hash_of:
            pool.forget(pool.hash_of[b])
    return True
