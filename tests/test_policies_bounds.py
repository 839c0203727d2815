"""Property test: over random traces (chunked prefill of random sizes, then decode),
every policy's live count per layer stays within its documented `max_live`, plans only
name live positions, and `max_live` is non-decreasing in seq_len (the engine admits
requests against `max_live(prompt + max_tokens, prompt)`)."""

import random

import pytest

from policies.catalog import build_policy
from tests.policy_views import Sim

CONFIGS = [
    {"name": "full"},
    {"name": "streaming", "sink": 4, "window": 24},
    {"name": "streaming", "sink": 0, "window": 1},
    {"name": "lazy_streaming", "sink": 2, "window": 20, "compress_every": 6, "slack": 4,
     "max_drop": 5},
    {"name": "lazy_streaming", "sink": 4, "window": 10, "extra": 3, "compress_every": 3,
     "slack": 9, "max_drop": 0},
    {"name": "lazy_streaming", "sink": 1, "window": 10, "compress_every": 0},
    {"name": "paged_eviction", "budget": 30},
    {"name": "paged_eviction", "budget": 0.3},
    {"name": "knorm", "budget": 25, "window": 4},
    {"name": "keydiff", "budget": 0.4},
    {"name": "h2o", "budget": 30, "window": 8},
    {"name": "h2o", "budget": 0.25, "window": 40},
    {"name": "tova", "budget": 17},
    {"name": "tova", "budget": 0.5},
    {"name": "snapkv", "budget": 24, "obs_window": 8, "kernel_size": 5},
    {"name": "snapkv", "budget": 0.3, "obs_window": 6, "pooling": "max", "sink": 3},
    {"name": "pyramid", "budget": 30, "beta": 3, "obs_window": 4},
    {"name": "pyramid", "budget": 0.4, "beta": 20, "obs_window": 8, "kernel_size": 3,
     "omega": 2.0},
    {"name": "lazy_eviction", "budget": 25, "window": 6, "alpha": 0.02},
    {"name": "lazy_eviction", "budget": 0.5, "window": 4, "alpha": 0.05},
    {"name": "lazy_eviction", "budget": 3, "window": 8, "alpha": 0.05},  # B < W
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_live_tokens_within_max_live(cfg, seed):
    rng = random.Random(seed)
    policy = build_policy(cfg)
    bs = rng.choice([2, 4, 16])
    layers = 3
    sim = Sim(policy, num_layers=layers, hkv=2, group=2, block_size=bs, max_len=400,
              seed=seed)
    prompt = rng.randint(1, 150)
    total = prompt + rng.randint(1, 120)
    steps = []
    while sim.seq_len < prompt:
        steps.append(min(rng.randint(1, 64), prompt - sim.seq_len))
        sim.step(steps[-1], prompt)
        check(policy, sim, prompt, total, bs, layers)
    while sim.seq_len < total:
        sim.step(1, prompt)
        check(policy, sim, prompt, total, bs, layers)
    bounds = [policy.max_live(s, prompt, bs) for s in range(1, total + 1)]
    assert bounds == sorted(bounds)


def check(policy, sim, prompt, total, bs, layers):
    s = sim.seq_len
    bound = policy.max_live(s, prompt, bs)
    counts = sim.counts()
    assert max(counts) <= bound, (s, counts, bound)
    assert bound <= policy.max_live(total, prompt, bs)
    assert bound <= policy.max_live(s, None, bs) <= s
    if s >= prompt and hasattr(policy, "max_live_decoding"):  # the prompt is in
        after = policy.max_live_decoding(s, prompt, bs)
        assert max(counts) <= after <= bound and after <= policy.max_live_decoding(total, prompt, bs)
    if policy.name == "pyramid":
        summed = policy.max_live_total(s, prompt, bs, layers)
        assert sum(counts) <= summed <= policy.max_live_total(total, prompt, bs, layers)
        assert summed <= layers * bound
        if s >= prompt:
            assert all(c <= b for c, b in zip(counts, policy.budgets(s, layers)))
            after = policy.max_live_total(s, prompt, bs, layers, decoding=True)
            assert sum(counts) <= after <= summed
