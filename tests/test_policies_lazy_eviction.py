"""lazy_eviction (004 §4, Algorithm 1): timestamps, MRI (eq. 1), H1/H2 (eq. 2) and the
eviction every W steps, on a hand-computed trace."""

import math

import pytest
import torch

from policies.catalog import build_policy
from policies.lazy_eviction import importance
from tests.policy_views import LayerView, Sim, arange, run_step, slot_state, view


def sig(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("t,ts,mri,expected", [
    (2, 1, 2, 2 * sig(-0.5) + 2 * sig(-1.0)),  # H1 + H2
    (2, 0, 1, 2 * sig(-2.0)),  # MRI = 1: H2 = 2σ(-1/0) = 0
    (2, 2, 2, 1 + 2 * sig(-1.0)),  # just activated: H1 = 2σ(0) = 1
    (5, 1, 4, 2 * sig(-1.0) + 2 * sig(-1 / 3)),
    (7, 3, 0, 0.0),  # never re-activated, elapsed > 0: H1 -> 0, no H2
    (3, 3, 0, 1.0),  # born (or activated) now, MRI 0: H1 = 1 only
])
def test_importance_eq2(t, ts, mri, expected):
    got = importance(t, torch.tensor([float(ts)]), torch.tensor([mri]))
    assert got.item() == pytest.approx(expected)


def state(p, layer):
    """(kept positions, TS, MRI) of a layer: the per-slot state the engine keeps."""
    pos, ts = slot_state(p, layer, "ts")
    pos_mri, mri = slot_state(p, layer, "mri")
    assert torch.equal(pos, pos_mri)
    return pos, ts, mri


def row(*p):
    return torch.tensor([list(p)])[:, None, :]  # [1, Hkv=1, n]


def test_hand_trace():
    """P = 3, W = 2, B = 3, α = 0.3; one kv head, rows are probabilities. Query at
    position q has t = q - 2: the prompt queries are t = -2, -1, 0."""
    p = build_policy({"name": "lazy_eviction", "budget": 3, "window": 2, "alpha": 0.3})
    prompt = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])[:, None, :]
    assert run_step(p, view([LayerView(positions=arange(3), attention=prompt)], 3, 3, 3, True)) == {}
    pos, ts, mri = state(p, 0)
    # token 0: born -2, active at -2, -1 -> MRI 1, TS -1; token 1: active -1, 0 -> MRI 1;
    # token 2: born and active at 0 -> MRI 0
    assert ts.tolist() == [-1, 0, 0] and mri.tolist() == [1, 1, 0]
    # t = 1: token 0 (0.4) and the new token 3 (0.4) are active
    assert run_step(p, view([LayerView(positions=arange(4), attention=row(.4, .1, .1, .4))],
                       4, 3)) == {}
    pos, ts, mri = state(p, 0)
    assert ts.tolist() == [1, 0, 0, 1] and mri.tolist() == [2, 1, 0, 0]
    # t = 2 = W: token 2 (0.35) and token 4 active; then evict: keep recent 3, 4 and the
    # top B - W = 1 of tokens 0, 1, 2 by I_2:
    #   0: TS 1, MRI 2 -> 2σ(-1/2) + 2σ(-1) = 1.293;  1: TS 0, MRI 1 -> 2σ(-2) = 0.238;
    #   2: TS 2, MRI 2 -> 1 + 2σ(-1) = 1.538
    plan = run_step(p, view([LayerView(positions=arange(5),
                                  attention=row(.05, .05, .35, .05, .5))], 5, 3))
    assert plan[0].tolist() == [0, 1]
    pos, ts, mri = state(p, 0)
    assert pos.tolist() == [2, 3, 4] and ts.tolist() == [2, 1, 2] and mri.tolist() == [2, 0, 0]
    # t = 3: over budget but not a multiple of W: nothing
    plan = run_step(p, view([LayerView(positions=torch.tensor([2, 3, 4, 5]),
                                  attention=row(.25, .25, .25, .25))], 6, 3))
    assert plan == {}


def test_chunked_prompt_tracks_like_one_chunk():
    g = torch.Generator().manual_seed(1)
    n = 12
    rows = torch.rand(n, 2, n, generator=g) * (arange(n)[None, :] <= arange(n)[:, None])[:, None]
    rows = rows / rows.sum(dim=(1, 2), keepdim=True) * 4  # H = 4: 2 kv heads x group 2
    cfg = {"name": "lazy_eviction", "budget": 6, "window": 3, "alpha": 0.08}
    one, two = build_policy(cfg), build_policy(cfg)
    run_step(one, view([LayerView(positions=arange(n), attention=rows)], n, n, n, True))
    run_step(two, view([LayerView(positions=arange(5), attention=rows[:5, :, :5])], 5, n, 5))
    run_step(two, view([LayerView(positions=arange(n), attention=rows[5:])], n, n, n - 5, True))
    for a, b in zip(state(one, 0), state(two, 0)):
        assert torch.equal(a, b)


def test_evicts_every_w_steps_down_to_budget():
    p = build_policy({"name": "lazy_eviction", "budget": 20, "window": 5, "alpha": 0.02})
    sim = Sim(p, num_layers=2)
    sim.step(30, prompt_len=30)  # a long prompt stays until t = W
    sizes = []
    for _ in range(23):
        plan = sim.step(1, prompt_len=30)
        t = sim.seq_len - 30
        assert bool(plan) == (t % 5 == 0)
        sizes.append(sim.counts()[0])
        assert all(int(live[-1]) == sim.seq_len - 1 for live in sim.live)
    assert sizes[4] == 20 and sizes[8] == 24 and sizes[9] == 20
    assert max(sizes) <= p.max_live(53, 30)
