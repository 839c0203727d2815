"""Every running request's block tables and slot positions, in two shared tensors.

Why: a decode step used to read each request's own small tensors (its table, its slot
positions) and write each request's new token into them one op at a time, so the
number of torch ops in a step grew with the batch — the host cost that dominates a
step on a GPU (shared/gpu/README.md: ~490 launches at 64 requests). Here every cache
is a *row* of

    table[L, R, W]          block id of logical block j of (layer, row), -1 = none
    slot_pos[L, R, W * bs]  original position of logical slot s, -1 = empty / evicted

so a step reads the rows it runs with one `index_select` each, and `append_decode`
gives every decoding request its next slot with a fixed number of ops whatever the
batch.

Positions are per (row, layer, logical slot), not per physical slot: a block shared
through the prefix cache is one block in several rows, and a policy's eviction inside it
must change only its own request's view (eviction is a mark, not a copy). A
`[num_blocks, block_size]` position per physical slot would make it everyone's.

Rows and width grow by doubling (a copy, rare), so memory follows the concurrency and
context actually seen rather than `max_num_seqs × max_model_len`.

Each row's sizes live here too, as one host array both Python and the C++ passes read:

    sizes[R, 3, L]          per layer: blocks held (NBLOCKS), slots appended, live or
                            dead (NEXT), live slots (LIVE)

so a decode append is one C++ pass over the step's rows that reads and bumps them in
place (issue 18: lengths updated in place, no per-request Python), while Python reads
one size through `sz`, a flat memoryview of the same memory (~40 ns an int, a list's
speed; a tensor element would be ~1 µs). `SeqCache` is a view of its row.

A row may also have a ring (`start_ring`), StreamingLLM's fixed-size cache:

    ring[R, 3 + L]          sinks (SINK), cap (CAP, 0 = no ring), overwritten slots not
                            yet counted (OVER), then per layer the logical slot the next
                            overwrite takes

Once a layer holds exactly `cap` slots, every one live, its next decode token goes over
its oldest token past the sinks (evict before write, 001_01037b507c6df960.txt App. A.1:
the cache holds sink + window tokens *including* the new one) instead of into a new
slot, so a request at its window holds exactly ceil(cap / bs) blocks a layer, never a
block more for the step's token and a partly dead block at the window's old edge. The
kept set after each step is the one the policy's own eviction would leave.

Beside the positions, a policy's per-token state lives here too (`state`: named
`[L, R, W * bs]` float32 tensors, created when a policy first declares one): H2O's
cumulative attention, LazyEviction's activation times. State is per logical slot for
the same reason as positions, it is set to the name's fill when a slot is appended, and
it moves with its token when blocks are freed or compacted, so a policy reads and
writes it for a whole batch as [rows, slots] tensors and never re-aligns it by position.
"""

from __future__ import annotations

import torch

from kvpool.pool import BlockPool, load_mark
from kvpool.rows import (
    CAP,
    LIVE,
    NBLOCKS,
    NEXT,
    OVER,
    SINK,
    by_columns,
    consecutive,
    rows_slice,
)
from kvpool.table_eviction import EvictionPasses
from native.host import bool_tensor, int64_tensor

__all__ = ["SlotTables", "load_mark"]


def _new_state(slots: torch.Size, k: int, fill: float, columns: bool) -> torch.Tensor:
    """A state tensor [L, R, S(, k)] float32 full of `fill`. `columns`: stored as
    [L, R, k, S] and returned transposed, so that each of the k values of every slot of a
    row is one contiguous run: a step that reads and writes one of the k (pyramid's ring
    column) touches 4 bytes per slot instead of a cache line."""
    if not k:
        return torch.full(slots, fill, dtype=torch.float32)
    if columns:
        return torch.full((*slots[:2], k, slots[2]), fill, dtype=torch.float32).transpose(2, 3)
    return torch.full((*slots, k), fill, dtype=torch.float32)




def _int_view(t: torch.Tensor) -> memoryview:
    """A flat int64 memoryview of a contiguous CPU tensor's memory (reads and writes
    land in the tensor)."""
    return memoryview(t.numpy()).cast("B").cast("q")


_NO_COLUMNS = torch.zeros(0, dtype=torch.bool)  # read only: no states to pass a C++ pass
class SlotTables(EvictionPasses):
    @staticmethod
    def native() -> bool:
        """Whether the tables' C++ passes serve (this module's `load_mark`, the one switch
        for every pass, the eviction mixin's included)."""
        return load_mark()

    def __init__(self, num_layers: int, block_size: int, rows: int = 4,
                 width_blocks: int = 4, heads: int = 1) -> None:
        """`num_layers`: the lanes a row has, one a layer, or one a (layer, kv head) in a
        per-head pool: `heads` lanes a layer, lane l·heads + h (what the policies read
        as `RowsView.heads`; nothing else here tells lanes from layers)."""
        self.num_layers = num_layers
        self.heads = heads
        # The served model's head roles per lane (`RowsView.head_roles`), set by the
        # manager over a per-head pool when the model has a roles file.
        self.head_roles: torch.Tensor | None = None
        # [lanes] bool, the sliding-window lanes (set by the manager; None: none), which
        # a kv_policy leaves to their window (`policy_rows.run_group`).
        self.windowed: torch.Tensor | None = None
        self.bs = block_size
        self.table = torch.full((num_layers, max(1, rows), max(1, width_blocks)), -1,
                                dtype=torch.int64)
        self.slot_pos = torch.full((num_layers, max(1, rows), max(1, width_blocks) * block_size),
                                   -1, dtype=torch.int64)
        self._free_rows = list(range(self.table.shape[1] - 1, -1, -1))
        self.sizes = torch.zeros((self.table.shape[1], 3, num_layers), dtype=torch.int64)
        self.sz = _int_view(self.sizes)  # rebound when the rows grow: never keep it
        # Per row, the most blocks (all layers) and live tokens (summed over layers //
        # layers) it has held right after an append: a request's reported peak, kept
        # where the sizes change instead of read from every request every step.
        self.peaks = torch.zeros((self.table.shape[1], 2), dtype=torch.int64)
        self.pk = _int_view(self.peaks)
        self.ring = torch.zeros((self.table.shape[1], 3 + num_layers), dtype=torch.int64)
        self.rg = _int_view(self.ring)  # rebound when the rows grow: never keep it
        self.state: dict[str, torch.Tensor] = {}  # name -> [L, R, W * bs(, k)] float32
        self.fills: dict[str, float] = {}  # name -> a new slot's value
        # `native_states`' answer, kept until a state is added or the tensors grow
        self._native: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def declare_state(self, fills: dict[str, float | tuple[float, int]],
                      columns: tuple[str, ...] | frozenset[str] = ()) -> None:
        """Keep per-slot state `name` from now on: a new slot starts at its fill; a
        (fill, k) pair keeps k values per slot ([L, R, S, k], e.g. a window of queries).
        A name in `columns` stores its k values column by column (each [S] contiguous,
        `_new_state`); it reads the same as [L, R, S, k] everywhere."""
        for name, spec in fills.items():
            fill, k = spec if isinstance(spec, tuple) else (spec, 0)
            if name not in self.state:
                self.state[name] = _new_state(self.slot_pos.shape, k, fill, name in columns)
                self.fills[name] = fill
                self._native = None
            t = self.state[name]
            assert (t.dim() == 4 and t.shape[3] == k) or (t.dim() == 3 and not k), \
                f"slot state {name!r} declared with two shapes"

    def fill_state(self, layers: object, rows: object, cols: object) -> None:
        """Set the state of newly appended slots (any index expression into [L, R, S])
        to each name's fill: one op per name, whatever the number of slots."""
        for name, t in self.state.items():
            t[layers, rows, cols] = self.fills[name]

    @property
    def width(self) -> int:
        """Blocks a row can hold per layer before the tensors grow."""
        return self.table.shape[2]

    # ---- rows ------------------------------------------------------------------------
    def acquire_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[1]
            self._grow(rows=2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self.table[:, row].fill_(-1)
        self.slot_pos[:, row].fill_(-1)
        self.sizes[row] = 0
        self.peaks[row] = 0
        self.ring[row] = 0
        self._free_rows.append(row)

    def ensure_width(self, blocks: int) -> None:
        if blocks > self.width:
            self._grow(width=max(blocks, 2 * self.width))

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        nl, r, w = self.table.shape
        rows, width = rows or r, width or w
        table = torch.full((nl, rows, width), -1, dtype=torch.int64)
        table[:, :r, :w] = self.table
        pos = torch.full((nl, rows, width * self.bs), -1, dtype=torch.int64)
        pos[:, :r, : w * self.bs] = self.slot_pos
        self.table, self.slot_pos = table, pos
        if rows != r:
            sizes = torch.zeros((rows, 3, nl), dtype=torch.int64)
            sizes[:r] = self.sizes
            self.sizes, self.sz = sizes, _int_view(sizes)
            peaks = torch.zeros((rows, 2), dtype=torch.int64)
            peaks[:r] = self.peaks
            self.peaks, self.pk = peaks, _int_view(peaks)
            ring = torch.zeros((rows, 3 + nl), dtype=torch.int64)
            ring[:r] = self.ring
            self.ring, self.rg = ring, _int_view(ring)
        for name, old in self.state.items():
            k = old.shape[3] if old.dim() == 4 else 0
            new = _new_state(pos.shape, k, self.fills[name], by_columns(old))
            new[:, :r, : w * self.bs] = old
            self.state[name] = new
        self._native = None

    # ---- rings ------------------------------------------------------------------------
    def start_ring(self, row: int, sink: int, cap: int) -> None:
        """From now on, a layer of `row` holding exactly `cap` live slots and no dead one
        takes its next decode token over its oldest token past the first `sink` slots
        (the module's docstring). The caller guarantees that the row's slots then hold
        its tokens in position order (every append and compaction keeps that order) and
        that no block of the row is shared or published (an overwrite changes it)."""
        assert 0 <= sink < cap, "a ring needs a slot past the sinks"
        o = row * (3 + self.num_layers)
        rg = self.rg
        rg[o + SINK], rg[o + CAP], rg[o + OVER] = sink, cap, 0
        for layer in range(self.num_layers):
            rg[o + 3 + layer] = sink

    def take_overwritten(self, row: int) -> int:
        """Tokens (slots over layers, whole layers only) the row's ring overwrote since the
        last call: its policy's evictions, counted where they happen."""
        o = row * (3 + self.num_layers) + OVER
        tokens = self.rg[o] // self.num_layers
        self.rg[o] -= tokens * self.num_layers
        return tokens

    def _ring_writes(self, sizes: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """[L, B] whether each row's layer writes its next decode token over its ring
        (csrc/tables_cpu.cpp's `ring_writes`), for rows' sizes [B, 3, L] and rings
        [B, 3 + L]."""
        cap = ring[:, CAP, None]
        return ((cap > 0) & (sizes[:, NEXT] == cap) & (sizes[:, LIVE] == cap)).t()

    # ---- what a step reads -----------------------------------------------------------
    def rows_of(self, rows: list[int], nb: int, whole: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tables [L, B, nb], slot positions [L, B, nb * bs], None) of caches' `rows`,
        for the step's attention to read: views of the tables when the rows are
        consecutive (the C++ decode kernel reads rows at their stride, and copying 64
        rows' positions was ~0.2 ms of a 3m model's 8 ms step), else one gather each,
        whatever B. `whole` (a reader that takes a row index: the C++ decode kernel):
        rows that are not consecutive come as every row's views ([L, R, ...]) and the
        rows' indices [B], and nothing is copied; they stop being consecutive as soon as
        a request finishes. Columns past a row's blocks are -1, so rows of different
        lengths pad correctly. Read only: nothing changes the tables while the forward
        runs."""
        self.ensure_width(nb)
        s = nb * self.bs
        # Over a per-head pool every row, always: the kernels' per-head view of the lanes
        # ([L, H·R, ...], engine/attention_groups.by_head) is then a view, not a copy of
        # the rows' positions each step, and the kernel can add into the lanes' state.
        if whole and (self.heads > 1 or not consecutive(rows)):
            return (self.table.narrow(2, 0, nb), self.slot_pos.narrow(2, 0, s),
                    int64_tensor(rows))
        return rows_slice(self.table, rows, nb), rows_slice(self.slot_pos, rows, s), None

    def rows_into(self, rows: list[int], nb: int, table: torch.Tensor,
                  slot_pos: torch.Tensor) -> None:
        """`rows_of`'s tables and positions written into `table` [L, B, nb] and
        `slot_pos` [L, B, nb * bs] (contiguous, int32 or int64: a CUDA graph step's
        pinned staging buffer), nb columns a row. Consecutive rows are copied from views
        (torch's copy, threaded); rows apart by one C++ pass each on CPU, nb columns a
        row where `rows_slice` gathers every column the tables have grown to (64 rows,
        32 of them apart, of the 160M model's 12 layers: 0.034 against 0.162 ms)."""
        self.ensure_width(nb)
        if not consecutive(rows) and self.table.device.type == "cpu" and load_mark():
            torch.ops.kvserve_tables.take_rows_into(self.table, rows, table)
            torch.ops.kvserve_tables.take_rows_into(self.slot_pos, rows, slot_pos)
            return
        table.copy_(rows_slice(self.table, rows, nb))
        slot_pos.copy_(rows_slice(self.slot_pos, rows, nb * self.bs))

    def decode_need(self, rows: list[int]) -> tuple[int, int]:
        """(blocks a decode append of these rows takes, the most blocks a row then holds
        in a layer): a layer whose last block is full takes one. One C++ pass on CPU."""
        if not rows:
            return 0, 0
        if self.table.device.type == "cpu" and load_mark():
            return torch.ops.kvserve_tables.decode_need(self.sizes, self.ring, rows, self.bs)
        take = self._takes_block(int64_tensor(rows))
        return int(take.sum()), int((self.sizes[rows, NBLOCKS] + take).max())

    def _takes_block(self, row_t: torch.Tensor) -> torch.Tensor:
        """[B, L] whether a decode append takes a block for each row's layer: its last
        block is full and its token does not go over its ring (the torch form)."""
        sizes = self.sizes.index_select(0, row_t)
        ring = self.ring.index_select(0, row_t)
        full = sizes[:, NEXT] >= sizes[:, NBLOCKS] * self.bs
        return full & ~self._ring_writes(sizes, ring).t()

    def held_and_need(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """Per row: (blocks held over all layers, blocks a decode append would take: a
        layer whose last block is full takes one), `SeqCache.num_blocks` and
        `blocks_needed(1)` of many rows at once. One C++ call on CPU."""
        if self.table.device.type == "cpu" and load_mark():
            both = torch.ops.kvserve_tables.held_and_need(self.sizes, self.ring, rows, self.bs)
            return both[0::2], both[1::2]
        row_t = int64_tensor(rows)
        return (self.sizes[row_t, NBLOCKS].sum(dim=1).tolist(),
                self._takes_block(row_t).sum(dim=1).tolist())

    def append_decode(self, pool: BlockPool, rows: list[int],
                      positions: list[int]) -> tuple[torch.Tensor, int]:
        """Give each row's next token (original position `positions[i]`) a slot in
        every layer; returns the physical slots [L, B] to write K/V to and the most
        blocks a row then holds in a layer (the width the step's attention reads). The
        caller has checked that the pool holds the blocks this takes (`decode_need`).

        On CPU the whole append is one C++ pass over the rows
        (csrc/tables_cpu.cpp::append_rows): it reads each row's sizes, counts and links
        a new block where a layer's last one is full (from the ids the pool would hand
        out next: `BlockPool.peek`), writes the positions and state fills, and bumps the
        sizes in place; Python only lists the rows. One call a step, where a count and
        then the append were two, each paying for cold code and data right after the
        forward. Where the tables are too narrow, or the free list is short of what it
        needs (parked prefix blocks to recycle), it changes nothing and says what it
        needs: the tables widen, the pool takes exactly that, and it runs again.
        Elsewhere the same as torch ops over the sizes: an allocation, a table write, a
        position write and a gather."""
        nl, bs = self.num_layers, self.bs
        if self.table.device.type == "cpu" and load_mark():
            slots, need, widest = self._append_rows(pool, rows, positions, pool.peek(nl * len(rows)))
            if slots.numel():
                pool.take(need)  # the ids it linked: the first `need` of those it was shown
                return slots, widest
            self.ensure_width(widest)
            slots, _, widest = self._append_rows(pool, rows, positions, pool.take(need))
            assert slots.numel(), "the decode append refused wide enough tables and its ids"
            return slots, widest
        need, widest = self.decode_need(rows)
        self.ensure_width(widest)
        row_t = int64_tensor(rows)
        sizes = self.sizes.index_select(0, row_t)  # [B, 3, L]
        ring = self.ring.index_select(0, row_t)  # [B, 3 + L]
        nb, nxt = sizes[:, NBLOCKS].t(), sizes[:, NEXT].t()  # [L, B]
        over = self._ring_writes(sizes, ring)  # [L, B]
        at = ring[:, 3:].t()
        full = (nxt >= nb * bs) & ~over
        slot = torch.where(over, at, nxt)
        lay = torch.arange(nl)[:, None]
        if need:  # new blocks in (cache, layer) order, as the C++ pass takes them
            ids = pool.allocate(need)
            ci, li = full.t().nonzero().unbind(1)  # (cache, layer) pairs
            self.table[li, row_t[ci], nb[li, ci]] = ids
        self.slot_pos[lay, row_t, slot] = int64_tensor(positions)
        self.fill_state(lay, row_t, slot)
        slots = self.table[lay, row_t, slot // bs] * bs + slot % bs
        sizes[:, NBLOCKS] += full.t()
        sizes[:, NEXT:] += (~over).t()[:, None]
        self.sizes.index_copy_(0, row_t, sizes)
        sink, cap = ring[:, SINK], ring[:, CAP]
        moved = torch.where(at + 1 >= cap, sink, at + 1)
        ring[:, 3:] = torch.where(over, moved, at).t()
        ring[:, OVER] += over.sum(dim=0)
        self.ring.index_copy_(0, row_t, ring)
        now = torch.stack([sizes[:, NBLOCKS].sum(1), sizes[:, LIVE].sum(1) // nl], dim=1)
        self.peaks.index_copy_(0, row_t, torch.maximum(self.peaks.index_select(0, row_t), now))
        return slots, widest

    def _append_rows(self, pool: BlockPool, rows: list[int], positions: list[int],
                     ids: list[int]) -> tuple[torch.Tensor, int, int]:
        states, columns = self.native_states()
        return torch.ops.kvserve_tables.append_rows(
            self.table, self.slot_pos, self.sizes, self.peaks, self.ring, states, columns,
            list(self.fills.values()), pool.ref, rows + positions + ids, len(rows), self.bs)

    # ---- what eviction changes -------------------------------------------------------
    def native_states(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The states as the C++ ops take them (storage order) and which are by columns;
        made once per set of tensors (every plan and decode append asks: ~5 us a call)."""
        if self._native is None:
            cols = [by_columns(t) for t in self.state.values()]
            self._native = ([t.transpose(2, 3) if c else t for t, c in zip(self.state.values(), cols)],
                            bool_tensor(cols) if cols else _NO_COLUMNS)
        return self._native
