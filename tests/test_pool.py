"""Block pool and per-request slot lists: accounting and invariants."""


import pytest
import torch

from kvpool.pool import BlockPool, PoolExhausted
from kvpool.seq_cache import SeqCache
from kvpool.tables import SlotTables
from native.memory import parse_bytes
from tests.pools import make_pool


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e3") == 1000
    assert parse_bytes(77) == 77
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_allocate_release_and_exhaustion():
    pool = make_pool(8, 4, 1, 2)
    ids = pool.allocate(5)
    assert pool.num_used == 5 and pool.num_free == 3
    with pytest.raises(PoolExhausted):
        pool.allocate(4)
    assert pool.num_used == 5  # a failed allocation changes nothing
    pool.incref(ids[:2])
    pool.release(ids)
    assert pool.num_used == 2  # the shared two are still referenced once
    pool.check_invariants([ids[:2]])
    pool.release(ids[:2])
    assert pool.num_used == 0
    pool.check_invariants([])


def test_invariant_checks_catch_corruption():
    pool = make_pool(4, 4, 1, 2)
    ids = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_invariants([])  # owned blocks not reported -> ref mismatch
    pool._free.append(int(ids[0]))
    with pytest.raises(AssertionError):
        pool.check_invariants([ids])  # a block both free and owned


def test_append_is_uniform_across_layers_and_exact():
    pool = make_pool(64, 4, 1, 2)
    c = SeqCache(pool, num_layers=3)
    assert c.blocks_needed(9) == 3 * 3
    slots = c.append(torch.arange(9))
    assert slots.shape == (3, 9)
    assert pool.num_used == 9 and c.num_blocks == 9
    assert len(set(slots.flatten().tolist())) == 27  # every layer has its own slots
    assert c.blocks_needed(3) == 0 and c.blocks_needed(4) == 3
    c.append(torch.tensor([9]))
    assert c.live == 3 * 10
    assert c.live == int((c.slot_pos >= 0).sum())
    pool.check_invariants([c.owned_blocks()])
    c.release()
    assert pool.num_used == 0


def test_eviction_frees_whole_blocks_and_keeps_positions():
    pool = make_pool(64, 4, 1, 2)
    c = SeqCache(pool, num_layers=2)
    c.append(torch.arange(10))  # 3 blocks per layer, tail has room
    assert c.evict(0, torch.tensor([0, 1, 2])) == 0  # block 0 still has slot 3
    assert c.evict(0, torch.tensor([3, 4, 5, 6, 7])) == 2
    assert c.nblocks == [1, 3]
    assert c.slot_pos[0, :4].tolist() == [8, 9, -1, -1]  # the survivors, original positions
    assert c.live == 2 + 10 and not c.uniform
    slots = c.append(torch.tensor([10, 11, 12]))  # layer 0 fills its tail, then a new block
    assert c.nblocks == [2, 4]
    assert c.slot_pos[0, :8].tolist() == [8, 9, 10, 11, 12, -1, -1, -1]
    assert slots.shape == (2, 3)
    pool.check_invariants([c.owned_blocks()])
    assert c.drop_before(torch.tensor([0, 8])) == 2  # sliding window: positions < 8 gone
    assert c.live == int((c.slot_pos >= 0).sum()) == 5 + 5
    pool.check_invariants([c.owned_blocks()])
    c.release()
    assert pool.num_used == 0


# The randomized invariant test (thousands of scheduler steps with arrivals, aborts,
# preemptions, swaps and prefix hits) is tests/test_memory.py::test_randomized_stress_keeps_invariants.


def _decode(pool: BlockPool, caches: list[SeqCache], positions: list[int]) -> torch.Tensor:
    slots, widest = caches[0].tables.append_decode(pool, [c.row for c in caches], positions)
    assert widest == max(c.max_blocks for c in caches)  # the width the step's attention reads
    return slots


def test_append_decode_equals_append_and_sees_table_writes() -> None:
    """The batched decode append gives every cache the slots `append` would, across block
    boundaries, and reads the table as it is now (copy-on-write, compaction)."""
    pool = make_pool(400, 4, 2, 8)
    tables = SlotTables(3, 4, rows=1)  # rows grow on demand
    fast = [SeqCache(pool, 3, tables=tables) for _ in range(2)]
    ref = [SeqCache(pool, 3) for _ in range(2)]
    for c, n in zip(fast + ref, [5, 7, 5, 7]):
        c.append(torch.arange(n))
    for step in range(35):
        pos = [5 + step, 7 + step]
        got = _decode(pool, fast, pos)
        assert got.shape == (3, 2)
        for i, p in enumerate(pos):
            want = ref[i].append(torch.tensor([p]))
            assert torch.equal(want, ref[i].table[:, p // 4, None] * 4 + p % 4)
            # Same layout relative to each cache's own blocks.
            assert got[:, i].tolist() == (fast[i].table[:, p // 4] * 4 + p % 4).tolist()
            w = fast[i].max_blocks * 4  # the tables' widths differ; what is held not
            assert torch.equal(fast[i].slot_pos[:, :w], ref[i].slot_pos[:, :w])
            assert fast[i].live == ref[i].live and fast[i].nblocks == ref[i].nblocks
        if step == 16:  # the tail block is replaced in place, as copy-on-write does
            new, old = pool.allocate(3), fast[0].table[:, 5].clone()
            fast[0].table[:, 5] = new
            pool.release(old)
    for c in fast + ref:
        c.release()
    assert pool.num_free == 400
    assert sorted(tables._free_rows) == list(range(tables.table.shape[1]))


def test_append_decode_after_alike_eviction_matches_append() -> None:
    """Streaming-style plans drop the same positions in every layer: the layers stay
    aligned (one slot index for all); a layer evicted on its own makes the cache take
    per-layer slots. Both give the slots and positions `append` gives."""
    pool = make_pool(400, 4, 2, 8)
    fast, ref = SeqCache(pool, 3), SeqCache(pool, 3)
    for c in (fast, ref):
        c.append(torch.arange(10))
        c.evict_mask(torch.isin(c.slot_pos, torch.arange(2, 7)))  # every layer alike
    assert not fast.uniform and fast.aligned
    for pos in range(10, 30):
        if pos == 20:
            # layer 1 alone loses a whole block: no longer aligned
            for c in (fast, ref):
                assert c.evict(1, torch.arange(8, 12)) == 1
            assert not fast.aligned
        got = _decode(pool, [fast], [pos])
        want = ref.append(torch.tensor([pos]))
        slot = [int((fast.slot_pos[layer] == pos).nonzero()) for layer in range(3)]
        assert got[:, 0].tolist() == [int(fast.table[layer, s // 4]) * 4 + s % 4
                                      for layer, s in enumerate(slot)]
        assert torch.equal(fast.slot_pos, ref.slot_pos) and fast.live == ref.live
        assert fast.nblocks == ref.nblocks and fast.next_slot == ref.next_slot
        assert want.shape == (3, 1)
    fast.release()
    ref.release()
    assert pool.num_free == 400


def test_alike_flag_tracks_layers_evicted_the_same() -> None:
    """`alike` (every layer holds the same positions in the same slots) survives only
    evictions identical in every layer, and the blocks they free."""
    pool = make_pool(400, 4, 2, 8)
    c = SeqCache(pool, 3)
    c.append(torch.arange(12))
    dead = torch.isin(c.slot_pos, torch.arange(0, 4)).logical_or_(c.slot_pos == 9)
    assert c.evict_mask(dead) == 3  # block 0 of every layer freed
    assert c.alike and not c.uniform
    assert bool((c.slot_pos == c.slot_pos[:1]).all())
    c.evict(2, torch.tensor([0]))  # one layer alone
    assert not c.alike
    c.release()
    assert c.alike and pool.num_free == 400


def test_append_decode_on_an_exhausted_pool_changes_nothing() -> None:
    """The new tail blocks come from the pool before anything is written, so a pool that
    cannot supply them leaves every cache as it was (the scheduler then preempts)."""
    pool = make_pool(12, 4, 2, 8)
    tables = SlotTables(3, 4)
    a, c = SeqCache(pool, 3, tables=tables), SeqCache(pool, 3, tables=tables)
    a.append(torch.arange(3))  # room in its tail
    c.append(torch.arange(4))  # needs a block per layer
    pool.allocate(pool.num_free - 2)  # two left, three layers need one each
    before = [(list(x.nblocks), list(x.next_slot), x.slot_pos.clone(), x.table.clone(), x.live)
              for x in (a, c)]
    with pytest.raises(PoolExhausted):
        tables.append_decode(pool, [a.row, c.row], [3, 4])
    for x, b in zip((a, c), before):
        assert (list(x.nblocks), list(x.next_slot), x.live) == (b[0], b[1], b[4])
        assert torch.equal(x.slot_pos, b[2]) and torch.equal(x.table, b[3])
    assert pool.num_free == 2


def test_peak_is_kept_where_slots_are_taken() -> None:
    """A cache's peak (blocks over all layers, live tokens a layer) is raised by appends,
    prefill and decode alike, and never lowered by eviction; release forgets it (the
    scheduler folds it into the request's usage first)."""
    pool = make_pool(100, 4, 2, 8)
    tables = SlotTables(2, 4)
    c = SeqCache(pool, 2, tables=tables)
    c.append(torch.arange(10))  # 3 blocks a layer, 10 live
    assert c.peak() == (6, 10)
    c.evict_mask(torch.isin(c.slot_pos, torch.arange(8)))  # two blocks a layer freed
    assert (c.num_blocks, c.live) == (2, 4) and c.peak() == (6, 10)
    for pos in range(10, 20):
        tables.append_decode(pool, [c.row], [pos])
    assert (c.num_blocks, c.live // 2) == (6, 12) and c.peak() == (6, 12)
    c.release()
    assert c.peak() == (0, 0) and pool.num_free == 100


def test_scratch_block_is_outside_the_accounting() -> None:
    """A CUDA graph's padded rows write the scratch block (engine/cuda_graphs.py): it is
    allocated past the blocks handed out, never owned, and an idle pool reads 0 used."""
    pool = make_pool(num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2, scratch=True)
    assert pool.storage.kv.shape[1] == 5 and pool.storage.scratch_slot == 8
    assert (pool.num_free, pool.num_used) == (4, 0)
    plain = make_pool(num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2)
    assert pool.storage.nbytes == plain.storage.nbytes
    assert pool.storage.block_bytes == plain.storage.block_bytes
    ids = pool.allocate(4)
    assert sorted(ids.tolist()) == [0, 1, 2, 3] and pool.num_free == 0
    store = pool.storage
    store.write(torch.tensor([store.scratch_slot]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    pool.check_invariants([ids])
    pool.release(ids)
    pool.check_invariants([])
    assert make_pool(4, 2, 1, 2).storage.scratch_slot is None
