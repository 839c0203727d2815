"""LazyEviction's `select` (every row at once, its clocks per request) against a
token-by-token reference written straight from 004 eq. 1 and Alg. 1."""

from __future__ import annotations

import pytest
import torch

from policies import base
from policies.catalog import build_policy
from policies.lazy_eviction import importance
from tests import policy_views
from tests.policy_views import LayersView, Sim, slot_state


def _drop_lowest_ref(scores: list[float], pos: list[int], keep: int, recent: int) -> list[int]:
    """The most recent `recent` stay, then the keep - recent highest of the others (a
    stable sort: among equal scores the earlier token stays); the rest go."""
    free = list(range(len(pos) - recent))
    kept = set(sorted(free, key=lambda i: -scores[i])[: max(0, keep - recent)])
    return [pos[i] for i in free if i not in kept]


class _LazyReference:
    """LazyEviction one layer and one token at a time, straight from 004 eq. 1 and
    Alg. 1: per layer {position: (TS, MRI)}, each query row in time order."""

    def __init__(self, cfg: dict) -> None:
        self.c = build_policy(cfg).config
        self.tracked: dict[int, dict[int, tuple[int, int]]] = {}
        self.epoch = 0

    def step(self, v: LayersView) -> dict[int, list[int]]:
        c, prompt = self.c, v.prompt_len
        t_now = v.seq_len - prompt
        epoch = t_now // c.window if t_now >= c.window else 0
        # every prompt chunk's end (t <= 0: bounded prefill), then t = kW
        decide, self.epoch = t_now <= 0 or epoch > self.epoch, max(epoch, self.epoch)
        budget = base.resolve_budget(c.budget, max(v.seq_len, prompt))
        plan = {}
        for layer, lv in enumerate(v.layers):
            old = self.tracked.get(layer, {})
            pos = lv.positions.tolist()
            st = {p: old.get(p, (p - prompt + 1, 0)) for p in pos}  # born: TS = own t
            mass = base.head_mean(lv.attention).tolist()
            for i, row in enumerate(mass):
                q = v.seq_len - v.num_new + i
                t = q - prompt + 1
                for p, a in zip(pos, row):
                    if p <= q and a >= c.alpha:  # activated: eq. 1
                        ts, mri = st[p]
                        st[p] = (t, max(mri, t - ts))
            n = len(pos)
            if decide and n > budget:
                ts = torch.tensor([float(st[p][0]) for p in pos], dtype=torch.float64)
                mri = torch.tensor([st[p][1] for p in pos])
                recent = min(c.window, n)
                drop = _drop_lowest_ref(importance(t_now, ts, mri).tolist(), pos,
                                        max(budget, recent), recent)
                if drop:
                    plan[layer] = drop
                    st = {p: x for p, x in st.items() if p not in drop}
            self.tracked[layer] = st
        return plan


@pytest.mark.parametrize("cfg", [
    {"name": "lazy_eviction", "budget": 20, "window": 4, "alpha": 0.02},
    {"name": "lazy_eviction", "budget": 0.5, "window": 3, "alpha": 0.05},
    {"name": "lazy_eviction", "budget": 2, "window": 5, "alpha": 0.01},  # B < W
], ids=lambda c: f"B{c['budget']}-W{c['window']}")
def test_lazy_eviction_rows_equal_token_by_token_reference(cfg, monkeypatch):
    """`select` (every layer as a row, one op per stage, TS and MRI as per-slot state)
    against the token-by-token reference, plans and tracked (TS, MRI) exactly, through
    prompt chunks and decode."""
    fast, ref = build_policy(cfg), _LazyReference(cfg)
    sim = Sim(fast, num_layers=4, seed=9)
    seen: list[LayersView] = []
    real = policy_views.run_step

    def spying(policy, v):
        seen.append(v)
        return real(policy, v)

    monkeypatch.setattr(policy_views, "run_step", spying)
    for n in [12, 12, 6] + [1] * 45 + [3] + [1] * 10:
        got = {k: v.tolist() for k, v in sim.step(n, 30).items()}
        assert got == ref.step(seen[-1])
        for layer in range(4):
            pos, ts = slot_state(fast, layer, "ts")
            _, mri = slot_state(fast, layer, "mri")
            want = ref.tracked[layer]
            assert pos.tolist() == sorted(want)
            assert ts.tolist() == [want[p][0] for p in pos.tolist()]
            assert mri.tolist() == [want[p][1] for p in pos.tolist()]
    assert any(len(ref.tracked[layer]) < sim.seq_len for layer in range(4))
