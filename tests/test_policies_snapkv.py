"""snapkv: pooling, selection against kvpress SnapKVPress and SnapKV's SnapKVCluster
(reconstructed here), exact chunked accumulation, sinks, and prompt-only compression."""

import pytest
import torch
import torch.nn.functional as F

from policies.catalog import build_policy
from policies.snapkv import pool_scores
from tests.policy_views import LayerView, arange, causal_probs, group_sum, run_step, view


def test_pool_scores_avg_counts_zero_padding_and_max():
    x = torch.tensor([[1.0, 2, 3, 4, 5]])
    assert pool_scores(x, 5, "avg").tolist()[0] == pytest.approx([1.2, 2.0, 3.0, 2.8, 2.4])
    assert pool_scores(x, 5, "max").tolist() == [[3.0, 4.0, 5.0, 5.0, 5.0]]
    assert pool_scores(x, 1, "avg") is x


def prompt_probs(n, hkv, group, seed):
    g = torch.Generator().manual_seed(seed)
    pos = arange(n)
    logits = torch.randn(n, hkv * group, n, generator=g) * 2
    logits[:, :, 0] += 3  # a sink
    return causal_probs(logits, pos, pos)  # [q, H, n] per query head


def run_prompt(cfg, probs, hkv, chunks=None):
    """Feed the prompt in chunks; returns the plan of the completing step."""
    n = probs.shape[0]
    p = build_policy(cfg)
    chunks = chunks or [n]
    start, plan = 0, {}
    for size in chunks:
        end = start + size
        att = group_sum(probs[start:end, :, :end], hkv)
        plan = run_step(p, view([LayerView(positions=arange(end), attention=att)], end, n, size,
                           end == n))
        start = end
    return p, plan


def kvpress_snapkv_scores(probs, hkv, window, kernel):
    """SnapKVPress.score with attentions given: [b, H, q, k] -> [b, hkv, k] (window padded
    with max + 1)."""
    attn = probs.permute(1, 0, 2)[None]  # [1, H, q, n]
    n = attn.shape[-1]
    w = attn[..., -window:, :-window]
    scores = F.avg_pool1d(w.mean(dim=-2), kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(1, hkv, -1, n - window).mean(2)
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


@pytest.mark.parametrize("n,ratio,window,kernel,seed", [
    (64, 0.5, 8, 5, 0), (80, 0.7, 16, 7, 1), (50, 0.4, 4, 3, 2), (40, 0.5, 8, 1, 3)])
def test_matches_kvpress_snapkv_one_kv_head(n, ratio, window, kernel, seed):
    probs = prompt_probs(n, 1, 4, seed)
    n_kept = int(n * (1 - ratio))
    scores = kvpress_snapkv_scores(probs, 1, window, kernel)
    theirs = sorted(scores.topk(n_kept, dim=-1).indices[0, 0].tolist())
    cfg = {"name": "snapkv", "budget": n_kept, "obs_window": window, "kernel_size": kernel}
    _, plan = run_prompt(cfg, probs, 1)
    assert sorted(set(range(n)) - set(plan[0].tolist())) == theirs


def test_several_kv_heads_rank_by_head_mean_of_kvpress_score():
    n, window, hkv = 60, 8, 2
    probs = prompt_probs(n, hkv, 2, 5)
    scores = kvpress_snapkv_scores(probs, hkv, window, 5)[0, :, : n - window].mean(0)
    theirs = sorted(scores.topk(30 - window).indices.tolist() + list(range(n - window, n)))
    cfg = {"name": "snapkv", "budget": 30, "obs_window": window}
    _, plan = run_prompt(cfg, probs, hkv)
    assert sorted(set(range(n)) - set(plan[0].tolist())) == theirs


def test_matches_snapkv_cluster_maxpool():
    """SnapKVCluster.update_kv: window rows summed, max_pool1d, top (capacity - window)
    of the prefix, plus the window (one head here). Max pooling makes ties (a peak
    covers its neighbours); torch.topk orders ties arbitrarily, we keep the earlier
    position, so the kept sets agree up to equally-scored tokens."""
    n, window, cap = 48, 8, 20
    probs = prompt_probs(n, 1, 1, 9)
    attn = probs.permute(1, 0, 2)[None]
    summed = attn[..., -window:, :-window].sum(dim=-2)
    pooled = F.max_pool1d(summed, kernel_size=7, padding=3, stride=1)[0, 0]
    top = pooled.topk(cap - window).indices.tolist()
    cfg = {"name": "snapkv", "budget": cap, "obs_window": window, "kernel_size": 7,
           "pooling": "max"}
    _, plan = run_prompt(cfg, probs, 1)
    ours = sorted(set(range(n - window)) - set(plan[0].tolist()))
    assert set(range(n - window, n)).isdisjoint(plan[0].tolist())  # window kept
    assert sorted(pooled[ours].tolist()) == sorted(pooled[top].tolist())
    # the threshold score is shared; everything strictly above it is in both sets
    cut = min(pooled[top].tolist())
    assert {i for i in top if pooled[i] > cut} == {i for i in ours if pooled[i] > cut}


@pytest.mark.parametrize("chunks", [[40, 24], [60, 3, 1], [10] * 6 + [4], [1] * 64])
def test_chunked_prefill_equals_one_shot(chunks):
    probs = prompt_probs(64, 2, 2, 4)
    cfg = {"name": "snapkv", "budget": 24, "obs_window": 8}
    _p1, one = run_prompt(cfg, probs, 2)
    p2, many = run_prompt(cfg, probs, 2, chunks)
    assert one[0].tolist() == many[0].tolist()
    assert p2.needs.attention is False  # nothing more to observe


def test_sinks_pinned_and_small_budgets():
    n = 30
    probs = prompt_probs(n, 1, 1, 6)
    probs[:, :, :2] = 0  # sinks get no attention at all
    _, plan = run_prompt({"name": "snapkv", "budget": 12, "obs_window": 4, "sink": 2}, probs, 1)
    left = sorted(set(range(n)) - set(plan[0].tolist()))
    assert left[:2] == [0, 1] and left[-4:] == [26, 27, 28, 29] and len(left) == 12
    # budget below sink + window: sinks, then the most recent
    _, plan = run_prompt({"name": "snapkv", "budget": 5, "obs_window": 4, "sink": 2}, probs, 1)
    assert sorted(set(range(n)) - set(plan[0].tolist())) == [0, 1, 27, 28, 29]


def test_compresses_prompt_once_generated_tokens_stay():
    n = 40
    probs = prompt_probs(n, 1, 1, 8)
    p, plan = run_prompt({"name": "snapkv", "budget": 16, "obs_window": 4}, probs, 1)
    live = arange(n)[~torch.isin(arange(n), plan[0])]
    for t in range(5):
        live = torch.cat([live, torch.tensor([n + t])])
        assert run_step(p, view([LayerView(positions=live)], n + t + 1, n)) == {}
    # envelope: prefill chunks may hold up to n - 1 tokens, then 16 + generated
    assert p.max_live(n + 5, n) == n - 1 and p.max_live(n + 30, n) == 16 + 30
    assert p.max_live(n + 5) == n + 5  # unknown prompt length: no bound
