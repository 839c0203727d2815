"""The policies' C++ state updates (`policies/csrc/state_cpu.cpp`) against their torch
forms: pyramid's window ring (`policies/pyramid.py::_window_ring`) and LazyEviction's
decode-step tracking (`policies/lazy_eviction.py::_tracked`), on slices of a larger
table (as the engine hands them, in place), with dead slots, NaN (unseen) activation
times, masses at the threshold and tokens after the query; and a policy run with and
without the ops keeps the same tokens."""

import math

import pytest
import torch

from policies import rows
from policies.lazy_eviction import LazyEvictionConfig, LazyEvictionPolicy, _track
from policies.pyramid import PyramidConfig, PyramidPolicy, _window_ring
from policies.rows import RowsView
from scheduler.policy_rows import load_select
from tests.policy_views import Sim


@pytest.fixture
def native():
    if not load_select() or not rows.NATIVE["state"]:
        pytest.skip("no C++ compiler")


def _positions(g: torch.Generator, n: int, w: int) -> torch.Tensor:
    pos = torch.arange(w).repeat(n, 1)
    pos[torch.rand(n, w, generator=g) < 0.3] = -1
    return pos


@pytest.mark.parametrize("seed", range(6))
def test_window_ring_matches_torch(seed, native, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    nl, r, big_r, w, a = 3, 4, 7, 40, [32, 5, 8][seed % 3]
    k = [0, 1, 3][seed % 3 if seed < 3 else (seed + 1) % 3]
    table = torch.rand(nl, big_r, w + 9, a, generator=g) ** 4
    n = nl * r
    pos = _positions(g, n, w)
    new = torch.rand(n, k, w, generator=g) * (pos >= 0)[:, None]
    cols = torch.stack([torch.randperm(a, generator=g)[:k] for _ in range(n)])
    want = seed != 4
    got_table = table.clone()
    got = _window_ring(got_table.narrow(1, 2, r).narrow(2, 0, w), new, cols, pos, want)
    monkeypatch.setitem(rows.NATIVE, "state", False)
    ref = _window_ring(table.narrow(1, 2, r).narrow(2, 0, w), new, cols, pos, want)
    assert torch.equal(got_table, table)  # written in place, nowhere else
    if want:
        assert torch.equal(got, ref)
        exact = table.narrow(1, 2, r).narrow(2, 0, w).double().sum(dim=3).reshape(n, w)
        assert torch.equal(got, exact.float().masked_fill(pos < 0, 0.0))
    else:
        assert got is None and ref is None


def _lazy_view(g: torch.Generator, nl: int, r: int, w: int) -> RowsView:
    prompt = torch.randint(5, 20, (r,), generator=g).tolist()
    seq = [p + int(torch.randint(1, 30, (), generator=g)) for p in prompt]
    pos = _positions(g, nl * r, w)
    att = torch.rand(nl * r, 1, 1, w, generator=g) ** 6 * (pos >= 0)[:, None, None]
    att[..., ::7] = 0.0
    view = RowsView(num_layers=nl, num_new=1, seq_len=seq, prompt_len=prompt,
                    prefill_done=[False] * r, lengths=(pos >= 0).sum(dim=1).tolist(),
                    positions=pos, block_size=4, attention=att,
                    in_place=frozenset({"ts", "mri"}))
    return view


@pytest.mark.parametrize("seed", range(6))
def test_lazy_track_matches_torch(seed, native, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    nl, r, w = 2, 3, 50
    ts = torch.randint(-20, 40, (nl, 5, w + 3), generator=g).float()
    ts[torch.rand(ts.shape, generator=g) < 0.3] = math.nan
    mri = torch.randint(0, 9, (nl, 5, w + 3), generator=g).float()
    view = _lazy_view(torch.Generator().manual_seed(100 + seed), nl, r, w)
    total = view.attention.sum(dim=(-2, -1)).clamp_min(1e-30)  # as head_mean
    p = view.attention[:, 0, 0] / total
    alpha = float(p[p > 0].median())  # a float32 value: exact ties with some slots
    assert bool((p == alpha).any())
    got = {"ts": ts.clone(), "mri": mri.clone()}
    _track(_with_state(view, got), alpha)
    monkeypatch.setitem(rows.NATIVE, "state", False)
    _track(_with_state(view, {"ts": ts, "mri": mri}), alpha)
    assert torch.equal(got["ts"].nan_to_num(-99), ts.nan_to_num(-99))
    assert torch.equal(got["mri"], mri)


def _with_state(view: RowsView, table: dict) -> RowsView:
    """The view over rows 1..r of `table`'s [L, 5, W + 3] tensors, in place."""
    r, w = view.num_requests, view.positions.shape[1]
    for name, t in table.items():
        view.state[name] = t.narrow(1, 1, r).narrow(2, 0, w)
    return view


@pytest.mark.parametrize("make", [
    lambda: PyramidPolicy(PyramidConfig(budget=24, obs_window=8)),
    lambda: LazyEvictionPolicy(LazyEvictionConfig(budget=20, window=4, alpha=0.02)),
])
def test_policies_keep_the_same_tokens_with_and_without_the_ops(make, native, monkeypatch):
    plans = []
    for on in (True, False):
        monkeypatch.setitem(rows.NATIVE, "state", on)
        sim, got = Sim(make(), seed=3), []
        got.append(sim.step(40, 40))
        for _ in range(30):
            got.append(sim.step(1, 40))
        plans.append([{k: v.tolist() for k, v in p.items()} for p in got])
    assert plans[0] == plans[1]
    assert any(plans[0])
