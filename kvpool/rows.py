"""Reading and writing rows of the slot tables' shared `[L, R, ...]` tensors (a group's
rows as one slice when they are consecutive, else one gather), the sizes' field
indices, and `CacheRow`, what the tables' passes see of a row's owner."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpool.pool import load_mark
from native.host import bool_tensor, int64_tensor

NBLOCKS, NEXT, LIVE = 0, 1, 2  # sizes[row, field, layer]
SINK, CAP, OVER = 0, 1, 2  # ring[row, field]; the layers' cursors follow


class CacheRow(Protocol):
    """What the tables' passes and compaction read and set of a row's owner (a
    `kvpool.seq_cache.SeqCache`, which sits above them and is named only here)."""

    row: int
    alike: bool
    uniform: bool
    intact: bool
    nblocks: list[int]
    next_slot: list[int]


def consecutive(rows: list[int]) -> bool:
    """Rows a, a+1, ...: then dim 1 is read with `narrow` (a view), not a gather. Use
    narrow, not [a:b]: indexing skips a whole-range slice and narrow never does, which
    keeps a step's op count fixed (test_step_ops)."""
    return rows == list(range(rows[0], rows[0] + len(rows)))


def take_rows(t: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
    """t[:, rows, :width] ([L, R, width, ...]) as a contiguous tensor. Rows are handed
    out in order, so a batch's rows are usually consecutive: then it is a slice copy,
    about 3x cheaper than a gather, which is the fallback (`_gather`).
    When that slice is contiguous already (every row of t, its whole width) it is t's
    own memory, not a copy: a caller that writes into the result writes into t."""
    if consecutive(rows):
        return t.narrow(1, rows[0], len(rows)).narrow(2, 0, width).contiguous()
    return _gather(t, rows, width).contiguous()


def rows_slice(t: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
    """t[:, rows, :width] as a view of t when the rows are consecutive (updates made
    through it land in t: no copy either way), else as a copy in t's own layout
    (`_gather`), which the caller puts back with `put_rows`. For state a step updates in
    a few places per slot (pyramid's window ring: one value of 32), where copying every
    value out and back costs more than the update."""
    if consecutive(rows):
        return t.narrow(1, rows[0], len(rows)).narrow(2, 0, width)
    return _gather(t, rows, width)


def put_rows(t: torch.Tensor, rows: list[int], value: torch.Tensor) -> None:
    """t[:, rows, :W] = value ([L, R, W, ...]): `take_rows`' way back."""
    w = value.shape[2]
    if consecutive(rows):
        t.narrow(1, rows[0], len(rows)).narrow(2, 0, w).copy_(value)
    elif _native_rows(t) and value.is_contiguous() and value.dtype == t.dtype:
        torch.ops.kvserve_tables.put_rows_from(t, rows, value)
    elif by_columns(t):  # run by run, in storage order (see `_gather`)
        at = 0
        for first, n in _runs(rows):
            t.narrow(1, first, n).narrow(2, 0, w).copy_(value.narrow(1, at, n))
            at += n
    else:
        t.narrow(2, 0, w).index_copy_(1, int64_tensor(rows), value)


def _gather(t: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
    """t[:, rows, :width] for rows that are not consecutive, a copy in t's layout.

    The rows are selected from t's whole memory and then narrowed: `index_select` over a
    tensor narrowed first took a slow strided path (0.30 against 0.02 ms for two rows of
    the positions at 64 table rows). A state stored by columns (`by_columns`, pyramid's
    ring) is copied run of consecutive rows by run, in its storage order: any gather over
    its transposed layout copied through a slow path (46 ms for two rows of a 32-column
    ring at 64 table rows, every decode step of a pyramid request whose rows were not
    consecutive), the runs 0.08 ms. The tables' own rows (positions, block ids, a state
    by slots) on CPU: one C++ copy of each row's first `width` columns (`take_rows_into`;
    `put_rows_from` the way back), where the gather copied every column the tables have
    grown to: 29 against 92 us for 27 of 64 rows of a per-head 3m pool's positions, a
    decode step's view whenever a finished request left its row empty."""
    if _native_rows(t):
        out = torch.empty(t.shape[0], len(rows), width, dtype=t.dtype)
        torch.ops.kvserve_tables.take_rows_into(t, rows, out)
        return out
    if by_columns(t):
        s = t.transpose(2, 3)  # [L, R, k, S]: its memory, contiguous
        return torch.cat([s.narrow(1, first, n).narrow(3, 0, width) for first, n in _runs(rows)],
                         dim=1).transpose(2, 3)
    return t.index_select(1, int64_tensor(rows)).narrow(2, 0, width)


def _native_rows(t: torch.Tensor) -> bool:
    """The tables' C++ row copies take `t`: [L, R, S] int64 or float32 in storage order
    on CPU (a state stored by columns is not: `by_columns`)."""
    return (t.device.type == "cpu" and t.dtype in (torch.int64, torch.float32) and t.dim() == 3
            and t.is_contiguous() and load_mark())


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """(first row, count) of each run of consecutive rows, in order."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def over_state(idx: torch.Tensor, extra: tuple[int, ...], expand: bool = True) -> torch.Tensor:
    """An index (or mask) over slots, extended to a state's trailing dims."""
    for _ in extra:
        idx = idx[..., None]
    return idx.expand(*idx.shape[: idx.dim() - len(extra)], *extra) if expand and extra else idx


_ALL_LAYERS: dict[int, torch.Tensor] = {}  # read only: made once per layer count


def layer_mask(num_layers: int, layers: list[int] | None) -> torch.Tensor:
    """[L] bool: the layers a pass works on (None: all, one shared tensor)."""
    if layers is None:
        if num_layers not in _ALL_LAYERS:
            _ALL_LAYERS[num_layers] = torch.ones(num_layers, dtype=torch.bool)
        return _ALL_LAYERS[num_layers]
    chosen = set(layers)
    return bool_tensor([layer in chosen for layer in range(num_layers)])  # one op, not three


def by_columns(t: torch.Tensor) -> bool:
    """A state stored by columns (`_new_state`)."""
    return t.dim() == 4 and t.shape[3] > 1 and t.stride(2) == 1
