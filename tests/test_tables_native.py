"""The slot tables' C++ block freeing (`kvpool/csrc/tables_cpu.cpp::free_dead`) against
its torch form (`SlotTables.free_dead_blocks`): random rows of tables, positions and
per-slot state (a value, k values per slot, k values stored by columns) with emptied blocks, tail blocks with
and without room, some layers only, rows not in table order; the tables, the state,
the caches' sizes and the blocks released must all be the same."""

from types import SimpleNamespace

import pytest
import torch

from kvpool import rows as rows_mod
from kvpool import table_eviction as eviction_mod
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
        monkeypatch.setattr(eviction_mod, "load_mark", lambda n=native: n)
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
        monkeypatch.setattr(eviction_mod, "load_mark", lambda n=native: n)
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
    if pa.scales is not None:
        assert torch.equal(pa.scales, pb.scales)
    assert torch.equal(pa.ref, pb.ref)


def test_native_compaction_declines_a_shared_destination(monkeypatch):
    """A destination block another request holds: the C++ pass changes nothing and the
    torch form copies the block first (copy-on-write), as without the C++ pass."""
    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        monkeypatch.setattr(eviction_mod, "load_mark", lambda n=native: n)
        pool, t, caches = _pool_case(1, shared=True)
        runs.append((pool, t, compact(t, pool, caches)))
    (pa, a, fa), (pb, b, fb) = runs
    assert fa == fb
    assert torch.equal(a.table, b.table) and torch.equal(a.slot_pos, b.slot_pos)
    assert torch.equal(pa.storage.kv.view(torch.uint8), pb.storage.kv.view(torch.uint8))


@pytest.mark.parametrize("seed", range(6))
def test_native_decode_append_matches_torch(seed, monkeypatch):
    """SlotTables.append_decode's C++ pass (csrc/tables_cpu.cpp::append_rows) against its
    torch form over nine steps: caches whose layers hold different block counts after
    eviction (uneven) beside one that never evicted (aligned), block boundaries crossed
    in some layers and not others, three kinds of per-slot state, and two ring caches
    (`SeqCache.start_ring`): one at its cap from the first step (a cap that ends inside
    a block, the cursor wrapping), one that reaches it mid-way. The slots returned,
    the tables, positions, states, reference counts, free list, sizes and rings all
    agree, and both forms of `decode_need` (and `held_and_need`, row by row) count what
    the caches' `blocks_needed(1)` count."""
    from kvpool.seq_cache import SeqCache

    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        monkeypatch.setattr(eviction_mod, "load_mark", lambda n=native: n)
        pool, t, caches = _pool_case(seed)
        dead = torch.zeros((3, 1, max(caches[1].nblocks) * 4), dtype=torch.bool)
        dead[1, 0, 12:16] = True  # a whole block of one layer: that layer holds one fewer
        t.evict_mask(pool, [caches[1]], dead)
        fresh = SeqCache(pool, 3, tables=t)
        fresh.append(torch.arange(7 + seed))
        caches.insert(seed % 4, fresh)
        at_cap, reaching = SeqCache(pool, 3, tables=t), SeqCache(pool, 3, tables=t)
        at_cap.append(torch.arange(10))
        assert at_cap.start_ring(2, 10)  # 10 slots: two blocks and a half, 8 in the ring
        reaching.append(torch.arange(5))
        assert reaching.start_ring(1, 9)
        caches += [at_cap, reaching]
        slots = []
        for step in range(9):
            pos = [100 * i + step for i in range(len(caches))]
            rows = [c.row for c in caches]
            need, widest = t.decode_need(rows)
            assert need == sum(c.blocks_needed(1) for c in caches)
            # per row, as the policy runner's reservation check reads them
            assert t.held_and_need(rows) == ([c.num_blocks for c in caches],
                                             [c.blocks_needed(1) for c in caches])
            assert widest == max(b + (x >= b * 4) for c in caches
                                 for b, x in zip(c.nblocks, c.next_slot))
            got, width = t.append_decode(pool, rows, pos)
            assert width == widest == max(c.max_blocks for c in caches)  # what the step reads
            slots.append(got)
        k = len(caches) - 2  # the ring caches' index: their positions are 100 k + step
        kept = [sorted(p for p in c.slot_pos[layer].tolist() if p >= 0)
                for c in caches[-2:] for layer in range(3)]
        assert kept == [[0, 1, *range(100 * k + 1, 100 * k + 9)]] * 3 + \
            [[0, *range(100 * (k + 1) + 1, 100 * (k + 1) + 9)]] * 3  # sinks + the newest
        assert [t.take_overwritten(c.row) for c in caches[-2:]] == [9, 5]
        runs.append((pool, t, slots, [(c.nblocks, c.next_slot, c.layer_live) for c in caches]))
    (pa, a, sa, ca), (pb, b, sb, cb) = runs
    assert ca == cb
    assert ca[-2] == ([3] * 3, [10] * 3, [10] * 3)  # at its cap all along: nothing appended
    assert ca[-1] == ([3] * 3, [9] * 3, [9] * 3)  # grew to its cap (5 + 4 tokens), then rang
    assert torch.equal(a.ring, b.ring)
    assert any(len(set(nb)) > 1 for nb, _, _ in ca), "no uneven cache was measured"
    assert all(torch.equal(x, y) for x, y in zip(sa, sb))
    assert torch.equal(a.table, b.table) and torch.equal(a.slot_pos, b.slot_pos)
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), name
    assert torch.equal(pa.ref, pb.ref) and pa._free == pb._free


def test_native_decode_append_widens_and_recycles_as_torch(monkeypatch):
    """The C++ decode append counts and links its blocks in one call from the ids the
    pool would hand out next (`BlockPool.peek`); where the tables are too narrow for a
    new block, or the free list holds fewer ids than it needs beside parked prefix
    blocks, it changes nothing and is called again after the tables widen and the pool
    recycles the least recently used prefix. Both cases end as the torch form does: the
    same slots, tables, sizes, reference counts, free list and prefix cache."""
    from kvpool.seq_cache import SeqCache
    from tests.pools import make_pool

    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    calls = []
    op = torch.ops.kvserve_tables.append_rows
    runs = []
    for native in (True, False):
        monkeypatch.setattr(tables_mod, "load_mark", lambda n=native: n)
        monkeypatch.setattr(eviction_mod, "load_mark", lambda n=native: n)
        pool = make_pool(80, 4, 1, 4)
        t = SlotTables(3, 4, 4, 4)
        caches = [SeqCache(pool, 3, tables=t) for _ in range(4)]
        for c in caches:
            c.append(torch.arange(16))  # four full blocks a layer: the next token takes a fifth
        assert t.width == 4  # as wide as the rows' blocks: the append must widen the tables
        # all but 5 free blocks parked as published prefixes, in groups of 3 (LRU first)
        parked = pool.take(len(pool._free) - 5)
        for h in range(len(parked) // 3):
            pool.register(h, torch.tensor(parked[3 * h : 3 * h + 3]))
        pool.ref[torch.tensor(parked)] = 1
        pool.release(torch.tensor(parked))
        assert len(pool._free) < 3 * len(caches) <= pool.num_free
        rows = [c.row for c in caches]
        monkeypatch.setattr(torch.ops.kvserve_tables, "append_rows",
                            lambda *a: calls.append(a[-2]) or op(*a), raising=False)
        slots, width = t.append_decode(pool, rows, [16] * len(rows))
        assert width == 5 and t.width >= 5
        runs.append((slots, t.table[:, :4, :5].clone(), t.slot_pos[:, :4, :20].clone(),
                     t.sizes[:4].clone(), pool.ref.clone(), list(pool._free),
                     dict(pool.groups), list(pool._cached)))
    assert len(calls) == 2, "the C++ append is called again once the tables widen"
    for a, b in zip(*runs):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
    assert min(runs[0][6]) == 3, "the three least recently used prefixes went, no more"


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


@pytest.mark.parametrize(("model_dtype", "pool_dtype"), [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_native_kv_write_matches_torch(model_dtype, pool_dtype, monkeypatch):
    """KVStorage.write's C++ pass (attention/csrc/storage_cpu.cpp::write_kv) against its torch form
    (two index_puts): K and V as the runner hands them, strided views of one QKV output,
    in any order of slots, rounded to the pool's dtype as `.to()` rounds (values between
    two representable ones, an infinity, a NaN): the pool's bytes are the same, but for
    the NaN's payload (torch's vector conversion keeps its bits, the C++ pass writes the
    canonical NaN)."""
    from kvpool import pool as pool_mod
    from tests.pools import make_pool

    if not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(1)
    t, hkv, d = 300, 2, 32  # more rows than the C++ pass's grain: rows in parallel
    qkv = (torch.randn(t, (4 + 2 * hkv) * d, generator=g) * 3).to(model_dtype)
    qkv[0, 4 * d] = float("nan")
    qkv[1, 4 * d + 1] = float("inf")
    k = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    assert not k.is_contiguous()
    slots = torch.randperm(64 * 8, generator=g)[:t]
    pools = []
    for native in (True, False):
        monkeypatch.setattr(pool_mod, "load_mark", lambda n=native: n)
        p = make_pool(64, 8, hkv, d, dtype=pool_dtype)
        p.storage.write(slots, k, v)
        pools.append(p)
    a, b = pools[0].storage.kv, pools[1].storage.kv
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()) and nan.sum() == 1  # a NaN stays a NaN (its bits may not)
    assert torch.equal(a.masked_fill(nan, 0).view(torch.uint8), b.masked_fill(nan, 0).view(torch.uint8))
    assert a.isinf().sum() == 1


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
        monkeypatch.setattr(eviction_mod, "load_mark", lambda n=native: n)
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


@pytest.mark.parametrize("rows", [[1, 2, 3], [5, 0, 2], [0, 1, 4, 6, 7], [6]])
def test_rows_of_the_tables_read_and_written_back(rows):
    """`take_rows` / `rows_slice` / `put_rows`, the reads of a batch's rows of the tables'
    tensors and their way back, on rows consecutive or not: t[:, rows, :width] whatever
    the layout (positions; a state by slots; one stored by columns, which `rows_slice`
    hands in its own layout so pyramid's op keeps its column path), and a write lands on
    those rows' slots alone."""
    g = torch.Generator().manual_seed(len(rows))
    positions = torch.randint(-1, 50, (3, 8, 40), generator=g)
    by_slots = torch.rand(3, 8, 40, generator=g)
    by_columns = torch.rand(3, 8, 5, 40, generator=g).transpose(2, 3)  # [L, R, S, k]
    assert rows_mod.by_columns(by_columns)
    for t in (positions, by_slots, by_columns):
        want = t[:, rows, :24]
        taken = rows_mod.take_rows(t, rows, 24)
        assert taken.is_contiguous() and torch.equal(taken, want)
        sliced = rows_mod.rows_slice(t, rows, 24)
        assert torch.equal(sliced, want)
        assert rows_mod.by_columns(sliced) == rows_mod.by_columns(t)
        before = t.clone()
        new = torch.full_like(sliced, 7) if t.dtype == torch.int64 else sliced * 0 + 0.5
        rows_mod.put_rows(t, rows, new)
        assert torch.equal(t[:, rows, :24], new)
        others = [r for r in range(8) if r not in rows]
        assert torch.equal(t[:, others], before[:, others]) and torch.equal(t[:, :, 24:], before[:, :, 24:])


@pytest.mark.parametrize("native", [True, False])
def test_rows_into_writes_what_rows_of_reads(native, monkeypatch):
    """A CUDA graph step's staging (`SlotTables.rows_into`): the rows' tables and
    positions, nb columns each, into int32 and int64 buffers, for rows in order, apart
    and reversed, equal to `rows_of`'s; the tables' wider columns are not copied."""
    if native and not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(tables_mod, "load_mark", lambda: native)
    monkeypatch.setattr(eviction_mod, "load_mark", lambda: native)
    _, t, caches = _pool_case(1)
    t.ensure_width(3 * max(max(c.nblocks) for c in caches))  # wider than any row needs
    nb = max(max(c.nblocks) for c in caches)
    for rows in ([c.row for c in caches], [caches[2].row, caches[0].row], [caches[1].row]):
        want_t, want_p, _ = t.rows_of(rows, nb)
        for dtype in (torch.int32, torch.int64):
            got_t = torch.full((3, len(rows), nb), 7, dtype=dtype)
            got_p = torch.full((3, len(rows), nb * 4), 7, dtype=dtype)
            t.rows_into(rows, nb, got_t, got_p)
            assert torch.equal(got_t, want_t.to(dtype)) and torch.equal(got_p, want_p.to(dtype))
    assert (want_p >= 0).any() and (want_t == -1).any()  # live positions, padded columns
