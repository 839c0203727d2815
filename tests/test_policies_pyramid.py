"""pyramid (KV-X, 002 §3.1-3.3): per-layer budgets (eq. 2, kvpress PyramidKVPress's
end points), lambda mask (eqs. 5-6), top-k middle by observation-window attention, at
the end of the prompt and during decode."""

import itertools

import pytest
import torch

from policies.catalog import build_policy
from policies.pyramid import layer_budgets
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


def kvpress_layer_budget(q_len, ratio, window, beta, num_layers, layer):
    """PyramidKVPress.get_layer_budget, reconstructed (float arithmetic)."""
    max_capacity_prompt = window + q_len * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return round(q_len * (1 - ratio))
    steps = (max_num - min_num) / (num_layers - 1)
    return round(max_num - layer * steps)


@pytest.mark.parametrize("q_len,ratio,window,beta,layers", [
    (1000, 0.5, 64, 20, 32), (1000, 0.75, 32, 20, 28), (1000, 0.25, 64, 20, 32),
    (4096, 0.5, 64, 20, 32), (200, 0.5, 64, 20, 8), (1000, 0.5, 64, 5, 16),
    (2048, 0.875, 32, 4, 24)])
def test_budgets_match_kvpress(q_len, ratio, window, beta, layers):
    total = round(q_len * (1 - ratio))
    ours = layer_budgets(total, q_len, layers, beta, window)
    theirs = [kvpress_layer_budget(q_len, ratio, window, beta, layers, i) for i in range(layers)]
    assert ours == theirs


@pytest.mark.parametrize("total,n,layers,beta,window", [
    (1024, 8192, 32, 20, 32), (500, 1000, 32, 20, 64), (300, 5000, 7, 3, 16),
    (777, 3000, 13, 20, 32), (100, 180, 5, 2, 8)])
def test_budgets_are_arithmetic_with_uniform_total(total, n, layers, beta, window):
    b = layer_budgets(total, n, layers, beta, window)
    assert sum(b) == layers * total  # eq. 1: same total as a uniform budget
    assert b == sorted(b, reverse=True)  # more at the bottom (002 §3.1)
    steps = [x - y for x, y in itertools.pairwise(b)]
    assert max(steps) - min(steps) <= 1  # eq. 2 up to rounding
    assert b[0] > b[-1]


def test_budget_end_points():
    # C = 1024, β = 20: C_L = 51.2, C_1 = 1996.8 (no clamp at n = 8192)
    b = layer_budgets(1024, 8192, 32, 20, 32)
    assert (b[0], b[-1]) == (1997, 51)
    # clamp: C_1 = n - window, C_L = 2C - C_1
    b = layer_budgets(600, 1000, 4, 20, 64)
    assert (b[0], b[-1]) == (936, 264)
    # fallback to uniform when C_L < window
    assert layer_budgets(100, 1000, 4, 20, 64) == [100] * 4
    assert layer_budgets(100, 1000, 1, 20, 64) == [100]


def test_kept_sets_match_kvpress_when_lambda_tokens_rank_top():
    """One kv head, kernel 1 (the scores are then kvpress's exactly). Per layer the
    first and last floor(C_l/(2ω)) tokens get large attention, as sinks and recent
    tokens do in real models: kvpress (window pinned, top-k of the rest) and KV-X
    (lambda mask pinned, top-k middle) then keep the same tokens."""
    n, layers, window, omega, beta, total = 128, 4, 4, 2.0, 2, 48
    budgets = layer_budgets(total, n, layers, beta, window)
    assert budgets == [72, 56, 40, 24]
    pos = arange(n)
    g = torch.Generator().manual_seed(0)
    views, theirs = [], []
    for c_l in budgets:
        edge = int(c_l // (2 * omega))
        logits = torch.randn(n, 2, n, generator=g)
        logits[:, :, :edge] += 10
        logits[:, :, n - edge:] += 10
        probs = causal_probs(logits, pos, pos)  # [q, H=2, n], one kv group of 2
        attn = probs.permute(1, 0, 2)[None]
        s = attn[..., -window:, :-window].mean(-2).mean(1)  # kernel 1, group mean
        s = torch.nn.functional.pad(s, (0, window), value=s.max().item() + 1)
        theirs.append(sorted(s.topk(c_l, dim=-1).indices[0].tolist()))
        views.append(LayerView(positions=pos, attention=group_sum(probs, 1)))
    p = build_policy({"name": "pyramid", "budget": total, "beta": beta, "omega": omega,
                      "obs_window": window})
    plan = run_step(p, view(views, n, n, n, True))
    for layer in range(layers):
        assert sorted(set(range(n)) - set(plan[layer].tolist())) == theirs[layer]


def test_lambda_mask_pins_sink_and_streaming_tokens():
    n = 64
    pos = arange(n)
    att = torch.full((n, 1, n), 1.0)
    att[:, :, :8] = 0  # the first tokens get nothing
    att[:, :, 50:] = 0  # nor do the last ones
    att[:, :, 20] = 5.0
    att = att * (pos[None, :] <= pos[:, None])[:, None, :]  # causal
    p = build_policy({"name": "pyramid", "budget": 16, "omega": 4.0, "obs_window": 8})
    plan = run_step(p, view([LayerView(positions=pos, attention=att)], n, n, n, True))
    left = sorted(set(range(n)) - set(plan[0].tolist()))
    # one layer: C_0 = 16; sink = streaming = floor(16 / 8) = 2; 12 middle by score
    assert left[:2] == [0, 1] and left[-2:] == [62, 63] and 20 in left and len(left) == 16


def test_decode_keeps_layer_budgets_with_a_sliding_window():
    cfg = {"name": "pyramid", "budget": 40, "beta": 4, "obs_window": 8, "kernel_size": 3}
    p = build_policy(cfg)
    sim = Sim(p, num_layers=4, hkv=2, group=2)
    sim.step(50, prompt_len=120)
    assert sim.counts() == [50] * 4  # prompt not complete: nothing yet
    sim.step(70, prompt_len=120)
    assert sim.counts() == p.budgets(120, 4)
    for _ in range(30):
        sim.step(1, prompt_len=120)
        assert sim.counts() == p.budgets(sim.seq_len, 4)
        for i in range(4):  # each kept token's window: the last 8 queries' mass
            (name,) = p.state
            pos, window = slot_state(p, i, name)
            assert pos.tolist() == sim.live[i].tolist()
            assert window.shape == (sim.counts()[i], 8)
            # the newest token: one query saw it, in that query's column of the ring
            assert int((window[-1] != 0).sum()) <= 1
            assert float(window[-1, (sim.seq_len - 1) % 8]) == float(window[-1].sum())
        for live, c_l in zip(sim.live, p.budgets(sim.seq_len, 4)):
            edge = c_l // 8
            assert live[:edge].tolist() == list(range(edge))  # sinks stay
            assert live[-edge:].tolist() == list(range(sim.seq_len - edge, sim.seq_len))


def test_budgets_past_the_clamp_do_not_depend_on_the_length():
    """layer_budgets folds every length past s* = 2C - ceil(C/β) + window + 1 into one
    cache entry: the uncached formula must agree at and around that point."""
    from policies.pyramid import _layer_budgets

    for total, beta, window, layers in [(1024, 20, 32, 4), (100, 3, 8, 5), (777, 20, 64, 13)]:
        s_star = 2 * total - -(-total // beta) + window + 1
        for n in range(s_star - 3, s_star + 40):
            assert layer_budgets(total, n, layers, beta, window) == \
                list(_layer_budgets.__wrapped__(total, n, layers, beta, window)), (total, n)


def _fraction_budgets(total: int, seq_len: int, num_layers: int, beta: int,
                      window: int) -> list[int]:
    """layer_budgets as 002 eq. 2 reads, in exact rationals (the form it replaced)."""
    from fractions import Fraction

    if num_layers == 1:
        return [total]
    c_min = Fraction(total, beta)
    c_max = 2 * total - c_min
    if c_max >= seq_len - window:
        c_max = Fraction(seq_len - window)
        c_min = 2 * total - c_max
    if not (seq_len >= c_max >= c_min >= window):
        return [total] * num_layers
    step = (c_max - c_min) / (num_layers - 1)
    return [round(c_max - layer * step) for layer in range(num_layers)]


def test_integer_budgets_are_the_rational_ones():
    """The integer arithmetic (over a common denominator, halves to even) gives the
    exact-rational budgets everywhere, across the clamp and the uniform fallback."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        total = rng.randrange(1, 3000)
        args = (total, rng.randrange(1, 4 * total + 100), rng.randrange(1, 40),
                rng.randrange(1, 30), rng.randrange(0, 200))
        assert layer_budgets(*args) == _fraction_budgets(*args), args
