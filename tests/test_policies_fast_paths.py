"""The per-step fast paths of the scoring policies against the general paths they
replace, on inputs where both apply: top-k selection vs the stable sort, append-only
`align` vs searchsorted, and LazyEviction's `select` (all rows at once) vs a
token-by-token reference."""

from __future__ import annotations

import math

import pytest
import torch

from policies import base
from policies.base import (
    StepView,
    align,
    align_rows,
    edge_mask,
    evict_except,
    evict_except_index,
    keep_top,
    lowest_index_rows,
)
from policies.catalog import build_policy
from policies.lazy_eviction import importance
from tests import policy_views
from tests.policy_views import Sim, slot_state


def _sorted_lowest(scores: torch.Tensor, d: int) -> torch.Tensor:
    """The reference: the last d of a stable descending sort, ascending."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return order[:, scores.shape[1] - d:].sort(dim=1).values


def _scores(kind: str, rows: int, m: int, g: torch.Generator) -> torch.Tensor:
    if kind == "ties":
        return torch.randint(0, 4, (rows, m), generator=g).float()
    x = torch.randn((rows, m), generator=g)
    if kind == "inf":
        x[:, ::3] = math.inf
        x[:, 1::5] = -math.inf
    if kind == "nan":
        x[0, ::4] = math.nan
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "inf", "nan"])
@pytest.mark.parametrize("m", [1, 2, 7, 100])
def test_lowest_index_rows_equals_stable_sort(kind, m):
    g = torch.Generator().manual_seed(m)
    for rows in (1, 4):
        scores = _scores(kind, rows, m, g)
        for d in sorted({0, 1, 2, 3, m // 2, m - 1, m, base._TOPK_MAX + 1} & set(range(m + 1))):
            got = lowest_index_rows(scores, d)
            assert torch.equal(got, _sorted_lowest(scores, d)), (kind, rows, m, d)


@pytest.mark.parametrize("kind", ["random", "ties", "inf"])
def test_keep_top_and_edges_by_index_equal_evict_except(kind):
    g = torch.Generator().manual_seed(3)
    for n in (1, 5, 40):
        scores = _scores(kind, 1, n, g)[0]
        pos = torch.sort(torch.randperm(4 * n, generator=g)[:n]).values
        for keep in range(1, n + 2):
            order = torch.sort(scores, descending=True, stable=True).indices
            assert torch.equal(keep_top(scores, pos, keep), pos[order[keep:]].sort().values)
            for first, last in [(0, 0), (0, 1), (2, 2), (0, 7), (3, 0), (keep // 2, keep // 2)]:
                want = evict_except(scores, pos, keep, edge_mask(n, first, last))
                got = pos[evict_except_index(scores, keep, first, last)]
                assert torch.equal(got, want), (n, keep, first, last)


def _no_append_path(monkeypatch) -> None:
    monkeypatch.setattr(base, "_appended", lambda old, new: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_align_of_appended_positions_equals_search(dtype, monkeypatch):
    g = torch.Generator().manual_seed(1)
    old_pos = torch.sort(torch.randperm(100, generator=g)[:30]).values
    old_val = (torch.randn((30, 3), generator=g) * 10).to(dtype)
    cases = [torch.cat([old_pos, torch.arange(100, 100 + k)]) for k in (0, 1, 4)]
    cases.append(old_pos[1:])  # evicted since: not an append
    cases.append(torch.cat([old_pos[:-1], torch.tensor([100])]))
    for new_pos in cases:
        got = align(old_pos, old_val, new_pos, fill=-1)
        with monkeypatch.context() as m:
            _no_append_path(m)
            want = align(old_pos, old_val, new_pos, fill=-1)
        assert got.dtype == want.dtype and torch.equal(got, want)
    rows_old = torch.stack([old_pos, old_pos + 1])
    rows_val = torch.stack([old_val[:, 0], old_val[:, 1]])
    for k in (0, 1, 3):
        new = torch.cat([rows_old, torch.arange(200, 200 + k).expand(2, k)], dim=1)
        for new_pos in (new, new.flip(0)):  # an append, then rows that differ
            got = align_rows(rows_old, rows_val, new_pos, fill=7)
            with monkeypatch.context() as m:
                _no_append_path(m)
                want = align_rows(rows_old, rows_val, new_pos, fill=7)
            assert torch.equal(got, want)


class _LazyReference:
    """LazyEviction one layer and one token at a time, straight from 004 eq. 1 and
    Alg. 1: per layer {position: (TS, MRI)}, each query row in time order."""

    def __init__(self, cfg: dict) -> None:
        self.c = build_policy(cfg).config
        self.tracked: dict[int, dict[int, tuple[int, int]]] = {}
        self.epoch = 0

    def step(self, v: StepView) -> dict[int, list[int]]:
        c, prompt = self.c, v.prompt_len
        t_now = v.seq_len - prompt
        epoch = t_now // c.window if t_now >= c.window else 0
        decide, self.epoch = epoch > self.epoch, max(epoch, self.epoch)
        budget = base.resolve_budget(c.budget, v.seq_len)
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
                drop = evict_except(importance(t_now, ts, mri), lv.positions,
                                    max(budget, recent), edge_mask(n, 0, recent)).tolist()
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
    seen: list[StepView] = []
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
