"""The per-step shortcuts of policy evaluation give exactly the plans of the long way.

`Policy.idle` lets the engine skip a request whose policy has nothing to do; the
group's `RowsView` gathers every row's statistics in one op each instead of per layer.
Neither may change a kept set.
"""

import pytest
import torch

from attention.stats import AttentionMass
from kvpool.policy_rows import Member, build_view, carry_out
from kvpool.seq_cache import SeqCache
from policies.base import Needs
from policies.catalog import build_policy
from policies.norms import keydiff_scores
from tests.policy_views import LayerView, Sim, evict_positions
from tests.pools import make_pool

IDLE_POLICIES = [
    {"name": "streaming", "sink": 2, "window": 20},
    {"name": "lazy_streaming", "sink": 2, "window": 20, "compress_every": 6, "slack": 3, "max_drop": 4},
    {"name": "paged_eviction", "budget": 24},
    {"name": "knorm", "budget": 24, "window": 4},
    {"name": "keydiff", "budget": 0.5},
    {"name": "tova", "budget": 24},
    {"name": "snapkv", "budget": 16, "obs_window": 4},
]


@pytest.mark.parametrize("cfg", IDLE_POLICIES, ids=lambda c: c["name"])
def test_idle_skips_only_steps_that_plan_nothing(cfg):
    ref, fast = Sim(build_policy(cfg), seed=3), Sim(build_policy(cfg), seed=3, skip_idle=True)
    prompt = 30
    chunks = [8, 8, 8, 6] + [1] * 60  # chunked prefill, then decode
    for n in chunks:
        assert {k: v.tolist() for k, v in ref.step(n, prompt).items()} == \
            {k: v.tolist() for k, v in fast.step(n, prompt).items()}
    assert ref.counts() == fast.counts()
    assert fast.skipped > 0


def _cache(plans: list[dict[int, list[int]]], layers: int = 3, n: int = 40) -> SeqCache:
    pool = make_pool(64, 4, 2, 8)
    pool.storage.kv.copy_(torch.randn(pool.storage.kv.shape, generator=torch.Generator().manual_seed(0)))
    c = SeqCache(pool, layers)
    c.append(torch.arange(n))
    for plan in plans:
        evict_positions(c, {k: torch.tensor(v) for k, v in plan.items()})
    return c


def _slow_view(c: SeqCache, attention: torch.Tensor) -> list[LayerView]:
    """The per-layer reference: one nonzero and one gather per layer."""
    k_flat = c.pool.storage.k_cache.view(-1, 2, 8)
    v_flat = c.pool.storage.v_cache.view(-1, 2, 8)
    out = []
    for layer in range(c.num_layers):
        idx = (c.slot_pos[layer] >= 0).nonzero().squeeze(1)
        phys = c.table[layer, idx // c.bs] * c.bs + idx % c.bs
        k = k_flat[phys].float()
        out.append(LayerView(positions=c.slot_pos[layer, idx], attention=attention[layer][:, :, idx],
                             key_norm=k.norm(dim=-1), value_norm=v_flat[phys].float().norm(dim=-1),
                             keys=k))
    return out


class _Needing:
    """A stand-in policy that needs every statistic (build_view reads only `needs`)."""

    needs = Needs(attention=True, attention_heads=True, key_norm=True, value_norm=True,
                  keys=True, key_diversity=True)


@pytest.mark.parametrize("plans", [
    [],  # uniform
    [{0: [1, 2, 9], 1: [1, 2, 9], 2: [1, 2, 9]}],  # identical per layer
    [{0: [0, 5, 6, 7], 1: [3, 4, 8, 30], 2: [10, 11, 12, 13]}],  # diverged, same count
    [{0: [0, 5], 1: list(range(4, 12)), 2: [39]}],  # different counts, a freed block
])
def test_rows_view_matches_per_layer_reference(plans):
    """The group's view (one gather per statistic for every row) holds, at each row's
    live slots, what a per-layer gather reads; dead slots are -1 positions."""
    c = _cache(plans)
    width = max(c.nblocks) * c.bs
    att = torch.rand(c.num_layers, 1, 2, 2, width)  # [L, B, Tq, Hkv, S], one request
    member = Member(c, _Needing(), 40, 30, 2, False, AttentionMass(att, 0, 2))
    view = build_view([member])
    assert view.lengths == c.layer_live
    for layer, want in enumerate(_slow_view(c, att[:, 0])):
        live = view.positions[layer] >= 0
        assert torch.equal(view.positions[layer][live], want.positions)
        assert torch.equal(view.attention[layer][..., live], want.attention)
        for name in ("key_norm", "value_norm", "keys"):
            assert torch.equal(getattr(view, name)[layer][live], getattr(want, name)), name
        torch.testing.assert_close(view.key_diversity[layer][live], keydiff_scores(want.keys),
                                   atol=1e-5, rtol=0)


def test_identical_layers_drop_identical_slots_and_stay_alike():
    c = _cache([{0: [1, 2], 1: [1, 2], 2: [1, 2]}])
    assert c.alike
    policy = build_policy({"name": "streaming", "sink": 2, "window": 20})
    view = build_view([Member(c, policy, 40, 30, 1, False, None)])
    drop = type(policy).select([policy], view)
    assert drop is not None and torch.equal(drop, drop[:1].expand_as(drop))
    assert view.positions[0][drop[0]].tolist() == list(range(4, 20))  # keeps 0, 3, 20..39
    before = c.live
    evicted, _ = carry_out([c], drop.view(c.num_layers, 1, -1), [False], [None])[0]
    assert evicted == 3 * 16 and c.live == before - 3 * 16 and c.alike
