"""The per-step fast paths of policy evaluation give exactly the plans of the slow ones.

`Policy.idle` lets the engine skip building a view; `fill_view` shares one positions
tensor between identical layers and gathers every layer's statistics in one op;
`evict_except_rows` selects for all layers at once. None may change a kept set.
"""

import pytest
import torch

from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from policies.base import LayerView, Needs, StepView, edge_mask, evict_except, evict_except_rows
from policies.catalog import build_policy
from scheduler.eviction import apply_eviction, build_view
from tests.policy_views import Sim, run_step

IDLE_POLICIES = [
    {"name": "streaming", "sink": 2, "window": 20},
    {"name": "lazy_streaming", "sink": 2, "window": 20, "compress_every": 6, "slack": 3, "max_drop": 4},
    {"name": "paged_eviction", "budget": 24},
    {"name": "knorm", "budget": 24, "window": 4},
    {"name": "keydiff", "budget": 0.5},
    {"name": "tova", "budget": 24},
    {"name": "snapkv", "budget": 16, "obs_window": 4},
]


class Skipping:
    """A policy that the engine would skip whenever `idle` says so."""

    def __init__(self, policy) -> None:
        self.policy, self.skipped = policy, 0

    @property
    def needs(self) -> Needs:
        return self.policy.needs

    def step(self, view: StepView) -> dict:
        header = StepView(seq_len=view.seq_len, prompt_len=view.prompt_len,
                          num_new=view.num_new, prefill_done=view.prefill_done,
                          block_size=view.block_size, lengths=list(view.lengths))
        if self.policy.idle(header):
            self.skipped += 1
            return {}
        return run_step(self.policy, view)


@pytest.mark.parametrize("cfg", IDLE_POLICIES, ids=lambda c: c["name"])
def test_idle_skips_only_steps_that_plan_nothing(cfg):
    ref, fast = Sim(build_policy(cfg), seed=3), Sim(Skipping(build_policy(cfg)), seed=3)
    prompt = 30
    chunks = [8, 8, 8, 6] + [1] * 60  # chunked prefill, then decode
    for n in chunks:
        assert {k: v.tolist() for k, v in ref.step(n, prompt).items()} == \
            {k: v.tolist() for k, v in fast.step(n, prompt).items()}
    assert ref.counts() == fast.counts()
    assert fast.policy.skipped > 0


def _cache(plans: list[dict[int, list[int]]], layers: int = 3, n: int = 40) -> SeqCache:
    pool = BlockPool(64, 4, 2, 8)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    c = SeqCache(pool, layers)
    c.append(torch.arange(n))
    for plan in plans:
        apply_eviction(c, {k: torch.tensor(v) for k, v in plan.items()})
    return c


def _slow_view(c: SeqCache, attention: list[torch.Tensor]) -> list[LayerView]:
    """The per-layer reference: one nonzero and one gather per layer."""
    k_flat = c.pool.k_cache.view(-1, 2, 8)
    v_flat = c.pool.v_cache.view(-1, 2, 8)
    out = []
    for layer in range(c.num_layers):
        idx = (c.slot_pos[layer] >= 0).nonzero().squeeze(1)
        phys = c.table[layer, idx // c.bs] * c.bs + idx % c.bs
        k = k_flat[phys].float()
        out.append(LayerView(positions=c.slot_pos[layer, idx], attention=attention[layer][:, :, idx],
                             key_norm=k.norm(dim=-1), value_norm=v_flat[phys].float().norm(dim=-1),
                             keys=k))
    return out


@pytest.mark.parametrize("plans", [
    [],  # uniform
    [{0: [1, 2, 9], 1: [1, 2, 9], 2: [1, 2, 9]}],  # identical per layer
    [{0: [0, 5, 6, 7], 1: [3, 4, 8, 30], 2: [10, 11, 12, 13]}],  # diverged, same count
    [{0: [0, 5], 1: list(range(4, 12)), 2: [39]}],  # different counts, a freed block
])
def test_fill_view_matches_per_layer_reference(plans):
    c = _cache(plans)
    width = max(c.next_slot)
    att = [torch.rand(2, 2, width) for _ in range(c.num_layers)]
    view = build_view(c, Needs(attention=True, key_norm=True, value_norm=True, keys=True),
                      att, 40, 30, 2, False)
    for got, want in zip(view.layers, _slow_view(c, att)):
        for name in ("positions", "attention", "key_norm", "value_norm", "keys"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("positions", "key_norm", "keys", "attention"):
        stacked = view.stacked(name)
        if len(set(view.lengths)) == 1:
            assert torch.equal(stacked, torch.stack([getattr(lv, name) for lv in view.layers]))
        else:
            assert stacked is None


def test_identical_layers_share_positions_and_plans():
    c = _cache([{0: [1, 2], 1: [1, 2], 2: [1, 2]}])
    policy = build_policy({"name": "streaming", "sink": 2, "window": 20})
    view = build_view(c, policy.needs, None, 40, 30, 1, False)
    assert all(lv.positions is view.layers[0].positions for lv in view.layers)
    plan = run_step(policy, view)
    assert all(torch.equal(p, plan[0]) for p in plan.values())
    assert plan[0].tolist() == list(range(4, 20))  # keeps 0, 3 and 20..39
    before = c.live
    apply_eviction(c, plan)
    assert c.live == before - 3 * 16


@pytest.mark.parametrize("last", [0, 1, 5])
def test_rows_selection_equals_per_layer_selection(last):
    g = torch.Generator().manual_seed(last)
    scores = torch.randint(0, 6, (4, 50), generator=g).float()  # many ties
    pos = torch.sort(torch.randperm(200, generator=g)[:200].view(4, 50), dim=1).values
    for keep in (last, last + 1, 20, 49):
        if keep < 1:
            continue
        rows = evict_except_rows(scores, pos, keep, last)
        for layer in range(4):
            want = evict_except(scores[layer], pos[layer], keep, edge_mask(50, 0, last))
            assert torch.equal(rows[layer], want)


@pytest.mark.parametrize("plan", [
    {0: [7], 1: [7], 2: [7]},  # identical, tiny: compared directly
    {0: list(range(3, 20)), 1: list(range(3, 20)), 2: list(range(3, 20))},  # identical: isin
    {2: [5], 0: [9], 1: [30]},  # one per layer, out of order: compared directly
    {0: [1, 2, 3], 2: [4]},  # ragged: (layer, position) keys
])
def test_apply_eviction_fast_paths_drop_exactly_the_plan(plan):
    c = _cache([{0: [0], 1: [1], 2: [2]}])
    want = [sorted(set(c.slot_pos[layer][c.slot_pos[layer] >= 0].tolist()) - set(plan.get(layer, [])))
            for layer in range(3)]
    applied = apply_eviction(c, {k: torch.tensor(v) for k, v in plan.items()})
    got = [c.slot_pos[layer][c.slot_pos[layer] >= 0].tolist() for layer in range(3)]
    assert got == want
    assert applied.evicted_slots == sum(len(v) for v in plan.values())


