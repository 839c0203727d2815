"""streaming (StreamingLLM) and lazy_streaming (000 Algorithm 1): exact kept sets."""

import pytest
import torch

from policies.catalog import build_policy
from policies.streaming import lazy_target
from tests.policy_views import LayerView, Sim, arange, run_step, view


def kept(plan_layer: torch.Tensor | None, positions: torch.Tensor) -> list[int]:
    if plan_layer is None:
        return positions.tolist()
    return positions[~torch.isin(positions, plan_layer)].tolist()


def test_streaming_keeps_sink_and_window():
    p = build_policy({"name": "streaming", "sink": 2, "window": 3})
    pos = arange(10)
    plan = run_step(p, view([LayerView(positions=pos)] * 2, 10, 10, 10, True))
    assert kept(plan[0], pos) == [0, 1, 7, 8, 9] and kept(plan[1], pos) == [0, 1, 7, 8, 9]
    # next decode step: one token in, the oldest non-sink one out
    pos = torch.tensor([0, 1, 7, 8, 9, 10])
    plan = run_step(p, view([LayerView(positions=pos)], 11, 10))
    assert plan[0].tolist() == [7]
    # under the cap: nothing
    assert run_step(p, view([LayerView(positions=arange(5))], 5, 10, 5)) == {}


def test_streaming_no_sink_and_order_only():
    """Only the order matters (rope: shift renumbers positions)."""
    p = build_policy({"name": "streaming", "sink": 0, "window": 2, "rope": "shift"})
    pos = torch.tensor([3, 9, 20, 21])
    assert run_step(p, view([LayerView(positions=pos)], 30, 5))[0].tolist() == [3, 9]


@pytest.mark.parametrize("n,ratio,n_sink", [(40, 0.5, 4), (33, 0.25, 4), (17, 0.75, 2)])
def test_streaming_matches_kvpress(n, ratio, n_sink):
    """kvpress StreamingLLMPress: scores 1, zeroed on [n_sink, n_sink + n_pruned), top
    int(n(1-r)) kept — reconstructed here; our window = n_kept - n_sink."""
    n_kept = int(n * (1 - ratio))
    n_pruned = n - n_kept
    scores = torch.ones(n)
    scores[n_sink: n_sink + n_pruned] = 0
    theirs = sorted(scores.topk(n_kept).indices.tolist())
    p = build_policy({"name": "streaming", "sink": n_sink, "window": n_kept - n_sink})
    plan = run_step(p, view([LayerView(positions=arange(n))], n, n, n, True))
    assert kept(plan[0], arange(n)) == theirs


def test_lazy_target_toy_example():
    """000 §3.4: (S, W, R, σ, δ) = (4, 2044, 32, 16, 32): C = 2048, H = 2064;
    L = 2090 (overflow 42) -> L* = min(max(2058, 2048), 2064) = 2058."""
    assert lazy_target(2090, 4, 2044, 0, 32, 16, 32) == 2058


@pytest.mark.parametrize("length,expected", [
    (2048, None),  # L <= C
    (2079, None),  # overflow 31 < R
    (2080, 2048),  # overflow = R: max(2080 - 32, 2048) = 2048
    (2100, 2064),  # max(2068, 2048) = 2068 capped at H = 2064
])
def test_lazy_target_cases(length, expected):
    assert lazy_target(length, 4, 2044, 0, 32, 16, 32) == expected


def test_lazy_target_delta_zero_r_zero_and_extra():
    assert lazy_target(2090, 4, 2044, 0, 32, 16, 0) == 2048  # δ = 0: straight to C
    assert lazy_target(10**6, 4, 2044, 0, 0, 16, 32) is None  # R = 0 disables
    # B = 10 raises C to 2058 (eq. 2): overflow 31 < R, then 32 = R
    assert lazy_target(2089, 4, 2044, 10, 32, 16, 32) is None
    assert lazy_target(2090, 4, 2044, 10, 32, 16, 32) == 2058


def test_lazy_streaming_toy_example_kept_set():
    p = build_policy("lazy_streaming")  # defaults are the toy example
    pos = arange(2090)
    plan = run_step(p, view([LayerView(positions=pos)], 2090, 100))
    left = kept(plan[0], pos)
    assert len(left) == 2058
    assert left == list(range(4)) + list(range(2090 - 2054, 2090))


def test_lazy_streaming_trace_is_staged_and_bounded():
    """Decode one token at a time from C: prune first at C + R, by δ each time, never
    above H afterwards (σ < R so it does not prune every step)."""
    cfg = {"name": "lazy_streaming", "sink": 2, "window": 8, "compress_every": 4,
           "slack": 3, "max_drop": 2}
    p = build_policy(cfg)
    sim = Sim(p, num_layers=1)
    sim.step(10, prompt_len=10)
    sizes = []
    for _ in range(20):
        plan = sim.step(1, prompt_len=10)
        sizes.append((sim.seq_len, sim.counts()[0], bool(plan)))
    # C = 10, H = 13: first prune at L = 14 -> max(12, 10) = 12; then at 14 again ...
    assert sizes[3] == (14, 12, True)
    assert all(n <= 13 for _, n, pruned in sizes if pruned)
    assert max(n for _, n, _ in sizes) <= p.max_live(100)
    assert p.max_live(100) == 10 + max(4 - 1, 3)
    assert sim.live[0][:2].tolist() == [0, 1]  # sinks survive
