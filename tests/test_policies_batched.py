"""Policies run on groups of requests (kvpool/policy_rows.py) against groups of one
(`batch_policies=False`): the same kept positions in every layer of every request after
every step, the same tokens, the same accounting — on a real model forward, with
requests of several policies, configs and budgets in one continuous batch."""

import pytest
import torch

from engine.sampling import SamplingParams
from kvpool import manager as manager_mod
from kvpool import tables as tables_mod
from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from kvpool.tables import SlotTables
from scheduler.llm import LLM
from tests.pools import make_pool
from tests.tiny_models import make_tiny_model, resolved

BS = 4

# Three requests share each of the first configs (so they batch); the others differ in
# budget or window (their own groups), resolve a ratio differently per length, compact
# or re-rotate (`rope: "shift"`) after their drops.
CONFIGS = [
    *[{"name": "h2o", "budget": 32, "window": 8}] * 3,
    *[{"name": "tova", "budget": 32}] * 3,
    *[{"name": "knorm", "budget": 32, "window": 4}] * 3,
    *[{"name": "keydiff", "budget": 32}] * 3,
    *[{"name": "paged_eviction", "budget": 32}] * 3,  # compacts after its drops: together
    *[{"name": "lazy_eviction", "budget": 32, "window": 8}] * 3,
    *[{"name": "streaming", "sink": 4, "window": 28}] * 2,
    {"name": "h2o", "budget": 40, "window": 4},
    {"name": "tova", "budget": 24},
    {"name": "knorm", "budget": 0.3},
    {"name": "knorm", "budget": 0.3},
    {"name": "keydiff", "budget": 32, "compact": True},
    {"name": "streaming", "sink": 4, "window": 28, "rope": "shift"},
    {"name": "lazy_eviction", "budget": 0.5, "window": 10},
    {"name": "full"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=1024)


def _live_positions(llm: LLM) -> dict[str, list[list[int]]]:
    out = {}
    for r in llm.engine.scheduler.running:
        sp = r.cache.slot_pos
        out[r.request_id] = [sorted(sp[layer][sp[layer] >= 0].tolist()) for layer in range(sp.shape[0])]
    return out


def test_batched_steps_keep_exactly_what_per_request_steps_keep(model, monkeypatch):
    batched: dict[str, int] = {}  # policy name -> members stepped in a batch
    real = manager_mod.run_group

    def counting(members):
        if len(members) > 1:
            name = members[0].policy.name
            batched[name] = batched.get(name, 0) + len(members)
        return real(members)

    monkeypatch.setattr(manager_mod, "run_group", counting)
    # Without StreamingLLM's ring its decode steps evict through the batched selection
    # too (with it, `streaming` has nothing to select once its cache is at the window:
    # tests/test_streaming_ring.py).
    llms = [LLM(model, num_blocks=3000, block_size=BS, max_num_batched_tokens=512,
                batch_policies=batched, streaming_ring=False) for batched in (True, False)]
    gen = torch.Generator().manual_seed(0)
    for i, cfg in enumerate(CONFIGS):
        prompt = torch.randint(5, 250, (40 + 3 * i,), generator=gen).tolist()
        for llm in llms:
            llm.engine.add_request(f"r{i}", prompt, SamplingParams(
                max_tokens=90, temperature=0, ignore_eos=True, detokenize=False),
                kv_policy=resolved(llm.engine, cfg))
    tokens: list[dict[str, list[int]]] = [{}, {}]
    steps = 0
    while llms[0].engine.has_unfinished():
        for llm, got in zip(llms, tokens):
            for o in llm.engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        assert _live_positions(llms[0]) == _live_positions(llms[1]), steps
        if steps % 20 == 0:
            llms[0].engine.check_invariants()
    assert not llms[1].engine.has_unfinished()
    assert tokens[0] == tokens[1]
    a, b = (llm.engine.stats() for llm in llms)
    assert a.evicted_tokens_by_policy_total == b.evicted_tokens_by_policy_total
    assert a.freed_blocks_by_policy_total == b.freed_blocks_by_policy_total
    for llm in llms:
        llm.engine.check_invariants()
        assert llm.engine.pool.num_used == 0
    # The batches really ran, for every policy class with a batched step.
    assert {n for n, k in batched.items() if k > 40} == {
        "h2o", "tova", "knorm", "keydiff", "paged_eviction", "lazy_eviction", "streaming"}, batched


def _cache(tables: SlotTables, pool: BlockPool, n: int = 30) -> SeqCache:
    c = SeqCache(pool, tables.num_layers, tables=tables)
    c.append(torch.arange(n))
    return c


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_evict_mask_of_many_caches_equals_one_at_a_time(seed, native, monkeypatch):
    """`SlotTables.evict_mask` over several caches of one table leaves each exactly as
    evicting it alone (always the torch form) does: slot positions, tables, sizes,
    flags, freed blocks (the tail block kept while it takes appends). `native`: the
    group goes through the C++ marking (kvpool/csrc/tables_cpu.cpp)."""
    if native and not tables_mod.load_mark():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(seed)
    pools = [make_pool(200, BS, 2, 8) for _ in range(2)]
    tables = [SlotTables(3, BS) for _ in range(2)]
    group = [_cache(tables[0], pools[0], 20 + 5 * i) for i in range(3)]
    alone = [_cache(tables[1], pools[1], 20 + 5 * i) for i in range(3)]
    for _ in range(4):
        width = max(max(c.nblocks) for c in group) * BS
        dead = torch.rand((3, 3, width), generator=g) < 0.15  # [L, R, W]
        if seed % 2:  # the same slots in every layer: the caches stay alike
            dead = dead[:1].expand(3, -1, -1).contiguous()
        monkeypatch.setattr(tables_mod, "load_mark", lambda: native)
        got = tables[0].evict_mask(pools[0], group, dead)
        monkeypatch.setattr(tables_mod, "load_mark", lambda: False)
        want = []
        for c, d in zip(alone, dead.unbind(1)):
            before = list(c.layer_live)
            freed = c.evict_mask(d)
            by_layer = [b - a for b, a in zip(before, c.layer_live)]
            want.append((sum(by_layer), freed, by_layer))
        assert got == want
        for a, b in zip(group, alone):
            assert torch.equal(a.slot_pos, b.slot_pos) and torch.equal(a.table, b.table)
            assert (a.nblocks, a.next_slot, a.layer_live) == (b.nblocks, b.next_slot, b.layer_live)
            assert (a.uniform, a.alike) == (b.uniform, b.alike)
        assert pools[0].num_free == pools[1].num_free
    assert group[0].alike == bool(seed % 2)


def test_evict_mask_frees_a_block_emptied_by_the_drop():
    c = _cache(SlotTables(2, BS), make_pool(64, BS, 2, 8), n=12)
    before = c.pool.num_free
    dead = torch.zeros(2, 12, dtype=torch.bool)
    dead[:, 0] = True  # slot 0 of each layer: no block empties
    assert c.evict_mask(dead) == 0
    dead[:] = False
    dead[0, 1:4] = True  # the rest of block 0 of layer 0 only
    dead[1, 4:7] = True
    assert c.evict_mask(dead) == 1
    assert c.nblocks == [2, 3] and c.pool.num_free == before + 1
    assert c.slot_pos[0, :8].tolist() == list(range(4, 12))


def test_staggered_arrivals_batch_members_on_different_clocks(model, monkeypatch):
    """Requests that arrive steps apart share a batch whenever their layers hold the same
    count, although their clocks differ: lazy_eviction members then decide at different
    steps (some rows select, others only track) and score with their own t."""
    mixed = {"steps": 0}
    real = manager_mod.run_group

    def spying(members):
        if members[0].policy.name == "lazy_eviction":
            w = members[0].policy.config.window
            ts = [m.seq_len - m.prompt_len for m in members]
            decide = {t >= w and t // w > m.policy._epoch for t, m in zip(ts, members)}
            if len(set(ts)) > 1 and decide == {True, False}:
                mixed["steps"] += 1
        return real(members)

    monkeypatch.setattr(manager_mod, "run_group", spying)
    llms = [LLM(model, num_blocks=3000, block_size=BS, max_num_batched_tokens=512,
                batch_policies=batched) for batched in (True, False)]
    gen = torch.Generator().manual_seed(1)
    # (arrival step, prompt length, config): 40 + t and 44 + (t - 4) hold the same count;
    # the one arriving at step 8 decides together with the first at t = 8 vs 16.
    arrivals = [(0, 40, {"name": "lazy_eviction", "budget": 32, "window": 8, "alpha": 0.03}),
                (4, 44, {"name": "lazy_eviction", "budget": 32, "window": 8, "alpha": 0.03}),
                (6, 46, {"name": "lazy_eviction", "budget": 32, "window": 8, "alpha": 0.03}),
                (8, 32, {"name": "lazy_eviction", "budget": 32, "window": 8, "alpha": 0.03}),
                (10, 34, {"name": "lazy_eviction", "budget": 32, "window": 8, "alpha": 0.03}),
                (0, 50, {"name": "h2o", "budget": 32, "window": 8}),
                (9, 37, {"name": "h2o", "budget": 32, "window": 8})]
    prompts = [torch.randint(5, 250, (n,), generator=gen).tolist() for _, n, _ in arrivals]
    tokens: list[dict[str, list[int]]] = [{}, {}]
    for step in range(80):
        for i, (at, _, cfg) in enumerate(arrivals):
            if at == step:
                for llm in llms:
                    llm.engine.add_request(f"r{i}", prompts[i], SamplingParams(
                        max_tokens=60, temperature=0, ignore_eos=True, detokenize=False),
                        kv_policy=resolved(llm.engine, cfg))
        for llm, got in zip(llms, tokens):
            for o in llm.engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert _live_positions(llms[0]) == _live_positions(llms[1]), step
    assert tokens[0] == tokens[1] and all(len(v) == 60 for v in tokens[0].values())
    assert mixed["steps"] > 0


def test_batch_members_from_attention_groups_of_different_widths(model):
    """The torch attention path splits a decode batch into groups by cached length, each
    padded to its own width; a policy batch may take members from several (here: tova
    requests with 40- and 400-token prompts, at one budget). Their mass is gathered per
    group before joining (it used to fail in torch.cat on the widths)."""
    from attention.torch_attention import paged_attention

    llms = [LLM(model, num_blocks=3000, block_size=BS, max_num_batched_tokens=4096,
                batch_policies=batched) for batched in (True, False)]
    for llm in llms:
        llm.engine.runner.attention_fn = paged_attention  # the torch path, which pads
    gen = torch.Generator().manual_seed(1)
    for i in range(16):
        prompt = torch.randint(5, 250, (40 if i % 2 else 400,), generator=gen).tolist()
        for llm in llms:
            llm.engine.add_request(f"r{i}", prompt, SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True, detokenize=False),
                kv_policy=resolved(llm.engine, {"name": "tova", "budget": 32}))
    steps = 0
    while llms[0].engine.has_unfinished():
        outs = [llm.engine.step() for llm in llms]
        assert [(o.request_id, o.new_token_ids) for o in outs[0]] == \
            [(o.request_id, o.new_token_ids) for o in outs[1]]
        steps += 1
        assert _live_positions(llms[0]) == _live_positions(llms[1]), steps
