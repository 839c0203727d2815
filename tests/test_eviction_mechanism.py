"""How the engine carries out an eviction plan inside the paged pool."""

import torch
from transformers import LlamaConfig

from attention.stats import AttentionMass
from engine.rope import RotaryEmbedding
from kvpool.compaction import compact
from kvpool.policy_rows import Member, build_view
from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from kvpool.tables import SlotTables
from policies.base import Needs
from tests.policy_views import evict_positions
from tests.pools import make_pool

H, D, BS = 2, 8, 4


def _filled(num_layers: int = 1, n: int = 12) -> tuple[BlockPool, SeqCache]:
    """A cache whose K and V at position p are all equal to p (easy to follow)."""
    pool = make_pool(32, BS, H, D)
    c = SeqCache(pool, num_layers)
    slots = c.append(torch.arange(n))
    for layer in range(num_layers):
        val = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, H, D)
        pool.storage.k_cache.view(-1, H, D)[slots[layer]] = val
        pool.storage.v_cache.view(-1, H, D)[slots[layer]] = -val
    return pool, c


def _kv_by_position(c: SeqCache, layer: int = 0) -> dict[int, float]:
    _, phys = c.live_slots(layer)
    pos = c.slot_pos[layer][c.slot_pos[layer] >= 0].tolist()
    k = c.pool.storage.k_cache.view(-1, H, D)[phys][:, 0, 0].tolist()
    v = c.pool.storage.v_cache.view(-1, H, D)[phys][:, 0, 0].tolist()
    assert k == [-x for x in v]
    return dict(zip(pos, k))


def test_plan_by_position_frees_emptied_blocks_at_once():
    pool, c = _filled(num_layers=2)
    evicted, freed = evict_positions(c, {0: torch.tensor([0, 1, 2, 3, 5]), 1: torch.tensor([11])})
    assert evicted == 6
    assert freed == 1  # layer 0's first block; layer 1's tail is full but live
    assert c.nblocks == [2, 3]
    assert _kv_by_position(c, 0) == {p: float(p) for p in [4, 6, 7, 8, 9, 10, 11]}
    pool.check_invariants([c.owned_blocks()])


def test_compaction_packs_survivors_and_keeps_their_data():
    pool, c = _filled()
    keep = [0, 5, 9, 10, 11]
    drop = torch.tensor([p for p in range(12) if p not in keep])
    _, freed = evict_positions(c, {0: drop}, compact=True)
    assert c.nblocks == [2] and freed == 1  # 3 partly-dead blocks -> 2
    assert _kv_by_position(c) == {p: float(p) for p in keep}
    slots = c.append(torch.tensor([12, 13, 14]))  # appends continue after the survivors
    assert c.nblocks == [2] and slots.shape == (1, 3)
    pool.check_invariants([c.owned_blocks()])


def test_compaction_needs_no_free_block():
    """Compaction packs in place: with the pool exhausted it still frees the blocks its
    survivors no longer need (what keeps a scattered policy within its reservation)."""
    pool, c = _filled()
    other = pool.allocate(pool.num_free)  # someone else holds the rest of the pool
    keep = [1, 2, 6, 11]
    _, freed = evict_positions(c, {0: torch.tensor([p for p in range(12) if p not in keep])})
    assert freed == 0 and c.nblocks == [3]  # every block keeps a survivor
    assert pool.num_free == 0
    assert c.compact(0) == 2 and c.nblocks == [1] and pool.num_free == 2
    assert _kv_by_position(c) == {p: float(p) for p in keep}
    assert c.compact(0) == 0  # no hole left
    pool.check_invariants([c.owned_blocks(), other])


def test_compaction_copies_a_shared_block_before_writing_it():
    """A block shared through the prefix cache is copied before survivors move into it:
    the other holder's K/V stay as they were."""
    pool, a = _filled(n=8)
    pool.register(123, a.table[:, 0])
    b = SeqCache(pool, 1)
    b.adopt([pool.acquire(123)])
    slots = b.append(torch.arange(4, 12))[0]
    val = torch.arange(4, 12, dtype=torch.float32)[:, None, None].expand(8, H, D)
    pool.storage.k_cache.view(-1, H, D)[slots] = val
    pool.storage.v_cache.view(-1, H, D)[slots] = -val
    shared = int(a.table[0, 0])
    evict_positions(b, {0: torch.tensor([1, 2, 5, 6, 9])})
    assert b.compact(0) == 1 and int(b.table[0, 0]) != shared
    assert _kv_by_position(b) == {p: float(p) for p in [0, 3, 4, 7, 8, 10, 11]}
    assert _kv_by_position(a) == {p: float(p) for p in range(8)}  # untouched
    pool.check_invariants([a.owned_blocks(), b.owned_blocks()])


def test_renumber_rerotates_keys_as_if_written_at_the_new_positions():
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=D)
    rope = RotaryEmbedding(cfg, D, 64)
    pool = make_pool(16, BS, H, D)
    c = SeqCache(pool, 1)
    raw = torch.randn(10, H, D)
    slots = c.append(torch.arange(10))[0]
    pool.storage.k_cache.view(-1, H, D)[slots] = rope.rotate(raw, torch.arange(10))
    evict_positions(c, {0: torch.tensor([2, 3, 4, 5])}, rotate=lambda k, d: rope.rotate(k, d, scaled=False))
    kept = [0, 1, 6, 7, 8, 9]
    assert c.slot_pos[0][c.slot_pos[0] >= 0].tolist() == list(range(6))
    _, phys = c.live_slots(0)
    want = rope.rotate(raw[kept], torch.arange(6))
    assert torch.allclose(pool.storage.k_cache.view(-1, H, D)[phys], want, atol=1e-5)


class _Asking:
    needs = Needs(attention=True, key_norm=True)


class _AskingHeads:
    needs = Needs(attention=True, attention_heads=True)


def test_view_gives_live_positions_and_only_the_statistics_asked_for():
    _, c = _filled(num_layers=2)
    evict_positions(c, {1: torch.tensor([0, 1])})
    mass = torch.rand(2, 1, 3, H, 12)  # [L, B, Tq, Hkv, S]
    view = build_view([Member(c, _Asking(), 12, 9, 3, True, AttentionMass(mass, 0, 3))])
    assert view.positions[0].tolist() == list(range(12))
    assert view.positions[1].tolist() == [-1, -1, *range(2, 12)]
    assert view.lengths == [12, 10]
    # summed over the kv heads unless asked per head (snapkv)
    assert torch.equal(view.attention[1], mass[1, 0].sum(dim=1, keepdim=True))
    assert torch.allclose(view.key_norm[1, 2:, 0], torch.arange(2, 12.0) * D**0.5)
    assert view.value_norm is None and view.keys is None
    heads = build_view([Member(c, _AskingHeads(), 12, 9, 3, True, AttentionMass(mass, 0, 3))])
    assert torch.equal(heads.attention[1], mass[1, 0]) and heads.key_norm is None


def test_slot_state_moves_with_its_token():
    """A policy's per-slot state follows its token when emptied blocks are freed and
    when survivors are compacted, and a new slot starts at the state's fill."""
    _, c = _filled(num_layers=2)
    tables = c.tables
    tables.declare_state({"score": -1.0, "window": (-2.0, 3)})  # a value, and 3 per slot
    score = tables.state["score"][:, c.row]
    score[:, :12] = torch.arange(12, dtype=torch.float32) * 10  # score = 10 * position
    tables.state["window"][:, c.row, :12] = score[:, :12, None] + torch.arange(3.0)

    def by_position(layer: int) -> dict[int, float]:
        live = c.slot_pos[layer] >= 0
        window = tables.state["window"][layer, c.row][live]
        score = tables.state["score"][layer, c.row][live]
        old = score >= 0  # the tokens written above: their 3 values moved with them
        assert torch.equal(window[old], score[old][:, None] + torch.arange(3.0))
        return dict(zip(c.slot_pos[layer][live].tolist(),
                        tables.state["score"][layer, c.row][live].tolist()))

    evict_positions(c, {0: torch.tensor([0, 1, 2, 3, 6]), 1: torch.tensor([1, 5, 9])})
    assert c.nblocks[0] == 2  # layer 0's first block was freed and its column closed
    evict_positions(c, {0: torch.tensor([8]), 1: torch.tensor([2])}, compact=True)
    for layer, gone in ((0, {0, 1, 2, 3, 6, 8}), (1, {1, 2, 5, 9})):
        assert by_position(layer) == {p: 10.0 * p for p in range(12) if p not in gone}
    c.append(torch.tensor([12]))
    assert by_position(0)[12] == -1.0 and by_position(1)[12] == -1.0
    assert tables.state["window"][0, c.row][c.slot_pos[0] == 12].tolist() == [[-2.0] * 3]


def test_batched_compaction_packs_every_cache_and_layer_at_once():
    """`compaction.compact` over several caches of one table: each (cache, layer) ends as
    compacting it alone would leave it — survivors in order with their K/V, emptied
    blocks freed — a cache without holes is untouched, and a shared block is copied
    before it is written while its other holder keeps it."""
    pool = make_pool(64, BS, H, D)
    tables = SlotTables(2, BS)
    caches = [SeqCache(pool, 2, tables=tables) for _ in range(3)]
    for i, c in enumerate(caches):
        slots = c.append(torch.arange(12))
        for layer in range(2):
            val = (100 * i + 10 * layer + torch.arange(12, dtype=torch.float32))
            pool.storage.k_cache.view(-1, H, D)[slots[layer]] = val[:, None, None].expand(12, H, D)
            pool.storage.v_cache.view(-1, H, D)[slots[layer]] = -val[:, None, None].expand(12, H, D)
    holder = SeqCache(pool, 2)  # shares cache 1's first block in layer 1
    pool.register(7, caches[1].table[:, 0])
    holder.adopt([pool.acquire(7)])
    shared = int(caches[1].table[1, 0])
    kept = {0: ([1, 5, 6, 11], [0, 3, 4, 9, 10]), 1: ([2, 3], [1, 7, 8])}  # cache 2: no hole
    for i, (k0, k1) in kept.items():
        evict_positions(caches[i], {0: torch.tensor([p for p in range(12) if p not in k0]),
                                   1: torch.tensor([p for p in range(12) if p not in k1])})
    before = [_kv_by_position(c, layer) for c in caches for layer in range(2)]
    blocks = [c.num_blocks for c in caches]
    freed = compact(tables, pool, caches)
    assert freed == [blocks[0] - 3, blocks[1] - 2, 0]
    assert caches[0].nblocks == [1, 2] and caches[0].next_slot == [4, 5]
    assert caches[1].nblocks == [1, 1] and caches[1].next_slot == [2, 3]
    assert caches[2].nblocks == [3, 3] and caches[2].next_slot == [12, 12]
    assert [_kv_by_position(c, layer) for c in caches for layer in range(2)] == before
    assert int(caches[1].table[1, 0]) != shared  # written: copied first
    assert _kv_by_position(holder, 1) == {p: 110.0 + p for p in range(4)}
    assert compact(tables, pool, caches) == [0, 0, 0]
    pool.check_invariants([c.owned_blocks() for c in [*caches, holder]])
