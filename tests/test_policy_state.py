"""The policies' C++ state updates (`policies/csrc/state_cpu.cpp`) against their torch
forms: pyramid's window ring and its fixed-point total (`pyramid_window` against
`policies/pyramid.py::_window_ring`: the same bits, and the total always the ring's sum;
its plan against `keep_highest` over torch's sums) and LazyEviction's
decode-step tracking (`policies/lazy_eviction.py::_tracked`), on slices of a larger
table (as the engine hands them, in place), with dead slots, NaN (unseen) activation
times, masses at the threshold and tokens after the query; and a policy run with and
without the ops keeps the same tokens."""

import math

import pytest
import torch

from kvpool.policy_rows import load_select
from policies import pyramid, rows
from policies.base import head_parts
from policies.lazy_eviction import LazyEvictionConfig, LazyEvictionPolicy, _track
from policies.pyramid import PyramidConfig, PyramidPolicy
from policies.rows import RowsView
from tests.policy_views import Sim


@pytest.fixture
def native():
    if not load_select() or not rows.NATIVE["state"]:
        pytest.skip("no C++ compiler")


def _positions(g: torch.Generator, n: int, w: int) -> torch.Tensor:
    pos = torch.arange(w).repeat(n, 1)
    pos[torch.rand(n, w, generator=g) < 0.3] = -1
    return pos


def _ring_table(g: torch.Generator, nl: int, rows: int, slots: int, a: int,
                columns: bool, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring [L, R, S, α] and the total [L, R, S, 3] that matches it (both stored by
    columns, as SlotTables keeps pyramid's, which the op's 8-lane form reads, or by
    slots), the ring of masses with exact zeros and ties."""
    ring = torch.rand(nl, rows, slots, a, generator=g) ** 4 * scale
    ring[ring < 0.05 * scale] = 0.0
    ring[..., 1] = ring[..., 0]
    total = pyramid._split(pyramid._fixed(ring, SHIFT).sum(dim=3))
    if columns:
        ring, total = (x.transpose(2, 3).contiguous().transpose(2, 3) for x in (ring, total))
    return ring, total


SHIFT = pyramid._shift(32)


@pytest.mark.parametrize("seed", range(12))
def test_window_ring_matches_torch(seed, native):
    """Seeds 8-11: masses up to 2^11 (a mass summed over many heads), whose fixed-point
    values pass 2^52, where the 8-lane AVX2 form converts by the exponent instead of
    by adding 2^52, and masses that fall on halves (rounded to even)."""
    g = torch.Generator().manual_seed(seed)
    # w: whole vectors of 8 slots for the 8-lane passes, and tails after them
    nl, r, big_r, w, a = 3, 4, 7, [40, 45, 17, 7][seed % 4], [32, 5, 8][seed % 3]
    k = [0, 1, 3][seed % 3 if seed < 3 else (seed + 1) % 3]
    k = max(k, 1) if seed >= 8 else k
    ring, total = _ring_table(g, nl, big_r, w + 9, a, columns=seed % 2 == 0,
                              scale=2.0 ** 11 if seed >= 8 else 1.0)
    n = nl * r
    pos = _positions(g, n, w)
    new = torch.rand(n, k, w, generator=g) * (pos >= 0)[:, None]
    if seed >= 8:
        new = new * 2.0 ** torch.randint(0, 12, new.shape, generator=g)
        halves = torch.tensor([1.5, 2.5, 3.5, 0.5]) * 2.0 ** -SHIFT  # exact in float32
        new[..., : halves.numel()] = halves * (pos[:, None, : halves.numel()] >= 0)
        assert float(new.max()) * 2.0 ** SHIFT >= 2.0 ** 52
    cols = torch.stack([torch.randperm(a, generator=g)[:k] for _ in range(n)])
    got_ring, got_total = ring.clone(), total.clone()

    def part(x: torch.Tensor) -> torch.Tensor:
        return x.narrow(1, 2, r).narrow(2, 0, w)

    plan = torch.ops.kvserve_policy_state.pyramid_window(  # an update only: no drops asked
        part(got_ring), part(got_total), new, cols.flatten().tolist(), pos, [], [], SHIFT, 0.0, 0.0)
    assert plan.shape == (0, w)
    pyramid._window_ring(part(ring), part(total), new, cols, SHIFT)
    assert torch.equal(got_ring, ring) and torch.equal(got_total, total)  # in place, alike
    # the running total is the window's: the fixed-point sum of the ring as it is now
    assert torch.equal(total, pyramid._split(pyramid._fixed(ring, SHIFT).sum(dim=3)))


def _lazy_view(g: torch.Generator, nl: int, r: int, w: int) -> RowsView:
    prompt = torch.randint(5, 20, (r,), generator=g).tolist()
    seq = [p + int(torch.randint(1, 30, (), generator=g)) for p in prompt]
    pos = _positions(g, nl * r, w)
    att = torch.rand(nl * r, 1, 1, w, generator=g) ** 6 * (pos >= 0)[:, None, None]
    att[..., ::7] = 0.0
    view = RowsView(num_layers=nl, num_new=1, seq_len=seq, prompt_len=prompt,
                    prefill_done=[False] * r, lengths=(pos >= 0).sum(dim=1).tolist(),
                    slot_pos=pos, block_size=4, attention=att,
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


@pytest.fixture
def two_threads():
    """torch at two intra-op threads for the test (row_sums chunks only then)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(64, 1, 1, 1056), (3, 2, 2, 50), (2, 1, 1, 40000), (1, 1, 1, 7)])
def test_head_parts_denominator_is_torch_sum(shape, native, two_threads, monkeypatch):
    """`row_sums` (chunks of rows under torch's parallel grain, each summed on the
    calling thread) has the bits of torch's own sum over the kv heads and slots, clamped
    as head_mean clamps: rows across chunk edges, rows wider than the grain, a slice view,
    zero rows (clamped), NaN (kept)."""
    g = torch.Generator().manual_seed(sum(shape))
    att = torch.rand(shape[0], shape[1] + 1, *shape[2:], generator=g) ** 3
    att = att[:, -1:] if shape[1] == 1 else att[:, :shape[1]]  # not contiguous
    att[0] = 0.0
    if shape[0] > 2:
        att[2, 0, 0, 3] = math.nan
    per, total = head_parts(att)
    monkeypatch.setitem(rows.NATIVE, "state", False)
    per_t, total_t = head_parts(att)
    assert torch.equal(per.nan_to_num(-1), per_t.nan_to_num(-1))
    assert torch.equal(total.nan_to_num(-1), total_t.nan_to_num(-1))
    assert bool((total[0] == torch.tensor(1e-30)).all()) and total.shape == shape[:2]
    if shape[0] > 2:
        assert math.isnan(float(total[2, 0]))


@pytest.mark.parametrize("w", [1040, 50])
def test_lazy_importance_matches_torch(w, native):
    """`lazy_importance` (eq. 2 in one C++ pass, torch's own vector exp) scores every slot
    of the deciding rows as the torch form does once the selection has read it as
    float32: over the integer TS/MRI the tracking makes (MRI 0 and 1 and t = TS, where the
    printed formulas divide by zero, included), on rows of a slice of a larger table,
    with W a multiple of 16 (torch's vector loop whole) and not (its scalar tail)."""
    from policies.lazy_eviction import importance

    g = torch.Generator().manual_seed(w)
    nl, big_r, r = 3, 6, 4
    ts = torch.randint(-30, 60, (nl, big_r, w + 5), generator=g).float()
    mri = torch.randint(0, 70, (nl, big_r, w + 5), generator=g).float()
    mri[torch.rand(mri.shape, generator=g) < 0.2] = 1.0
    mri[torch.rand(mri.shape, generator=g) < 0.2] = 0.0
    ts_v, mri_v = ts.narrow(1, 1, r).narrow(2, 0, w), mri.narrow(1, 1, r).narrow(2, 0, w)
    rows_ = [0, 3, 4, 7, 10, 11]
    times = [60, 60, 60, 75, 1000, 61]
    ts_v[1, 0, :7] = 60.0  # row 4 (layer 1, request 0) at t = TS: H1 = 1
    got = torch.ops.kvserve_policy_state.lazy_importance(ts_v, mri_v, rows_, times)
    at = torch.tensor(rows_)
    want = importance(torch.tensor(times, dtype=torch.float64)[:, None],
                      ts_v[at // r, at % r].double(), mri_v[at // r, at % r].double())
    assert got.dtype == torch.float32 and got.shape == (nl * r, w)  # every row of the view
    assert torch.equal(got[at], want.float())
    others = [i for i in range(nl * r) if i not in rows_]
    assert not bool(got[others].any())  # rows that do not decide: 0
    assert bool((want == 1.0).any()) and bool((want == 0.0).any())


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


ENGINE_CONFIGS = [
    *[{"name": "pyramid", "budget": 24, "obs_window": 8, "beta": 4}] * 3,
    {"name": "pyramid", "budget": 20, "obs_window": 5, "compact": True},
    *[{"name": "lazy_eviction", "budget": 24, "window": 6, "alpha": 0.01}] * 3,
]


def _live(llm) -> dict[str, list[list[int]]]:
    out = {}
    for r in llm.engine.scheduler.running:
        sp = r.cache.slot_pos
        out[r.request_id] = [sorted(sp[layer][sp[layer] >= 0].tolist()) for layer in range(sp.shape[0])]
    return out


def test_engine_keeps_the_same_tokens_with_and_without_the_ops(native, tmp_path, monkeypatch):
    """On a real forward with blocks freed and compacted (state moving with its token):
    the same kept positions every step with the C++ state updates and with the torch
    forms, and pyramid's running window total stays the fixed-point sum of its ring."""
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model, submit_each

    model = make_tiny_model("llama", tmp_path, max_position_embeddings=512)
    llms = [LLM(model, num_blocks=2000, block_size=4, max_num_batched_tokens=256)
            for _ in range(2)]
    submit_each(llms, ENGINE_CONFIGS, seed=0)
    steps = 0
    while llms[0].engine.has_unfinished():
        for llm, on in zip(llms, (True, False)):
            monkeypatch.setitem(rows.NATIVE, "state", on)
            llm.engine.step()
        steps += 1
        assert _live(llms[0]) == _live(llms[1]), steps
        tables = llms[0].engine.scheduler.running[0].cache.tables if llms[0].engine.scheduler.running else None
        for a in (8, 5):
            if tables is None or f"pyramid_window{a}" not in tables.state:
                continue
            ring, total = tables.state[f"pyramid_window{a}"], tables.state[f"pyramid_total{a}"]
            assert ring.stride(2) == 1 and total.stride(2) == 1  # stored by columns
            live = tables.slot_pos >= 0
            exact = pyramid._split(pyramid._fixed(ring, pyramid._shift(a)).sum(dim=3))
            assert torch.equal(total[live], exact[live])
    assert not llms[1].engine.has_unfinished()
    for llm in llms:
        llm.engine.check_invariants()
    stats = llms[0].engine.stats()
    assert stats.evicted_tokens_by_policy_total.get("lazy_eviction", 0) > 0
    assert stats.freed_blocks_by_policy_total.get("pyramid", 0) > 0


@pytest.mark.parametrize("hkv", [1, 2, 3, 4, 8])
def test_head_sum_is_torch_sum(hkv):
    """The view's mass summed over kv heads by a chain of adds (policy_rows.head_sum):
    the same bits as torch's sum over that dim, on a strided slice as the runner's."""
    from kvpool.head_stats import head_sum

    g = torch.Generator().manual_seed(hkv)
    mass = torch.rand(3, 9, 2, hkv, 70, generator=g) ** 3
    sel = mass.narrow(1, 2, 5)[..., :61]
    assert torch.equal(head_sum(sel), sel.sum(dim=3, keepdim=True))


@pytest.mark.parametrize("seed", range(4))
def test_pyramid_ranks_by_torchs_float32_sums(seed, native):
    """Pyramid's drops are those of the window's float32 sums as torch takes them, also
    where only their last bits differ: slots whose rings hold the same values in other
    orders have equal exact totals but sums a bit apart, and the C++ path (exact totals
    to find the few candidates that can be dropped, torch's sum for those) drops what
    summing every slot drops; over whole vectors of slots and a tail past them."""
    g = torch.Generator().manual_seed(seed)
    nl, r, w, a = 2, 3, [64, 61][seed % 2], 32
    base = torch.rand(a, generator=g) ** 3
    ring = (torch.rand(nl, r, w, a, generator=g) ** 3 + 0.2)
    for row in range(nl * r):  # a third of each row: permutations of the lowest ring
        for s in torch.randperm(w, generator=g)[: w // 3].tolist():
            ring[row // r, row % r, s] = base[torch.randperm(a, generator=g)]
    ring = ring.transpose(2, 3).contiguous().transpose(2, 3)  # by columns, as the tables
    pos = torch.arange(w).repeat(nl * r, 1)
    pos[:, 5] = -1
    total = pyramid._split(pyramid._fixed(ring, SHIFT).sum(dim=3))
    sums = ring.reshape(nl * r, w, a).sum(dim=2)
    assert (sums.view(nl * r, w)[:, :].unique().numel() < w * nl * r)  # ties exist ...
    p = PyramidPolicy(PyramidConfig(budget=40, obs_window=a))
    view = RowsView(num_layers=nl, num_new=1, seq_len=[w] * r, prompt_len=[10] * r,
                    prefill_done=[False] * r, lengths=(pos >= 0).sum(dim=1).tolist(),
                    slot_pos=pos, block_size=4, state={next(iter(p.state)): ring},
                    in_place=frozenset(p.state))
    keep = [w - 1 - d for d in [1, 3, 8, 20, 1, 2]]
    edges = [2] * (nl * r)
    drop = [max(0, m - k) for m, k in zip(view.lengths, keep)]
    got = torch.ops.kvserve_policy_state.pyramid_window(
        ring, total, torch.zeros(nl * r, 0, w), [], pos, edges, drop, SHIFT,
        4 * a * 2.0 ** -24 + 2.0 ** -22, 2.0 ** -30)
    want = rows.keep_highest(view, pyramid._torch_sums(p, view), keep, first=edges, last=edges)
    assert torch.equal(got, want)
    assert got.sum(dim=1).tolist() == [1, 3, 8, 20, 1, 2]
    totals = pyramid._fixed(ring, SHIFT).sum(dim=3).view(nl * r, w)
    exact_ties = (totals[:, None, :] == totals[:, :, None]).sum() > totals.numel()
    assert exact_ties  # ... and equal exact totals whose float32 sums differ


@pytest.mark.parametrize("seed", range(6))
def test_paged_block_drops_match_torch(seed, native, monkeypatch):
    """PagedEviction's block mode in C++ (pack_live, torch's block means, block_drops)
    drops what the torch form drops: packed rows and rows with holes, a state read as
    [L, R, W] in place, windows, several blocks a row, tied and NaN means, rows that do
    not decide."""
    from policies.paged_eviction import _block_drops_of

    g = torch.Generator().manual_seed(seed)
    nl, r, bs = 2, 5, 4
    w = bs * 12
    n = nl * r
    pos = torch.arange(w).repeat(n, 1)
    lengths = torch.randint(bs, w, (n,), generator=g)
    pos[torch.arange(w) >= lengths[:, None]] = -1
    if seed % 2:  # holes (a row not compacted yet)
        pos[torch.rand(n, w, generator=g) < 0.2] = -1
    state = torch.rand(nl, r + 3, w + 5, generator=g).round(decimals=1)  # ties
    if seed == 4:
        state[0, 1, :8] = float("nan")
    scores = state.narrow(1, 1, r).narrow(2, 0, w)  # [L, R, W] as the tables hand it
    view = RowsView(num_layers=nl, num_new=1, seq_len=[w] * r, prompt_len=[4] * r,
                    prefill_done=[False] * r, lengths=(pos >= 0).sum(dim=1).tolist(),
                    slot_pos=pos, block_size=bs)
    blocks = [int(x) for x in torch.randint(0, 3, (n,), generator=g)]
    blocks[0] = 1
    windows = None if seed % 3 == 0 else [int(x) for x in torch.randint(0, 9, (n,), generator=g)]
    got = _block_drops_of(scores, view, blocks, windows)
    monkeypatch.setitem(rows.NATIVE, "select", False)
    want = _block_drops_of(scores, view, blocks, windows)
    assert torch.equal(got, want)
    assert got.any()


@pytest.mark.parametrize("seed", range(4))
def test_ops_read_positions_in_place_as_rows(seed, native):
    """Every C++ op that reads positions gives the same answer from the tables' own
    [L, R, W] slice (rows r0.., a width short of the table's: strided, as
    `RowsView.slot_pos` hands it) as from its [N, W] copy; and `RowsView.positions`,
    `live`, `shape` and `positions_of` read it as rows l·R + r."""
    g = torch.Generator().manual_seed(seed)
    nl, r, w, bs = 3, 5, 40, 4
    table = _positions(g, nl * (r + 4), w + 12).view(nl, r + 4, w + 12)
    sp = table.narrow(1, 2, r).narrow(2, 0, w)  # [L, R, W], not contiguous
    flat = sp.reshape(nl * r, w).clone()
    n = nl * r
    assert not sp.is_contiguous()
    scores = torch.rand(n, w, generator=g).round(decimals=1)
    counts = [torch.randint(0, 3, (n,), generator=g) for _ in range(3)]
    ops = torch.ops.kvserve_policies
    for pos in (flat, sp):  # the same rows either way
        got = [ops.select_drop(scores, pos, torch.stack(counts)),
               ops.drop_earliest(pos, counts[0], counts[2])]
        at = torch.tensor([0, 3, n - 1])
        packed = ops.pack_live(scores, pos, at, bs)
        got += [packed, ops.block_drops(packed.view(3, -1, bs).mean(dim=2), pos, at,
                                        torch.tensor([5, 5, 5]), torch.tensor([1, 2, 1]), bs)]
        ts = torch.full((nl, r, w), float("nan"))
        mri = torch.zeros(nl, r, w)
        mass = torch.rand(n, w, generator=torch.Generator().manual_seed(seed))
        ops_state = torch.ops.kvserve_policy_state
        ops_state.lazy_track(ts, mri, mass, mass.sum(dim=1), pos, [w - 1] * r, [4] * r, 0.02)
        ring, total = _ring_table(torch.Generator().manual_seed(seed), nl, r, w, 8, True)
        plan = ops_state.pyramid_window(ring, total, mass[:, None], [w % 8] * n, pos,
                                        [2] * n, [1] * n, SHIFT, 4 * 8 * 2.0 ** -24, 2.0 ** -30)
        got += [ts, mri, ring, total, plan]
        if pos is flat:
            want = got
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert want[0].any() and want[1].any() and want[-1].any()
    view = RowsView(num_layers=nl, num_new=1, seq_len=[w] * r, prompt_len=[4] * r,
                    prefill_done=[False] * r, lengths=(flat >= 0).sum(dim=1).tolist(),
                    slot_pos=sp, block_size=bs)
    assert view.shape == (n, w)
    assert torch.equal(view.positions, flat) and torch.equal(view.live, flat >= 0)
    assert torch.equal(view.positions_of(torch.tensor([1, 7, n - 1])), flat[[1, 7, n - 1]])


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("k", [1, 3])
def test_new_norm_scores_match_torch(heads, k, native, monkeypatch):
    """knorm's and PagedEviction's new-token scores written by one C++ op
    (`RowsView.set_new_norm_score`) are the torch form's bits, into a strided [L, R, W]
    slice of a state: norms over a wide range (the sum's order shows), zero and tiny key
    norms (the clamp), a NaN; five heads take the torch form."""
    from policies.norms import knorm_scores
    from policies.paged_eviction import token_scores

    g = torch.Generator().manual_seed(heads * 10 + k)
    nl, r, w = 3, 4, 40
    n = nl * r
    kn = (torch.randn(n, k, heads, generator=g) * 30).abs() ** 3
    vn = (torch.randn(n, k, heads, generator=g) * 30).abs() ** 3
    kn[0, 0, 0], kn[1, 0, 0], vn[2, 0, 0] = 0.0, 1e-14, float("nan")
    slots = torch.randperm(w, generator=g)[: n * k].view(n, k)  # distinct per row
    layer = torch.arange(n).div(r, rounding_mode="floor")[:, None].expand(n, k)
    index = torch.stack([layer, (torch.arange(n) % r)[:, None].expand(n, k), slots])
    out = {}
    for use in (True, False):
        monkeypatch.setitem(rows.NATIVE, "state", use)
        table = torch.zeros(nl, r + 2, 2 * w + 8)
        view = RowsView(num_layers=nl, num_new=k, seq_len=[w] * r, prompt_len=[4] * r,
                        prefill_done=[False] * r, lengths=[w] * n,
                        slot_pos=torch.arange(w).repeat(n, 1), block_size=4,
                        state={"a": table.narrow(1, 1, r).narrow(2, 0, w),
                               "b": table.narrow(1, 1, r).narrow(2, w + 4, w)},
                        in_place=frozenset({"a", "b"}), new_slots=slots, new_index=index)
        view.set_new_norm_score("a", kn, None, lambda: knorm_scores(kn))
        view.set_new_norm_score("b", kn, vn, lambda: token_scores(vn, kn))
        out[use] = table
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out[True]).any() and (out[True] != 0).sum() > n * k
