"""The policies' one selection (`policies/rows.py::drop_lowest`): its torch form against
a plain reference (a stable descending sort of each row's candidates), and the C++ op
(`policies/csrc/select_cpu.cpp`) against the torch form, on rows with dead slots, many
ties, NaNs, sinks and recent windows, for small (decode) and large (prompt) drops."""

import pytest
import torch

from kvpool.policy_rows import load_select
from policies import rows


def _reference(positions, scores, drop, first, last):
    out = torch.zeros(scores.shape, dtype=torch.bool)
    for i in range(scores.shape[0]):
        live = (positions[i] >= 0).nonzero().squeeze(1)
        cand = live[first[i]: live.numel() - last[i]]
        if drop[i] == 0 or cand.numel() == 0:
            continue
        # NaN above every number, then stable: ties keep the earlier slot
        vals = scores[i, cand].tolist()
        order = sorted(range(cand.numel()),
                       key=lambda j: (vals[j] == vals[j], -vals[j] if vals[j] == vals[j] else 0, j))
        for j in order[cand.numel() - min(drop[i], cand.numel()):]:
            out[i, cand[j]] = True
    return out


def _case(seed: int, n: int = 12, w: int = 96):
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(w).repeat(n, 1)
    positions[torch.rand(n, w, generator=g) < 0.3] = -1  # dead slots
    positions[::2, -20:] = -1  # past a row's next slot: its view's width holds more
    scores = torch.randint(0, 5, (n, w), generator=g).float()  # many ties
    if seed % 2:
        scores[torch.rand(n, w, generator=g) < 0.05] = float("nan")
    if seed % 4 == 2:  # infinities, tying with the torch form's mask
        scores[torch.rand(n, w, generator=g) < 0.1] = float("inf")
        scores[torch.rand(n, w, generator=g) < 0.05] = -float("inf")
    # sinks and recent windows past a block of live flags (16 slots), and past a row's
    # live count (no candidate left)
    first = torch.randint(0, 24 if seed % 2 else 4, (n,), generator=g).tolist()
    last = torch.randint(0, 80 if seed % 2 else 6, (n,), generator=g).tolist()
    live = (positions >= 0).sum(dim=1).tolist()
    big = seed % 3 == 0  # a prompt's plan: more than the top-k path takes
    drop = [max(0, min(k - f - e, int(torch.randint(0, 70 if big else 4, (), generator=g))))
            for k, f, e in zip(live, first, last)]
    return positions, scores, drop, first, last


@pytest.mark.parametrize("seed", range(9))
def test_torch_selection_matches_the_reference(seed, monkeypatch):
    monkeypatch.setitem(rows.NATIVE, "select", False)
    positions, scores, drop, first, last = _case(seed)
    got = rows.drop_lowest(positions, scores, drop, first, last)
    assert torch.equal(got, _reference(positions, scores, drop, first, last))
    assert got.sum(dim=1).tolist() == drop


@pytest.mark.parametrize("seed", range(9))
def test_native_selection_matches_torch(seed, monkeypatch):
    if not load_select():
        pytest.skip("no C++ compiler")
    positions, scores, drop, first, last = _case(seed)
    native = rows.drop_lowest(positions, scores, drop, first, last)
    monkeypatch.setitem(rows.NATIVE, "select", False)
    assert torch.equal(native, rows.drop_lowest(positions, scores, drop, first, last))
    # one int for every row, too
    monkeypatch.setitem(rows.NATIVE, "select", True)
    a = rows.drop_lowest(positions, scores, [1] * len(drop), 2, 3)
    monkeypatch.setitem(rows.NATIVE, "select", False)
    assert torch.equal(a, rows.drop_lowest(positions, scores, [1] * len(drop), 2, 3))


@pytest.mark.parametrize("seed", range(6))
def test_native_drop_earliest_matches_torch(seed, monkeypatch):
    """The streaming family's selection: after the first `first` live slots, the drop[i]
    oldest; rows within their cap (drop 0) and drops beyond a row's live slots too."""
    if not load_select():
        pytest.skip("no C++ compiler")
    positions, _, _, _, _ = _case(seed)
    g = torch.Generator().manual_seed(100 + seed)
    drop = torch.randint(0, 90, (positions.shape[0],), generator=g).tolist()
    drop[0] = 0
    view = rows.RowsView(num_layers=1, num_new=1, seq_len=[0], prompt_len=[0],
                         prefill_done=[True], lengths=(positions >= 0).sum(1).tolist(),
                         slot_pos=positions, block_size=16)
    first = seed % 5
    native = rows.drop_earliest(view, drop, first)
    monkeypatch.setitem(rows.NATIVE, "select", False)
    torch_form = rows.drop_earliest(view, drop, first)
    assert torch.equal(native, torch_form)
    live = (positions >= 0).sum(1)
    assert native.sum(1).tolist() == [max(0, min(d, n - first)) for d, n in zip(drop, live.tolist())]
    assert rows.drop_earliest(view, [0] * len(drop), first) is None


@pytest.mark.parametrize("seed", range(4))
def test_native_single_drop_on_long_rows_matches_torch(seed, monkeypatch):
    """Decode's one drop per row on rows of a thousand slots (the C++ op's vectorised
    minimum and its search from the end in blocks of 16): ties across blocks, 0 and -0,
    NaN and infinities, rows whose only candidates are +inf or NaN."""
    if not load_select():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(seed)
    n, w = 16, 1003
    positions = torch.arange(w).repeat(n, 1)
    positions[torch.rand(n, w, generator=g) < 0.2] = -1
    values = torch.tensor([0.0, -0.0, 1.0, 2.0, float("nan"), float("inf"), -float("inf")])
    pick = torch.randint(0, 4 if seed < 2 else 7, (n, w), generator=g)
    scores = values[pick]
    scores[0] = float("inf")  # only +inf candidates
    scores[1] = float("nan")  # only NaN candidates
    scores[2, ::3] = float("inf")
    scores[2, 1::3] = float("nan")
    for first, last in ((0, 0), (4, 1), (0, 32)):
        native = rows.drop_lowest(positions, scores, [1] * n, first, last)
        monkeypatch.setitem(rows.NATIVE, "select", False)
        assert torch.equal(native, rows.drop_lowest(positions, scores, [1] * n, first, last))
        monkeypatch.setitem(rows.NATIVE, "select", True)


@pytest.mark.parametrize("seed", range(9))
@pytest.mark.parametrize("native", [False, True])
def test_a_live_mask_selects_as_the_positions(seed, native, monkeypatch):
    """`drop_lowest` given the rows' bool live mask (what `keep_highest` hands it) drops
    what it drops given their positions, in the C++ op and in the torch form."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(rows.NATIVE, "select", native)
    positions, scores, drop, first, last = _case(seed)
    assert torch.equal(rows.drop_lowest(positions >= 0, scores, drop, first, last),
                       rows.drop_lowest(positions, scores, drop, first, last))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("native", [False, True])
def test_layered_scores_select_as_rows(seed, native, monkeypatch):
    """Scores handed as [L, R, W] (a state slice of wider tables, `RowsView.layered`,
    which the C++ op reads in place) select what their [N, W] copy (row l·R + r)
    selects."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(rows.NATIVE, "select", native)
    positions, scores, drop, first, last = _case(seed)  # 12 rows: 3 layers x 4 requests
    wide = torch.randn(3, 7, scores.shape[1] + 5)  # the tables: more rows and slots
    layered = wide.narrow(1, 2, 4).narrow(2, 0, scores.shape[1])
    layered.copy_(scores.view(3, 4, -1))
    assert torch.equal(rows.drop_lowest(positions, layered, drop, first, last),
                       rows.drop_lowest(positions, scores, drop, first, last))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("native", [False, True])
def test_a_divisor_ranks_the_quotients_as_torch_divides(seed, native, monkeypatch):
    """`divisor` (TOVA's head mean): row i ranks scores / divisor[i] exactly as
    `drop_lowest` ranks the tensor torch divides; a division can tie scores that differ
    in their last bits (here, neighbours 1 ulp apart over divisors that merge them), and
    then the later slot drops, as for any tie. One row alone too (a [1] divisor)."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(rows.NATIVE, "select", native)
    positions, _, drop, first, last = _case(seed)
    n, w = positions.shape
    g = torch.Generator().manual_seed(50 + seed)
    base = torch.rand(n, w, generator=g) * 3
    near = torch.nextafter(base, torch.full_like(base, 9.0))  # 1 ulp above
    scores = torch.where(torch.rand(n, w, generator=g) < 0.5, base, near)
    scores[:, 1::2] = scores[:, ::2][:, : w // 2]  # exact ties too
    scores[:, 1::3] = torch.nextafter(scores[:, ::3][:, : len(range(1, w, 3))],
                                      torch.tensor(9.0))
    divisor = torch.rand(n, generator=g) * 7 + 0.3
    want = rows.drop_lowest(positions, scores / divisor[:, None], drop, first, last)
    assert torch.equal(rows.drop_lowest(positions, scores, drop, first, last, divisor), want)
    merged = (scores / divisor[:, None]).unique().numel() < scores.unique().numel()
    assert merged  # the quotients tie values the scores do not
    one = rows.drop_lowest(positions[:1], scores[:1], [1], 0, 1, divisor[:1])
    assert torch.equal(one, rows.drop_lowest(positions[:1], scores[:1] / divisor[:1, None],
                                             [1], 0, 1))
