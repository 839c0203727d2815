"""`policies/heads.py::adaptive_drops` (AdaKV's per-row drop counts) against the sort form
it replaced, kept here as the reference: three stable argsorts over every row. The
thresholds (a top-k and a count of ties) and the C++ pass (policies/csrc/adaptive.h)
must give exactly its counts on random rows: dead slots, many ties, ±inf and NaN
scores, sinks and windows (an int for every row or one a row), divisors that tie
quotients, drops of a token (decode) and of most of a row (a prompt's plan)."""

from __future__ import annotations

import pytest
import torch

from kvpool.policy_rows import load_select
from policies import heads
from policies.heads import ALPHA, adaptive_drops


def _candidates(live: torch.Tensor, first: list[int], last: list[int]) -> torch.Tensor:
    n = live.shape[0]
    rank = live.cumsum(dim=1)
    from_end = live.flip(1).cumsum(dim=1).flip(1)
    return (live & (rank > torch.tensor(first).view(n, 1))
            & (from_end > torch.tensor(last).view(n, 1)))


def reference(scores: torch.Tensor, live: torch.Tensor, lengths: list[int], keep: list[int],
              heads: int, requests: int, first: list[int] | int = 0,
              last: list[int] | int = 0, divisor: torch.Tensor | None = None) -> list[int]:
    """`adaptive_drops` as it was (commit 8e46d46)."""
    n, w = live.shape
    lanes = n // requests
    over = torch.tensor(lengths) - torch.tensor(keep)
    total = over.view(lanes // heads, heads, requests).sum(dim=1).clamp(min=0).view(-1, 1)
    if not bool(total.any()):
        return [0] * n
    f = first if isinstance(first, list) else [first] * n
    t = last if isinstance(last, list) else [last] * n
    s = scores.reshape(n, w).float()
    if divisor is not None:
        s = s / divisor.view(n, 1)
    cand = _candidates(live.reshape(n, w), f, t)
    forced = (live.reshape(n, w).sum(dim=1) - cand.sum(dim=1)).view(n, 1)
    safe = (torch.tensor([int(k * ALPHA) for k in keep]).view(n, 1) - forced).clamp(min=0)
    order = s.masked_fill(~cand, float("-inf")).argsort(dim=1, descending=True, stable=True)
    top = torch.zeros_like(cand).scatter_(1, order, torch.arange(w).expand(n, w) < safe)
    pool = cand & ~top
    grouped = s.masked_fill(~pool, float("inf")).view(lanes // heads, heads, requests, w)
    grouped = grouped.transpose(1, 2).reshape(-1, heads * w)
    rank = grouped.argsort(dim=1, stable=True).argsort(dim=1)
    chosen = (rank < total) & grouped.isfinite()
    counts = chosen.view(lanes // heads, requests, heads, w).sum(dim=3).transpose(1, 2)
    return counts.reshape(-1).tolist()


def case(seed: int) -> tuple[tuple, dict]:
    """Random rows of (layer, head, request) lanes; the seed picks the flavour."""
    g = torch.Generator().manual_seed(seed)

    def pick(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=g))

    layers, nheads, requests, w = pick(1, 3), pick(1, 4), pick(1, 4), pick(1, 48)
    n = layers * nheads * requests
    live = torch.rand(n, w, generator=g) < torch.rand(n, 1, generator=g)  # dead slots
    if seed % 5 == 0:
        live[:, : pick(0, w)] = True
    levels = pick(1, 6) if seed % 3 else 10**6  # few levels: many ties
    scores = torch.randint(0, levels, (n, w), generator=g).float() / levels
    if seed % 4 == 1:  # infinities (tying with either form's masks) and NaN
        scores[torch.rand(n, w, generator=g) < 0.1] = float("inf")
        scores[torch.rand(n, w, generator=g) < 0.1] = -float("inf")
    if seed % 7 == 3:
        scores[torch.rand(n, w, generator=g) < 0.05] = float("nan")
    if seed % 6 == 4:  # the layered state some policies hand over: [L·H, R, W]
        scores = scores.view(layers * nheads, requests, w)
    lengths = live.sum(dim=1).tolist()
    big = seed % 2 == 0  # a prompt's plan: most of a row over its budget
    keep = [max(0, x - (pick(0, x) if big else pick(0, 2))) for x in lengths]
    if seed % 8 == 5:  # budgets beyond what rows hold: some rows under it
        keep = [k + pick(0, 3) for k in keep]
    if seed % 9 == 4:  # head 0 well under its budget: the others drop into its room
        keep = [k + pick(4, 30) if (i // requests) % nheads == 0 else pick(0, 2)
                for i, k in enumerate(keep)]
    kw: dict = {}
    if seed % 3 == 1:
        kw["first"] = [pick(0, 4) for _ in range(n)]
        kw["last"] = [pick(0, 6) for _ in range(n)]
    elif seed % 3 == 2:
        kw["first"], kw["last"] = pick(0, 3), pick(0, 5)
    if seed % 5 == 2:  # quotients that tie values the scores do not
        kw["divisor"] = torch.tensor([1.0, 3.0, 0.1, 7.0])[torch.randint(0, 4, (n,), generator=g)]
    return (scores, live, lengths, keep, nheads, requests), kw


SEEDS = range(400)


@pytest.mark.parametrize("native", [False, True])
def test_adaptive_drops_equal_the_sort_form(native: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch thresholds and the C++ pass each give the three sorts' counts, case by
    case, and the cases do drop (the layer totals are spread over heads by score)."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(heads.NATIVE, "select", native)
    dropped = 0
    for seed in SEEDS:
        args, kw = case(seed)
        want = reference(*args, **kw)
        assert adaptive_drops(*args, **kw) == want, seed
        dropped += sum(want)
    assert dropped > 1000


@pytest.mark.parametrize("native", [False, True])
def test_decode_shape_equals_the_sort_form(native: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A realistic decode step (4 layers × 2 heads × 8 requests, 300 slots, a token over
    each budget, a sink and a window) and a prompt's plan over it, with ties."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(heads.NATIVE, "select", native)
    g = torch.Generator().manual_seed(0)
    n, w = 4 * 2 * 8, 300
    live = torch.rand(n, w, generator=g) < 0.6
    scores = torch.randint(0, 200, (n, w), generator=g).float()
    lengths = live.sum(dim=1).tolist()
    for keep in ([x - 1 for x in lengths], [x // 4 for x in lengths]):
        args = (scores, live, lengths, keep, 2, 8)
        assert adaptive_drops(*args, first=4, last=16) == reference(*args, first=4, last=16)


@pytest.mark.parametrize("native", [False, True])
def test_a_heads_top_past_its_numbers_takes_minus_inf_slots_in_order(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Head 0's top (2) exceeds its candidates above -inf (1): the sort form takes the
    rest from its -inf slots in slot order, a dead slot counting as -inf. With a dead
    slot before it the -inf candidate stays in the pool and takes one of the group's
    ranks (head 1 drops 7 of the total 8); first in its row it is in the top (8)."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(heads.NATIVE, "select", native)
    w = 16
    for cand, want in ((1, [0, 7]), (0, [0, 8])):
        scores = torch.full((2, w), 0.5)
        live = torch.ones(2, w, dtype=torch.bool)
        live[0] = False
        live[0, [cand, 2]] = True
        scores[0, cand], scores[0, 2] = -float("inf"), 1.0
        args = (scores, live, live.sum(dim=1).tolist(), [10, 0], 2, 1)
        assert reference(*args) == want
        assert adaptive_drops(*args) == want


@pytest.mark.parametrize("native", [False, True])
def test_a_nan_is_a_heads_top(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN sorts above every number: head 0's top (2) is its NaN and its 3, so its 2
    and 1 are in the group's pool and both go (with 8 of head 1's 5s); were NaN below,
    its 3 and 2 would be the top and it would drop one."""
    if native and not load_select():
        pytest.skip("no C++ compiler")
    monkeypatch.setitem(heads.NATIVE, "select", native)
    scores = torch.full((2, 16), 5.0)
    scores[0, :4] = torch.tensor([float("nan"), 3.0, 2.0, 1.0])
    live = torch.ones(2, 16, dtype=torch.bool)
    live[0, 4:] = False
    args = (scores, live, [4, 16], [10, 0], 2, 1)
    assert reference(*args) == adaptive_drops(*args) == [2, 8]
