"""One request's view of the pool: per layer, an ordered list of blocks and the
original token position held by every slot of those blocks.

Slots are appended in order (slot j of layer l lives in block `table[l, j // bs]` at
offset `j % bs`). Eviction marks slots dead (`slot_pos = -1`) without moving data; a
block whose slots are all dead is returned to the pool at once and its column removed
from that layer's table. Every layer has its own table because policies keep different
tokens (and pyramid budgets different counts) per layer. A full-cache request keeps all
layers identical (`uniform`).

The table, positions and sizes (blocks, appended and live slots per layer) are this
request's *row* of the engine's shared `SlotTables` (kvpool/tables.py): a step handles
every row with batched ops, the decode append bumps the sizes in C++, and Python reads
them as ints through the tables' memoryview (`sz`), deciding without a tensor op.
Operations on one request (a prefill chunk, a per-request plan, swap) live here; those
of a whole batch in `SlotTables`, which this class calls for its own row too.
"""

from __future__ import annotations

import torch

from kvpool import compaction
from kvpool.pool import BlockPool
from kvpool.rows import LIVE, NBLOCKS, NEXT
from kvpool.tables import SlotTables


def _blocks_for(nblocks: int, next_slot: int, n: int, bs: int) -> int:
    """New blocks one layer needs to append n slots."""
    return max(0, n - (nblocks * bs - next_slot) + bs - 1) // bs


def _size_field(field: int, doc: str) -> property:
    """A per-layer size of the cache's row (`SlotTables.sizes[row, field]`), read as a
    list of ints (0s before the row is taken) and written back whole."""
    def get(self: SeqCache) -> list[int]:
        if self._row is None:
            return [0] * self.num_layers
        nl = self.num_layers
        o = self._o + field * nl
        return self.tables.sz[o : o + nl].tolist()

    def put(self: SeqCache, values: list[int]) -> None:
        self._set(field, values)

    return property(get, put, doc=doc)


class SeqCache:
    # Slots, not a __dict__: every decode step reads each running cache's sizes, and a
    # compact object is fewer cache lines to miss after the forward has run.
    __slots__ = (
        "_o",
        "_row",
        "alike",
        "bs",
        "intact",
        "num_layers",
        "pool",
        "ring",
        "swapped",
        "tables",
        "uniform",
    )

    def __init__(self, pool: BlockPool, num_layers: int, capacity_blocks: int = 4,
                 tables: SlotTables | None = None) -> None:
        """`tables`: the engine's shared `SlotTables` (this cache is one row of it);
        a cache made alone (tests, tools) gets tables of its own."""
        self.pool = pool
        self.num_layers = num_layers
        self.bs = pool.block_size
        self.tables = tables if tables is not None else SlotTables(num_layers, self.bs, 1)
        assert self.tables.num_layers == num_layers and self.tables.bs == self.bs
        self._row: int | None = None  # taken on first use: until then every size is 0
        self._o = 0  # where the row's sizes start in `tables.sz`
        self.ensure_capacity(max(1, capacity_blocks))
        self.uniform = True  # every layer holds the same slots (no eviction yet)
        # Every layer holds the same positions in the same logical slots (evicted alike,
        # as position-only policies do): per-layer sizes are then all live // layers.
        self.alike = True
        # Every lane holds every token appended, but the oldest pages a sliding window
        # dropped (kvpool/windows.py): its pages are then a prefix others may share.
        self.intact = True
        self.swapped = False  # table holds host swap-space ids instead of pool ids
        self.ring = False  # decode tokens may go over the oldest past the sinks (start_ring)

    # ---- the row ---------------------------------------------------------------------
    @property
    def row(self) -> int:
        """This cache's row of the shared tables (taken on first use, given back by
        `release`)."""
        if self._row is None:
            self._row = self.tables.acquire_row()
            self._o = self._row * 3 * self.num_layers
        return self._row

    @property
    def has_row(self) -> bool:
        """Whether it holds a row yet (`row` takes one on first use: a cache without one
        holds nothing)."""
        return self._row is not None

    # ---- sizes: the row's slice of `tables.sizes` ----------------------------------------
    def _set(self, field: int, values: list[int]) -> None:
        o = self._o + field * self.num_layers if self._row is not None else \
            (self.row * 3 + field) * self.num_layers  # taking a row may grow the tables
        sz = self.tables.sz
        for i, x in enumerate(values):
            sz[o + i] = x

    def peak(self) -> tuple[int, int]:
        """(blocks over all layers, live tokens summed over layers // layers): the most
        this cache has held right after an append (`SlotTables.peaks`)."""
        if self._row is None:
            return 0, 0
        pk, o = self.tables.pk, 2 * self._row
        return pk[o], pk[o + 1]

    def _note_peak(self) -> None:
        """Fold the sizes now into `peak` (the C++ decode append does it itself)."""
        pk, o = self.tables.pk, 2 * self.row
        pk[o] = max(pk[o], self.num_blocks)
        pk[o + 1] = max(pk[o + 1], self.live // self.num_layers)

    # Copies, per layer: write a whole list back (`c.nblocks = [...]`), never an item.
    nblocks = _size_field(NBLOCKS, "Blocks held per layer.")
    next_slot = _size_field(NEXT, "Slots appended per layer, live or dead.")
    layer_live = _size_field(LIVE, "Live slots per layer.")

    @property
    def table(self) -> torch.Tensor:
        """[L, W] block ids, -1 past the held blocks (a view of the shared tables)."""
        row = self.row  # first: taking a row may grow the tables
        return self.tables.table[:, row]

    @property
    def slot_pos(self) -> torch.Tensor:
        """[L, W * bs] original position of every logical slot, -1 = empty or evicted."""
        row = self.row
        return self.tables.slot_pos[:, row]

    @property
    def aligned(self) -> bool:
        """Every layer holds the same number of blocks and slots (the next token lands in
        the same logical slot everywhere): a decode append is then plain int arithmetic."""
        if self.uniform:
            return True
        nb, nxt, nl = self.nblocks, self.next_slot, self.num_layers
        return nb.count(nb[0]) == nl and nxt.count(nxt[0]) == nl

    # ---- sizes -------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Live slots summed over layers."""
        if self._row is None:
            return 0
        o = self._o + LIVE * self.num_layers
        return sum(self.tables.sz[o : o + self.num_layers])

    @property
    def num_blocks(self) -> int:
        """Blocks held in all layers together."""
        if self._row is None:
            return 0
        if self.uniform:
            return self.tables.sz[self._o] * self.num_layers
        return sum(self.tables.sz[self._o : self._o + self.num_layers])

    @property
    def max_blocks(self) -> int:
        if self._row is None:
            return 0
        sz, o = self.tables.sz, self._o
        return sz[o] if self.uniform else max(sz[o : o + self.num_layers])

    def blocks_needed(self, n: int) -> int:
        """Blocks that appending n tokens to every layer would allocate."""
        if n == 1 and self._row is not None:  # every running request, every step
            sz, o, nl = self.tables.sz, self._o, self.num_layers  # a layer whose last block is full
            if self.uniform:
                return nl if sz[o + nl] >= sz[o] * self.bs else 0
            if self.ring:  # a layer at its cap takes none: the append's own count
                return self.tables.held_and_need([self._row])[1][0]
            z, bs = sz[o : o + 2 * nl].tolist(), self.bs
            return sum([x >= b * bs for b, x in zip(z[:nl], z[nl:])])
        if self.uniform:
            return self.num_layers * _blocks_for(self.nblocks[0], self.next_slot[0], n, self.bs)
        return sum(_blocks_for(b, s, n, self.bs) for b, s in zip(self.nblocks, self.next_slot))

    def owned_blocks(self) -> torch.Tensor:
        """Every pool block id held, one entry per reference (for invariant checks)."""
        if self.swapped:
            return torch.empty(0, dtype=torch.int64)
        return self._held()

    def _held_mask(self) -> torch.Tensor:  # [L, W]: each lane's held columns
        return torch.arange(self.table.shape[1])[None, :] < torch.tensor(self.nblocks)[:, None]

    def _held(self) -> torch.Tensor:
        return self.table[self._held_mask()]

    # ---- prefix cache and swap -------------------------------------------------------
    def adopt(self, groups: list[torch.Tensor]) -> None:
        """Start an empty cache from prefix-cache hits: one group of `num_layers` block
        ids per logical block, already referenced for us, every slot live; -1 where a
        sliding-window lane takes none of the hit's oldest pages (it holds the rest from
        its first slot on: positions from that page's first)."""
        k, bs = len(groups), self.bs
        if k == 0:
            return
        self.ensure_capacity(k + 1)
        ids = torch.stack(groups, dim=1)  # [L, k]
        skipped = (ids < 0).sum(dim=1)[:, None]  # leading pages a windowed lane does without
        cols = torch.arange(k)[None, :]
        kept = cols < k - skipped
        self.table[:, :k] = ids.gather(1, (cols + skipped).clamp(max=k - 1)).masked_fill(~kept, -1)
        self.slot_pos[:, : k * bs] = (torch.arange(k * bs) + skipped * bs).masked_fill(
            ~kept.repeat_interleave(bs, dim=1), -1)
        held = (k - skipped[:, 0]).tolist()
        if held.count(k) < self.num_layers:
            self.uniform = self.alike = False
        self.tables.fill_state(slice(None), self.row, slice(0, k * bs))
        self.nblocks = held
        self.next_slot = [b * bs for b in held]
        self.layer_live = [b * bs for b in held]
        self._note_peak()

    def swap_out(self, swap) -> int:
        """Copy every held block to host swap space and free it on the device; returns
        bytes moved. The table keeps its shape, holding host ids until `swap_in`."""
        held_mask = self._held_mask()
        dev = self.table[held_mask]
        host = swap.allocate(dev.numel())
        swap.store(host, self.pool.storage.read_blocks(dev))
        if self.pool.storage.device.type == "cuda":
            torch.cuda.synchronize()
        self.pool.release(dev)
        self.table[held_mask] = host
        self.swapped = True
        moved = dev.numel() * swap.bytes_per_block
        swap.bytes_out += moved
        return moved

    def swap_in(self, swap) -> int:
        """Bring swapped blocks back into fresh pool blocks (raises PoolExhausted first if
        they do not fit); returns bytes moved."""
        held_mask = self._held_mask()
        host = self.table[held_mask]
        dev = self.pool.allocate(host.numel())
        self.pool.storage.write_blocks(dev, swap.load(host))
        swap.release(host)
        self.table[held_mask] = dev
        self.swapped = False
        moved = host.numel() * swap.bytes_per_block
        swap.bytes_in += moved
        return moved

    def ensure_capacity(self, blocks: int) -> None:
        """Make `table[:, :blocks]` a valid (-1 padded) view."""
        self.tables.ensure_width(blocks)

    # ---- growth ------------------------------------------------------------------
    def append(self, positions: torch.Tensor) -> torch.Tensor:
        """Give n new tokens (original `positions`, [n]) a slot in every layer.

        Allocates blocks as needed (raises PoolExhausted, leaving the cache unchanged,
        if the pool cannot supply them) and returns physical slot ids [L, n] to which
        the runner writes the tokens' K and V.
        """
        n, bs, nl = positions.numel(), self.bs, self.num_layers
        if self.ring:  # token by token, as a decode step appends: over the ring at its cap
            return torch.cat([self.tables.append_decode(self.pool, [self.row], [p])[0]
                              for p in positions.tolist()], dim=1)
        if self.uniform:
            nb, nxt = self.nblocks[0], self.next_slot[0]
            k = _blocks_for(nb, nxt, n, bs)
            if k:
                ids = self.pool.allocate(nl * k)
                self.ensure_capacity(nb + k)
                self.table[:, nb : nb + k] = ids.view(nl, k)
                self.nblocks = [nb + k] * nl
            j = torch.arange(nxt, nxt + n)
            slots = self.table[:, j // bs] * bs + j % bs
            self.slot_pos[:, nxt : nxt + n] = positions
            self.tables.fill_state(slice(None), self.row, slice(nxt, nxt + n))
            self.next_slot = [nxt + n] * nl
            self.layer_live = [x + n for x in self.layer_live]
            self._note_peak()
            return slots
        nblocks, next_slot = self.nblocks, self.next_slot
        self._link(nblocks, [_blocks_for(b, s, n, bs) for b, s in zip(nblocks, next_slot)])
        j = torch.tensor(next_slot)[:, None] + torch.arange(n)  # [L, n]
        slots = self.table.gather(1, j // bs) * bs + j % bs
        self.slot_pos.scatter_(1, j, positions.to(torch.int64).expand(nl, n))
        self.tables.fill_state(torch.arange(nl)[:, None], self.row, j)
        self.next_slot = [x + n for x in next_slot]
        self.layer_live = [x + n for x in self.layer_live]
        self._note_peak()
        return slots

    # ---- shrinking -----------------------------------------------------------------
    def evict(self, layer: int, slots: torch.Tensor) -> int:
        """Mark logical slots of one layer dead; free blocks left with no live slot.

        Returns the number of blocks freed. The tail block is kept while it still has
        room for appends, so a request never reallocates the block it is filling.
        """
        mask = torch.zeros_like(self.slot_pos, dtype=torch.bool)
        mask[layer, slots] = True
        return self.evict_mask(mask)

    def evict_mask(self, dead: torch.Tensor) -> int:
        """Mark every live slot where `dead` [L, capacity slots] is True dead, in all
        layers at once (`SlotTables.evict_mask`, which does it for many caches); free
        the blocks left with no live slot. Returns blocks freed."""
        width = max(self.nblocks, default=0) * self.bs
        if width == 0:
            return 0
        return self.tables.evict_mask(self.pool, [self], dead[:, None, :width])[0][1]

    def drop_before(self, min_pos: torch.Tensor) -> int:
        """Evict every slot of each lane whose position is below that lane's `min_pos`
        ([L]: sliding windows, kvpool/windows.py) and free the pages left empty, every
        lane in one pass; returns the blocks freed. The cache stays `intact`: what a
        window drops is no later query's, and the pages it keeps are still a prefix."""
        pos, intact = self.slot_pos, self.intact
        freed = self.evict_mask((pos >= 0) & (pos < min_pos[:, None]))
        self.intact = intact
        return freed

    # ---- what policies see, and what only the pool may do -------------------------
    def live_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical slot indices, physical slot ids) of a layer's live tokens, in order."""
        nb = self.nblocks[layer]
        idx = (self.slot_pos[layer, : nb * self.bs] >= 0).nonzero().squeeze(1)
        return idx, self.table[layer, idx // self.bs] * self.bs + idx % self.bs

    def compact(self, layer: int | None = None) -> int:
        """Pack a layer's live tokens (every layer's, with None), in order, into its
        first blocks and free the rest; returns blocks freed (`compaction.compact`,
        which packs many caches at once)."""
        return compaction.compact(self.tables, self.pool, [self],
                                  None if layer is None else [layer])[0]

    def renumber(self, layer: int, rotate) -> None:
        """Re-number a layer's live positions to 0..n-1 and re-rotate their stored keys
        by the change (RoPE shift, 000_8900623ad98b28fb.txt eq. 4: R(p') k = R(p'-p) R(p) k).

        `rotate(keys [n, Hkv, D], delta [n]) -> keys` is the model's rotary embedding
        applied at a position delta; shared (prefix-cached) blocks must not reach here."""
        idx, _ = self.live_slots(layer)
        old = self.slot_pos[layer, idx]
        new = torch.arange(idx.numel())
        moved = old != new
        if not bool(moved.any()):
            return
        self.alike = False  # one layer at a time
        self._make_writable(layer, (idx[moved] // self.bs).unique())
        _, phys = self.live_slots(layer)
        self.pool.storage.rerotate(phys[moved], rotate, (new - old)[moved])
        self.slot_pos[layer, idx] = new

    def _make_writable(self, layer: int, cols: torch.Tensor) -> None:
        """Copy-on-write: a block shared with another request gets a private copy; a
        block only we hold that the prefix cache publishes is unpublished."""
        pool = self.pool
        for col in cols.tolist():
            b = int(self.table[layer, col])
            if int(pool.ref[b]) > 1:
                new = pool.allocate(1)
                pool.storage.copy_blocks(new, torch.tensor([b]))
                self.table[layer, col] = new[0]
                pool.release(torch.tensor([b]))
            elif b in pool.hash_of:
                pool.forget(pool.hash_of[b])

    def hold(self, blocks: int) -> bool:
        """Link fresh blocks so that every layer holds `blocks` before its tokens need
        them, each layer's taken together (consecutive ids where the free list runs in
        order), for a request whose memory is reserved anyway (a ring's window). Why:
        blocks taken one a step interleave with every other decoding request's, and a
        shuffled pool made the 3m model's decode forward 20-40% slower (commit 2ccd1d6).
        False, with nothing changed, when the pool has not the blocks free. Blocks past
        the appended slots hold no live slot: an eviction pass would free them."""
        nb = self.nblocks
        need = [max(0, blocks - b) for b in nb]
        if sum(need) > self.pool.num_free:
            return False
        if self._link(nb, need):
            self._note_peak()
        return True

    def _link(self, nblocks: list[int], need: list[int]) -> int:
        """Take sum(need) fresh blocks (raises PoolExhausted first if they are not free)
        and append need[l] of them, consecutive, after layer l's `nblocks[l]` held ones;
        returns how many were taken."""
        total = sum(need)
        if total:
            ids = self.pool.allocate(total)
            self.ensure_capacity(max(b + k for b, k in zip(nblocks, need)))
            off = 0
            for layer, k in enumerate(need):
                if k:
                    nb = nblocks[layer]
                    self.table[layer, nb : nb + k] = ids[off : off + k]
                    off += k
            self.nblocks = [b + k for b, k in zip(nblocks, need)]
        return total

    def start_ring(self, sink: int, cap: int) -> bool:
        """From now on a layer at exactly `cap` live tokens writes its next decode token
        over its oldest past the first `sink` (StreamingLLM's fixed-size cache,
        `SlotTables.start_ring`). An overwrite changes a block, so every held block
        becomes this request's own first (shared: copied; published: unpublished); False,
        with nothing changed, when the pool has no block for the copies. The caller keeps
        slots in position order until then and evicts nothing by position after."""
        assert not self.swapped
        pool, table = self.pool, self.table
        held = self._held_mask()
        shared = held & (pool.ref[table.clamp_min(0)] > 1)
        k = int(shared.sum())
        if k:
            if k > pool.num_free:
                return False
            old, new = table[shared], pool.allocate(k)
            pool.storage.copy_blocks(new, old)
            table[shared] = new
            pool.release(old)
        if pool.hash_of:
            for b in table[held].tolist():
                if b in pool.hash_of:
                    pool.forget(pool.hash_of[b])
        self.uniform = self.intact = False
        self.ring = True
        self.tables.start_ring(self.row, sink, cap)
        return True

    def release(self) -> None:
        """Give every block back to the pool (request finished, aborted or preempted);
        a swapped cache must be swapped in or dropped with `discard_swapped` instead."""
        assert not self.swapped, "release() of a swapped cache"
        self.pool.release(self.owned_blocks())
        if self._row is not None:
            self.tables.release_row(self._row)  # -1 filled, sizes and ring 0
            self._row = None
        self.uniform = self.alike = self.intact = True
        self.ring = False

    def discard_swapped(self, swap) -> None:
        """A swapped request was aborted: free its host blocks."""
        swap.release(self._held())
        self.swapped = False
        self.nblocks = [0] * self.num_layers  # nothing of the pool's is held
        self.release()
