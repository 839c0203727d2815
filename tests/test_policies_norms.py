"""knorm and keydiff against kvpress's score formulas (KnormPress, KeyDiffPress),
reconstructed here in plain torch on synthetic keys, plus their decode behaviour."""

import pytest
import torch
import torch.nn.functional as F

from policies.catalog import build_policy
from tests.policy_views import LayerView, Sim, arange, run_step, view


def kvpress_knorm(keys_bhnd: torch.Tensor) -> torch.Tensor:
    return -keys_bhnd.norm(dim=-1)  # KnormPress.score: [b, h, n]


def kvpress_keydiff(keys_bhnd: torch.Tensor) -> torch.Tensor:
    anchor = F.normalize(keys_bhnd, p=2, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(keys_bhnd, anchor, dim=-1)  # KeyDiffPress.score


def kvpress_kept(scores: torch.Tensor, ratio: float) -> list[list[int]]:
    """ScorerPress.compress: top int(n(1-r)) per kv head."""
    n = scores.shape[-1]
    idx = scores.topk(int(n * (1 - ratio)), dim=-1).indices[0]
    return [sorted(row.tolist()) for row in idx]


def our_kept(name: str, keys_nhd: torch.Tensor, budget: int) -> list[int]:
    n = keys_nhd.shape[0]
    p = build_policy({"name": name, "budget": budget})
    lv = LayerView(positions=arange(n), key_norm=keys_nhd.norm(dim=-1), keys=keys_nhd)
    plan = run_step(p, view([lv], n, n, n, True))
    return [i for i in range(n) if i not in set(plan.get(0, torch.empty(0)).tolist())]


@pytest.mark.parametrize("name,score", [("knorm", kvpress_knorm), ("keydiff", kvpress_keydiff)])
@pytest.mark.parametrize("n,ratio,seed", [(64, 0.5, 0), (50, 0.3, 1), (37, 0.75, 2)])
def test_one_kv_head_matches_kvpress_exactly(name, score, n, ratio, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, 1, 16, generator=g) * torch.rand(n, 1, 1, generator=g) * 3
    keys[:, :, 0] += 2.0  # a shared direction, so keydiff has something to find
    theirs = kvpress_kept(score(keys.permute(1, 0, 2)[None]), ratio)[0]
    assert our_kept(name, keys, int(n * (1 - ratio))) == theirs


@pytest.mark.parametrize("name,score", [("knorm", kvpress_knorm), ("keydiff", kvpress_keydiff)])
def test_several_kv_heads_rank_by_head_mean_of_kvpress_score(name, score):
    g = torch.Generator().manual_seed(7)
    n = 40
    keys = torch.randn(n, 4, 8, generator=g) * torch.rand(n, 4, 1, generator=g)
    s = score(keys.permute(1, 0, 2)[None])[0].mean(dim=0)  # [n]
    theirs = sorted(s.topk(20).indices.tolist())
    assert our_kept(name, keys, 20) == theirs


def test_knorm_keeps_lowest_norms_and_protected_window():
    n = 10
    norms = torch.tensor([1.0, 9, 2, 8, 3, 7, 4, 6, 5, 10])[:, None]
    p = build_policy({"name": "knorm", "budget": 5, "window": 2})
    plan = run_step(p, view([LayerView(positions=arange(n), key_norm=norms)], n, n, n, True))
    # window keeps 8, 9; then the 3 lowest norms among 0..7: positions 0, 2, 4
    assert sorted(set(range(n)) - set(plan[0].tolist())) == [0, 2, 4, 8, 9]


@pytest.mark.parametrize("name", ["knorm", "keydiff"])
def test_decode_keeps_exactly_budget_one_per_step(name):
    p = build_policy({"name": name, "budget": 12})
    sim = Sim(p, num_layers=2)
    assert sim.step(8, prompt_len=20) == {}  # prompt not complete: nothing
    sim.step(12, prompt_len=20)
    assert sim.counts() == [12, 12]
    for _ in range(5):
        plan = sim.step(1, prompt_len=20)
        assert all(d.numel() == 1 for d in plan.values())
        assert sim.counts() == [12, 12]


class Stateless:
    """knorm as it would plan with every live token's norm on every step: a fresh
    policy per step (no kept scores), always asking for `key_norm`."""

    def __init__(self, cfg: dict) -> None:
        self.cfg, self.needs = cfg, build_policy(cfg).needs

    @staticmethod
    def select(policies: list, view):
        fresh = build_policy(policies[0].cfg)
        view.state["score"] = torch.full(view.positions.shape, float("nan"))
        return type(fresh).select([fresh], view)


@pytest.mark.parametrize("cfg", [{"name": "knorm", "budget": 20, "window": 3},
                                 {"name": "knorm", "budget": 0.4}, {"name": "knorm", "budget": 40}],
                         ids=["tokens", "ratio", "budget-above-prompt"])
def test_knorm_kept_scores_plan_as_if_every_norm_were_read(cfg):
    """After its first plan knorm reads only the new tokens' norms and keeps the rest
    from earlier steps; the plans must be those of scoring every live key again, also
    when a layer loses tokens the policy did not choose (a sliding-window trim)."""
    cached = build_policy(cfg)
    a, b = Sim(cached, seed=5), Sim(Stateless(cfg), seed=5)
    for t, n in enumerate([12, 12, 6] + [1] * 70):
        if t == 40:  # another mechanism drops layer 0's oldest token in both
            for sim in (a, b):
                sim.live[0] = sim.live[0][1:]
        assert {k: v.tolist() for k, v in a.step(n, 30).items()} == \
            {k: v.tolist() for k, v in b.step(n, 30).items()}, t
        assert a.counts() == b.counts()
    assert cached.needs.new_key_norm and not cached.needs.key_norm  # it did switch


@pytest.mark.parametrize("cfg", [
    {"name": "knorm", "budget": 24},
    {"name": "knorm", "budget": 24, "window": 6},
    {"name": "knorm", "budget": 0.3, "window": 3},
    {"name": "paged_eviction", "budget": 24},
    {"name": "paged_eviction", "budget": 0.3},
])
@pytest.mark.parametrize("chunk", [5, 16, 24])
def test_prompt_chunks_keep_what_one_whole_prompt_plan_keeps(cfg, chunk):
    """Policies whose scores never change evict after every prompt chunk (bounded
    prefill) and still end the prompt with the kept set of a single plan over it — and
    then decode identically."""
    prompt = 100
    whole, chunked = Sim(build_policy(cfg), seed=3), Sim(build_policy(cfg), seed=3)
    whole.step(prompt, prompt)
    budget = build_policy(cfg).max_live(prompt, prompt, 4)
    done = 0
    while done < prompt:
        n = min(chunk, prompt - done)
        chunked.step(n, prompt)
        done += n
        assert max(chunked.counts()) <= budget  # bounded after every chunk's plan
    assert [p.tolist() for p in chunked.live] == [p.tolist() for p in whole.live]
    for _ in range(12):
        whole.step(1, prompt)
        chunked.step(1, prompt)
    assert [p.tolist() for p in chunked.live] == [p.tolist() for p in whole.live]
