"""h2o (cumulative attention, 003 H2OEviction) and tova (current attention; kvpress
TOVAPress reconstructed here)."""

import pytest
import torch

from policies.base import head_mean
from policies.catalog import build_policy
from tests.policy_views import (
    LayerView,
    Sim,
    arange,
    causal_probs,
    group_sum,
    run_step,
    slot_state,
    view,
)


def lv(positions, rows):
    """One kv head, group 1: rows [Tq, n] are the per-query probabilities."""
    return LayerView(positions=torch.tensor(positions), attention=torch.tensor(rows)[:, None, :])


def test_h2o_accumulates_over_prefill_chunks_and_decode():
    p = build_policy({"name": "h2o", "budget": 3, "window": 1})
    # chunk 1: queries 0, 1 over tokens 0, 1
    assert run_step(p, view([lv([0, 1], [[1.0, 0.0], [0.6, 0.4]])], 2, 4, 2)) == {}
    pos, acc = slot_state(p, 0, "acc")
    assert acc.tolist() == pytest.approx([1.6, 0.4])
    # chunk 2 completes the prompt: queries 2, 3 over tokens 0..3
    plan = run_step(p, view([lv([0, 1, 2, 3], [[0.5, 0.1, 0.4, 0.0], [0.2, 0.3, 0.1, 0.4]])],
                       4, 4, 2, True))
    # acc = [2.3, 0.8, 0.5, 0.4]; window keeps 3; top 2 older: 0, 1
    assert plan[0].tolist() == [2]
    # decode: token 4; acc = [2.4, 1.3, 0.5 (gone), 0.4 + 0.1, 0.3]
    plan = run_step(p, view([lv([0, 1, 3, 4], [[0.1, 0.5, 0.1, 0.3]])], 5, 4, 1))
    assert plan[0].tolist() == [3]
    pos, acc = slot_state(p, 0, "acc")
    assert pos.tolist() == [0, 1, 4] and acc.tolist() == pytest.approx([2.4, 1.3, 0.3])


def test_h2o_and_tova_evict_between_prompt_chunks():
    """Bounded prefill (issue 20): a chunk that leaves a layer above the budget the
    prompt's end will have is cut to it at once, by what the prompt has shown so far;
    the next chunk's queries never see the dropped token, and its score is gone."""
    h2o = build_policy({"name": "h2o", "budget": 2, "window": 1})
    chunk1 = [[1.0, 0.0, 0.0], [0.7, 0.3, 0.0], [0.2, 0.1, 0.7]]  # acc [1.9, 0.4, 0.7]
    plan = run_step(h2o, view([lv([0, 1, 2], chunk1)], 3, 6, 3))
    assert plan[0].tolist() == [1]  # window: 2; heaviest older: 0
    # chunk 2 completes the prompt: tokens 0, 2 and the new 3..5
    plan = run_step(h2o, view([lv([0, 2, 3, 4, 5], [[0.1, 0.1, 0.8, 0.0, 0.0],
                                                    [0.1, 0.5, 0.2, 0.2, 0.0],
                                                    [0.3, 0.1, 0.2, 0.3, 0.1]])], 6, 6, 3, True))
    # acc 0: 2.4, 2: 1.4, 3: 1.2, 4: 0.5, 5: 0.1 -> window 5 + heaviest older 0
    assert plan[0].tolist() == [2, 3, 4]
    pos, acc = slot_state(h2o, 0, "acc")
    assert pos.tolist() == [0, 5] and acc.tolist() == pytest.approx([2.4, 0.1])

    tova = build_policy({"name": "tova", "budget": 0.25})  # C = 2 of an 8-token prompt
    plan = run_step(tova, view([lv([0, 1, 2], chunk1)], 3, 8, 3))
    assert plan[0].tolist() == [1]  # the chunk's last query: 0.2, 0.1, 0.7 (newest pinned)
    assert run_step(tova, view([lv([0, 2], [[1.0, 0.0], [0.5, 0.5]])], 3, 8, 2)) == {}  # C


def test_h2o_sums_all_heads():
    p = build_policy({"name": "h2o", "budget": 2, "window": 0})
    att = torch.tensor([[[0.1, 0.8, 0.1], [0.7, 0.0, 0.3]]])  # [Tq=1, Hkv=2, n=3]
    plan = run_step(p, view([LayerView(positions=arange(3), attention=att)], 3, 3, 1, True))
    assert plan[0].tolist() == [2]  # sums 0.8, 0.8, 0.4 -> ties keep the earlier


def kvpress_tova_kept(attn_bhqn: torch.Tensor, num_kv: int, ratio: float) -> list[int]:
    """TOVAPress.score: last query's attention (all but itself) averaged over heads,
    repeated per kv head, the last token padded with max + 1; keep top int(n(1-r))."""
    scores = attn_bhqn[..., -1:, :-1].mean(1).repeat(1, num_kv, 1)
    scores = torch.nn.functional.pad(scores, (0, 1), value=scores.max().item() + 1)
    n = scores.shape[-1]
    idx = scores.topk(int(n * (1 - ratio)), dim=-1).indices
    assert all(set(r.tolist()) == set(idx[0, 0].tolist()) for r in idx[0])
    return sorted(idx[0, 0].tolist())


@pytest.mark.parametrize("n,ratio,hkv,group,seed", [
    (32, 0.5, 1, 1, 0), (40, 0.25, 2, 2, 1), (25, 0.6, 4, 2, 2)])
def test_tova_prefill_matches_kvpress(n, ratio, hkv, group, seed):
    g = torch.Generator().manual_seed(seed)
    pos = arange(n)
    probs = causal_probs(torch.randn(n, hkv * group, n, generator=g) * 2, pos, pos)
    theirs = kvpress_tova_kept(probs.permute(1, 0, 2)[None], hkv, ratio)
    p = build_policy({"name": "tova", "budget": int(n * (1 - ratio))})
    plan = run_step(p, view([LayerView(positions=pos, attention=group_sum(probs, hkv))], n, n, n,
                       True))
    assert sorted(set(range(n)) - set(plan[0].tolist())) == theirs


def test_tova_decode_drops_least_attended_now_and_pins_newest():
    p = build_policy({"name": "tova", "budget": 3})
    # the newest token (5) gets the least attention but is pinned
    att = torch.tensor([[0.5, 0.05, 0.2, 0.24, 0.01]])[:, None, :]
    plan = run_step(p, view([LayerView(positions=torch.tensor([0, 1, 3, 4, 5]), attention=att)],
                       6, 3, 1))
    assert sorted(plan[0].tolist()) == [1, 3]  # keep 0 (0.5), 4 (0.24) and the newest 5


def test_head_mean_is_a_distribution():
    g = torch.Generator().manual_seed(3)
    pos = arange(9)
    probs = causal_probs(torch.randn(4, 6, 9, generator=g), pos[-4:], pos)
    mean = head_mean(group_sum(probs, 3))
    assert torch.allclose(mean, probs.mean(dim=1), atol=1e-6)


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_decode_holds_budget(name):
    sim = Sim(build_policy({"name": name, "budget": 10, "window": 3} if name == "h2o"
                           else {"name": name, "budget": 10}))
    sim.step(7, 15)
    sim.step(8, 15)
    assert sim.counts() == [10, 10, 10]
    for _ in range(6):
        sim.step(1, 15)
        assert sim.counts() == [10, 10, 10]
    assert all(int(p[-1]) == sim.seq_len - 1 for p in sim.live)  # newest kept
