"""The slot tables' C++ block bookkeeping (`kvpool/csrc/tables_cpu.cpp`) against its torch
forms (kvpool/tables.py, kvpool/compaction.py): freeing dead blocks, compaction, release,
marking and the eviction mask (a step's ops: tests/test_tables_native_steps.py).

Block freeing (`free_dead` against `SlotTables.free_dead_blocks`): random rows of tables,
positions and per-slot state (a value, k values per slot, k values stored by columns)
with emptied blocks, tail blocks with and without room, some layers only, rows not in
table order; the tables, the state, the caches' sizes and the blocks released must all
be the same."""

from types import SimpleNamespace

import pytest
import torch

from kvpool import tables as tables_mod
from kvpool.compaction import compact
from kvpool.tables import SlotTables


class _Pool:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, ids: torch.Tensor) -> None:
        self.released += sorted(ids.tolist())


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    nl, bs, nrows, width = 3, 4, 6, 8
    t = SlotTables(nl, bs, rows=nrows, width_blocks=width)
    t.declare_state({"score": 0.5, "ring": (0.0, 3), "cols": (-1.0, 5)}, columns=("cols",))
    caches, next_id = [], 0
    for row in [4, 1, 2, 5][: 2 + seed % 3]:
        nb = [int(torch.randint(1, width + 1, (), generator=g)) for _ in range(nl)]
        nxt = [b * bs - int(torch.randint(0, bs, (), generator=g)) for b in nb]
        for layer in range(nl):
            t.table[layer, row, : nb[layer]] = torch.arange(next_id, next_id + nb[layer])
            next_id += nb[layer]
            pos = torch.arange(nxt[layer])
            pos[torch.rand(nxt[layer], generator=g) < 0.6] = -1
            blocks = torch.rand(nb[layer], generator=g) < 0.4  # some blocks emptied whole
            pos = pos.masked_fill(blocks.repeat_interleave(bs)[: nxt[layer]], -1)
            t.slot_pos[layer, row, : nxt[layer]] = pos
        t.sizes[row, 0] = torch.tensor(nb)
        t.sizes[row, 1] = torch.tensor(nxt)
        caches.append(SimpleNamespace(row=row))
    t.state["score"].copy_(torch.rand(t.state["score"].shape, generator=g))
    t.state["ring"].copy_(torch.rand(t.state["ring"].shape, generator=g))
    t.state["cols"].copy_(torch.rand(t.state["cols"].shape, generator=g))  # stored by columns
    return t, caches


@pytest.mark.parametrize("seed", range(8))
def test_native_free_dead_blocks_matches_torch(seed, monkeypatch):
    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    layers = [0, 2] if seed % 4 == 3 else None
    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        t, caches = _setup(seed)
        pool = _Pool()
        freed = t.free_dead_blocks(pool, caches, layers)
        runs.append((t, t.sizes.clone(), pool.released, freed))
    (a, ca, ra, fa), (b, cb, rb, fb) = runs
    assert fa == fb and torch.equal(ca, cb) and ra == rb
    assert sum(fa) > 0
    assert torch.equal(a.table, b.table) and torch.equal(a.slot_pos, b.slot_pos)
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), name
    assert a.state["cols"].stride(2) == 1  # still stored by columns


def test_state_by_columns_reads_like_by_slots_and_survives_growth():
    t = SlotTables(2, 4, rows=2, width_blocks=2)
    t.declare_state({"a": (0.0, 3), "b": (0.0, 3)}, columns=("b",))
    for name in ("a", "b"):
        t.state[name][1, 1, 5] = torch.tensor([1.0, 2.0, 3.0])
    t.fill_state(torch.arange(2)[:, None], 1, torch.tensor([[6], [6]]))
    t.ensure_width(5)
    t.acquire_row(), t.acquire_row(), t.acquire_row()
    assert t.state["b"].stride(2) == 1 and t.state["a"].stride(3) == 1
    assert torch.equal(t.state["a"], t.state["b"])
    assert t.state["b"][1, 1, 5].tolist() == [1.0, 2.0, 3.0]


def _filled(pool, t: SlotTables, g: torch.Generator, lengths: list[int]) -> list:
    """Caches of 3 layers holding `lengths` tokens in `t`, every state random."""
    from kvpool.seq_cache import SeqCache

    caches = []
    for n in lengths:
        c = SeqCache(pool, 3, tables=t)
        c.append(torch.arange(n))
        caches.append(c)
    for name in t.state:
        t.state[name].copy_(torch.rand(t.state[name].shape, generator=g))
    return caches


def _pool_case(seed: int, shared: bool = False):
    """Three caches of a real pool with scattered drops (their K/V random), as
    compaction finds them; `shared`: one destination block held twice."""
    from tests.pools import make_pool

    g = torch.Generator().manual_seed(seed)
    pool = make_pool(300, 4, 2, 8, dtype=[torch.float32, torch.bfloat16, "int8"][seed % 3])
    pool.storage.kv.view(torch.uint8).copy_(torch.randint(0, 256, pool.storage.kv.view(torch.uint8).shape,
                                                  generator=g, dtype=torch.uint8))
    if pool.storage.scales is not None:  # a quantized pool: the scales move with their slots
        pool.storage.scales.copy_(torch.rand(pool.storage.scales.shape, generator=g).half())
    # blocks handed out in no order: a row's neighbouring blocks are apart in the pool,
    # so a move that ran past a block's end would land in the wrong block
    pool._free = [pool._free[i] for i in torch.randperm(len(pool._free), generator=g).tolist()]
    t = SlotTables(3, 4)
    t.declare_state({"score": 0.5, "ring": (0.0, 3), "cols": (-1.0, 5)}, columns=("cols",))
    caches = _filled(pool, t, g, [20 + 9 * i for i in range(3)])
    for c in caches:
        width = max(c.nblocks) * 4
        dead = torch.rand((3, 1, width), generator=g) < 0.3
        if seed % 2 == 0:
            dead[:, :, :8] = False  # the first blocks untouched: moves start later
        t.evict_mask(pool, [c], dead)
    if shared:
        pool.ref[caches[1].table[0, 0]] += 1
    return pool, t, caches


@pytest.mark.parametrize("seed", range(6))
def test_native_compaction_matches_torch(seed, monkeypatch):
    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    layers = [0, 2] if seed % 4 == 3 else None
    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        pool, t, caches = _pool_case(seed)
        free_before = pool.num_free
        freed = compact(t, pool, caches, layers)
        runs.append((pool, t, [(c.nblocks, c.next_slot, c.alike, c.layer_live) for c in caches],
                     freed, pool.num_free - free_before))
    (pa, a, ca, fa, na), (pb, b, cb, fb, nb) = runs
    assert fa == fb and ca == cb and na == nb and sum(fa) > 0
    assert torch.equal(a.table, b.table) and torch.equal(a.slot_pos, b.slot_pos)
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), name
    assert torch.equal(pa.storage.kv.view(torch.uint8), pb.storage.kv.view(torch.uint8))  # every slot's K/V
    if pa.storage.scales is not None:
        assert torch.equal(pa.storage.scales, pb.storage.scales)
    assert torch.equal(pa.ref, pb.ref)


def test_native_compaction_declines_a_shared_destination(monkeypatch):
    """A destination block another request holds: the C++ pass changes nothing and the
    torch form copies the block first (copy-on-write), as without the C++ pass."""
    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        pool, t, caches = _pool_case(1, shared=True)
        runs.append((pool, t, compact(t, pool, caches)))
    (pa, a, fa), (pb, b, fb) = runs
    assert fa == fb
    assert torch.equal(a.table, b.table) and torch.equal(a.slot_pos, b.slot_pos)
    assert torch.equal(pa.storage.kv.view(torch.uint8), pb.storage.kv.view(torch.uint8))


@pytest.mark.parametrize("seed", range(4))
def test_native_release_matches_torch(seed, monkeypatch):
    """BlockPool.release's C++ reference counting (csrc/tables_cpu.cpp::release_refs):
    the same counts and the same free list as the torch form, ids repeated included."""
    from kvpool import pool as pool_mod
    from tests.pools import make_pool

    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(seed)
    refs = torch.randint(1, 4, (64,), generator=g, dtype=torch.int32)
    ids = torch.randint(0, 64, (40,), generator=g)
    pools = []
    for native in (True, False):
        monkeypatch.setattr(pool_mod, "load_mark", lambda n=native: n)
        p = make_pool(64, 4, 1, 8)
        p.ref.copy_(refs)
        p._free.clear()
        p.release(ids)
        p.release(ids[:7])
        pools.append(p)
    assert torch.equal(pools[0].ref, pools[1].ref)
    assert pools[0]._free == pools[1]._free and pools[0]._free


@pytest.mark.parametrize("seed", range(6))
def test_native_marking_matches_torch(seed):
    """`mark_dead` (csrc/tables_cpu.cpp) against `SlotTables._mark_dead`: blocks of 16 (its
    word-wise flag scan reads 8 at a time), rows whose layers hold the same slots
    (`alike`) and lose the same ones or not, flags on dead slots, a row with no flag; the
    same positions, counts and live sizes after."""
    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(seed)
    nl, bs, nrows, width = 3, 16, 6, 5
    t = SlotTables(nl, bs, rows=nrows, width_blocks=width)
    rows = torch.tensor([4, 1, 2, 5, 0][: 3 + seed % 3], dtype=torch.int64)
    r, w = rows.numel(), width * bs
    alike = torch.rand(r, generator=g) < 0.6
    for i, row in enumerate(rows.tolist()):
        pos = torch.arange(w)
        pos[torch.rand(w, generator=g) < 0.3] = -1
        for layer in range(nl):
            p = pos.clone()
            if not alike[i]:
                p[torch.rand(w, generator=g) < 0.2] = -1
            t.slot_pos[layer, row, :w] = p
    dead = torch.rand(nl, r, w, generator=g) < 0.02
    for i in range(r):
        if alike[i] and i % 2 == 0:  # every layer drops the same slots
            dead[:, i] = dead[0, i]
    dead[:, r - 1] = False  # a row that drops nothing
    t.sizes[:, 2] = 1000  # live counts: both forms take the dead slots off them
    sp, sizes = t.slot_pos.clone(), t.sizes.clone()
    cnt, emptied, same = torch.ops.kvserve_tables.mark_dead(t.slot_pos, t.sizes, rows, dead, alike, bs)
    native, native_sizes = t.slot_pos.clone(), t.sizes.clone()
    t.slot_pos.copy_(sp)
    t.sizes.copy_(sizes)
    counts, emptied_t, same_t = t._mark_dead(rows, dead, alike)
    assert torch.equal(native, t.slot_pos) and torch.equal(native_sizes, t.sizes)
    assert native_sizes[rows, 2].t().tolist() != sizes[rows, 2].t().tolist()  # some died
    assert cnt.t().tolist() == counts
    assert torch.equal(emptied, emptied_t)
    assert same.tolist() == same_t


@pytest.mark.parametrize("seed", range(6))
def test_native_evict_mask_matches_torch(seed, monkeypatch):
    """`evict_mask`'s one C++ call (`evict_rows`: marking, then freeing in the rows a
    block emptied in) against its torch form (`_mark_dead`, then `free_dead_blocks`): the
    same counts and freed blocks per cache, tables, positions, sizes, states, released
    ids and alike/uniform flags; caches that drop nothing, drop the same slots in every
    layer, or empty whole blocks."""
    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    from tests.pools import make_pool

    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        g = torch.Generator().manual_seed(seed)
        pool = make_pool(200, 4, 2, 8)
        t = SlotTables(3, 4)
        t.declare_state({"score": 0.5, "cols": (-1.0, 3)}, columns=("cols",))
        caches = _filled(pool, t, g, [21 + 7 * i for i in range(4)])
        width = max(max(c.nblocks) for c in caches) * 4
        dead = torch.rand(3, 4, width, generator=g) < 0.25
        dead[:, 1] = dead[0, 1]  # every layer drops the same slots
        dead[:, 2] = False  # one drops nothing
        dead[seed % 3, 3, 4:8] = True  # a whole block of one layer
        released: list[int] = []
        release = pool.release
        monkeypatch.setattr(pool, "release", lambda ids, out=released, free=release: (
            out.extend(ids.tolist()), free(ids)))
        done = t.evict_mask(pool, caches, dead)
        runs.append((done, released, t, [(c.alike, c.uniform, c.nblocks, c.next_slot, c.layer_live)
                                         for c in caches], pool.num_free))
    (da, ra, a, ca, fa), (db, rb, b, cb, fb) = runs
    assert da == db and ra == rb and ca == cb and fa == fb
    assert any(f for _, f, _ in da) and da[2] == (0, 0, [0, 0, 0])
    for died, _, by_layer in da:  # the per-layer counts add up
        assert died == sum(by_layer)
    assert torch.equal(a.table, b.table) and torch.equal(a.slot_pos, b.slot_pos)
    assert torch.equal(a.sizes, b.sizes)
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), name
