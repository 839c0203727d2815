"""The per-step fast paths of the scoring policies against the general paths they
replace, on inputs where both apply: top-k selection vs the stable sort, append-only
`align` vs searchsorted, and LazyEviction's all-layers-at-once step vs its layer loop."""

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
from tests.policy_views import Sim


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


@pytest.mark.parametrize("cfg", [
    {"name": "lazy_eviction", "budget": 20, "window": 4, "alpha": 0.02},
    {"name": "lazy_eviction", "budget": 0.5, "window": 3, "alpha": 0.05},
    {"name": "lazy_eviction", "budget": 2, "window": 5, "alpha": 0.01},  # B < W
], ids=lambda c: f"B{c['budget']}-W{c['window']}")
def test_lazy_eviction_all_layers_at_once_equals_layer_by_layer(cfg, monkeypatch):
    """The stacked step (one op per stage for all layers) against the per-layer loop,
    plans and tracked (TS, MRI) bit for bit, through prompt chunks and decode."""
    ref, fast = build_policy(cfg), build_policy(cfg)
    sim_ref, sim_fast = Sim(ref, num_layers=4, seed=9), Sim(fast, num_layers=4, seed=9)
    for n in [12, 12, 6] + [1] * 45 + [3] + [1] * 10:
        got = {k: v.tolist() for k, v in sim_fast.step(n, 30).items()}
        with monkeypatch.context() as m:
            m.setattr(StepView, "stacked", lambda self, name: None)
            want = {k: v.tolist() for k, v in sim_ref.step(n, 30).items()}
        assert got == want
        for layer in range(4):
            for a, b in zip(ref.state(layer), fast.state(layer)):
                assert a.dtype == b.dtype and torch.equal(a, b)
    assert any(ref.state(layer)[0].numel() < sim_ref.seq_len for layer in range(4))
