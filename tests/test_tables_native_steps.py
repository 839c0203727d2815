"""A step's slot-table ops in C++ (kvpool/csrc/tables_cpu.cpp) against their torch forms
(kvpool/tables.py): the decode append, the K/V write, a group's rows read, written back
and staged for a CUDA graph step (the block bookkeeping: tests/test_tables_native.py)."""

import pytest
import torch

from kvpool import rows as rows_mod
from kvpool import tables as tables_mod
from kvpool.tables import SlotTables
from tests.test_tables_native import _pool_case


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


@pytest.mark.parametrize(("model_dtype", "pool_dtype"), [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_native_kv_write_matches_torch(model_dtype, pool_dtype, monkeypatch):
    """BlockPool.write's C++ pass (csrc/tables_cpu.cpp::write_kv) against its torch form
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
