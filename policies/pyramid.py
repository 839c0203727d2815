"""`pyramid`: KV-X (002_f8cea1b3e0b25e86.txt §3.1-3.3) — per-layer budgets in
arithmetic progression, a lambda-shaped static mask of sink + streaming tokens, and the
top-k middle tokens by observation-window attention, applied at the end of the prompt
and at every decode step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar, Literal

import torch
from pydantic import Field

from policies.base import Needs, prefill_envelope, resolve_budget
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field
from policies.rows import NATIVE, RowsView, keep_highest
from policies.snapkv import OddKernel, pool_scores


class PyramidConfig(EvictingPolicyConfig):
    ADAPTIVE: ClassVar[bool] = True
    name: Literal["pyramid"] = "pyramid"
    budget: Budget = budget_field(1024, "Mean tokens kept per layer C (002 Table 1: 1024)")
    beta: int = Field(20, ge=1, description="Pyramid steepness: the top layer keeps C / beta.")
    omega: float = Field(4.0, ge=1.0, description=(
        "The lambda mask (sinks + recent tokens) covers 1/omega of a layer's budget."))
    obs_window: int = Field(32, ge=1, description=(
        "α: the most recent queries whose attention scores the middle tokens (eq. 4)."))
    kernel_size: OddKernel = Field(1, description=(
        "Average pooling over neighbouring scores (odd; 1 = eq. 4 as written)."))

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


def layer_budgets(total: int, seq_len: int, num_layers: int, beta: int,
                  window: int) -> list[int]:
    """Per-layer budgets C_l (layer 0 = bottom), 002 eq. 2:
    C_l = C_L + (C_1 - C_L)(L - l)/(L - 1), with Σ C_l = L·C (eq. 1, same total as a
    uniform budget C). The end points follow PyramidKV's rule as kvpress
    `PyramidKVPress.get_layer_budget` computes them: C_L = C/β, C_1 = 2C - C_L; if
    C_1 >= n - window then C_1 = n - window, C_L = 2C - C_1; if not n >= C_1 >= C_L >=
    window, every layer gets C (kvpress falls back to SnapKV's uniform budget). Exact
    rational arithmetic and round-half-even make the total exactly L·C."""
    # From s* on (C_1 = 2C - C/β below n - window, no clamp) n no longer matters: one
    # cache entry serves every later step of every request with these parameters.
    s_star = 2 * total - -(-total // beta) + window + 1
    return list(_layer_budgets(total, min(seq_len, s_star), num_layers, beta, window))


@functools.lru_cache(maxsize=4096)
def _layer_budgets(total: int, seq_len: int, num_layers: int, beta: int,
                   window: int) -> tuple[int, ...]:
    """Cached: every decode step of every pyramid request asks (a step's requests share
    their length). In integers over a common denominator: below s* every step is a new
    length, and the Fraction arithmetic this replaces (tests/test_policies_pyramid.py
    keeps it as the reference) was ~60 us a step."""
    if num_layers == 1:
        return (total,)
    # c_max = hi / den and c_min = lo / den
    den, hi, lo = beta, 2 * total * beta - total, total
    if hi >= (seq_len - window) * beta:
        den, hi = 1, seq_len - window
        lo = 2 * total - hi
    if not (seq_len * den >= hi >= lo >= window * den):
        return (total,) * num_layers
    d = den * (num_layers - 1)  # c_max - layer * step = (hi·(L-1) - layer·(hi - lo)) / d
    return tuple(_round_half_even(hi * (num_layers - 1) - layer * (hi - lo), d)
                 for layer in range(num_layers))


@functools.lru_cache(maxsize=4096)
def _plan(budget: int | float, beta: int, omega: float, window: int, seq_len: int,
          num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer, the budget C_l and the sinks (= recent tokens) floor(C_l / (2ω)) the
    lambda mask keeps at this length. Cached: a step's requests are usually a token or
    a few apart, so the next step asks for lengths this one asked for."""
    budgets = layer_budgets(resolve_budget(budget, seq_len), seq_len, num_layers, beta, window)
    return tuple(budgets), tuple(int(b // (2 * omega)) for b in budgets)


def _round_half_even(num: int, den: int) -> int:
    """round(num / den) for den > 0, halves to even (as round() of a Fraction)."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2):
        q += 1
    return q


@dataclass
class PyramidPolicy:
    """KV-X (002_f8cea1b3e0b25e86.txt §3.1-3.3, eqs. 1-8).

    Budgets: `layer_budgets(C, seq_len, L, beta, obs_window)` with
    C = resolve_budget(budget, seq_len), recomputed each step (fixed once seq_len is
    past the clamp for a token budget). Lambda mask (eqs. 5-6, 8): with α/ω of the line
    masked, C_sink = C_streaming = floor(C_l / (2ω)) — the first and the last tokens of
    the layer's kept order — and C_lk = C_l - 2·C_sink middle tokens by score (eq. 7).
    Score (eqs. 3-4): s_i = Σ_j A_ji over the last `obs_window` queries — the last prompt
    queries at the end of the prompt, then a sliding window over decode queries — summed
    over all heads, optionally avg-pooled (`kernel_size`) over neighbours in kept order.

    How it runs (`select`, every request of a group at once): the window is per-slot
    state, `obs_window` values per token (`state`: `pyramid_window<α>`, [.., α] per
    slot, a ring: query q in column q mod α; a new token starts at 0, which is exact
    since no earlier query sees it). Each step shifts its window queries in (queries at or past
    prompt_len - α; several prompt chunks may fill the window), and layers' different
    budgets are per-row keep counts (request r's row of layer l keeps C_l) for one selection
    over all rows, the lambda mask a protected mask over each row's first and last C_sink
    live slots.

    KV-X ties α to the cache line without a number; we take SnapKV's 32 (§3.2 builds on
    SnapKV). vs kvpress `PyramidKVPress`: per-layer budgets are identical (same formula);
    scores are identical with kernel_size=1 (kvpress avg-pools only the tokens before its
    window, we pool the whole kept order, which differs near that edge for kernel > 1).
    Deliberate difference in what is pinned: kvpress pins its last window_size tokens,
    KV-X's lambda mask pins sink + streaming tokens; with those tokens in kvpress's top-k
    anyway the kept sets are equal. kvpress only compresses the prefill.

    Bound: layer l keeps <= C_l after every plan from the end of the prompt on, and
    C_l <= max(C, round(2C - C/β)) for every l, whence `max_live`."""

    config: PyramidConfig
    name: str = "pyramid"
    needs: Needs = field(init=False)
    # Per-slot state (name -> (a new slot's value, values per slot)): the window's
    # queries, a ring, and their total (`_shift_window`). Per policy rather than per
    # class: the ring's size is the config's.
    state: dict[str, tuple[float, int]] = field(init=False, repr=False)
    derived_state: dict[str, tuple[float, int]] = field(init=False, repr=False)
    state_in_place: tuple[str, ...] = field(init=False, repr=False)
    state_columns: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        a = self.config.obs_window
        ring, total = f"pyramid_window{a}", f"pyramid_total{a}"
        self.state = {ring: (0.0, a)}
        self.derived_state = {total: (0.0, _DIGITS)}  # the ring's sum (`_window_ring`)
        # Updated where the tables keep them (RowsView.in_place), stored by columns
        # (SlotTables.declare_state): a decode step writes one ring column per slot.
        self.state_in_place = self.state_columns = (ring, total)
        # in decode the kernel writes each query's column and the total (`Needs.ring`)
        self.needs = Needs(attention=True, ring=(ring, total, _shift(a)))

    def budgets(self, seq_len: int, num_layers: int) -> list[int]:
        c = self.config
        return list(_plan(c.budget, c.beta, c.omega, c.obs_window, seq_len, num_layers)[0])

    @staticmethod
    def select(policies: list[PyramidPolicy], view: RowsView) -> torch.Tensor | None:
        p = policies[0]
        c = p.config
        keep, edges = [], []  # per request, per lane
        nl, heads = view.num_layers, view.heads
        for r, (s, pl, done) in enumerate(zip(view.seq_len, view.prompt_len,
                                             view.prefill_done)):
            if done or s > pl:  # the prompt is complete: every layer to its budget
                budgets, sinks = _plan(c.budget, c.beta, c.omega, c.obs_window, s, nl // heads)
                keep.append([b for b in budgets for _ in range(heads)])  # each head its layer's
                edges.append([e for e in sinks for _ in range(heads)])
            else:
                keep.append(view.lengths[view.rows_of(r)])
                edges.append([0] * nl)
        keep, edges = view.by_layer(keep), view.by_layer(edges)
        within = view.within(keep)
        if not within and c.kernel_size == 1 and NATIVE["state"] and not view.adaptive \
                and view.slot_pos.device.type == "cpu":  # the window and the plan, one op
            return PyramidPolicy._shift_window(p, view, view.excess(keep), edges)
        if not view.accumulated:  # else the decode kernel wrote the window (`Needs.ring`)
            PyramidPolicy._shift_window(p, view)
        if within:
            return None
        scores = _torch_sums(p, view)
        if c.kernel_size != 1:
            scores = PyramidPolicy._kept_order_pool(scores, view.live, c.kernel_size)
        return keep_highest(view, scores, keep, first=edges, last=edges)

    @staticmethod
    def _shift_window(p: PyramidPolicy, view: RowsView, drop: list[int] | None = None,
                      edges: list[int] | None = None) -> torch.Tensor | None:
        """Write this step's window queries (summed over heads) into each slot's window
        state; given `drop` and `edges` (per row; C++ only), return the plan too: the
        drop mask `keep_highest` makes over `_torch_sums` keeping `edges` sinks and
        recent tokens.

        The window is a ring: query q of a request (0-based) owns column q mod α, so a
        new query overwrites the one α before it, which leaves the window. A step writes
        only its queries' columns (one column in decode) instead of shifting all α: the
        shift was three passes over α values per slot, most of pyramid's step. A column
        no query in the window wrote is 0, and so is a new slot's whole ring (no earlier
        query saw it), so the ring's sum is the window's exactly. Beside the ring each
        slot keeps that sum, in fixed point (`_window_ring`), so a step reads and writes
        one column and the total instead of every value: summing the whole ring each
        step read α values per slot. Both are the tables' own slices (`state_in_place`):
        copying them out and back cost more than the update.

        The plan (`state_cpu.cpp::pyramid_window`) sums only the rings that can decide
        it. The exact totals bound every float32 sum: a sum of α non-negative values is
        within α·2^-24 of the exact one, relatively. So a candidate whose exact total is
        above the d-th lowest's times (1 + 4α·2^-24), plus 2^-30 for the totals'
        rounding, sums above each of those d and is not dropped whatever its last bits:
        only the candidates at or below that mark (a few per row in decode) are summed,
        by torch, and the d lowest of those per row drop, ties toward the later slot as
        in `drop_lowest`. The update and the plan are one op: after the forward each
        distinct op of a policy step starts cold, and this was five. In decode the
        kernel does the update instead, as it writes the mass (`Needs.ring`,
        `view.accumulated`), and only the plan is left here."""
        a = p.config.obs_window
        k = view.num_new
        (ring_name,), (total_name,) = p.state, p.derived_state
        n, w = view.shape
        # Per request, the first of this step's queries inside the window: those at or
        # past prompt_len - α (every decode query; the last prompt chunk or two).
        firsts = [max(0, pl - a - (s - k)) for s, pl in zip(view.seq_len, view.prompt_len)]
        cols: list[int] = []  # row by row, query q's column q mod α (distinct per row)
        if view.accumulated or min(firsts) >= k:  # written by the kernel, or no window
            new = torch.zeros(n, 0, w)  # query yet in any row (the state stays 0)
        else:
            assert view.attention is not None
            kk = min(k, a)  # only the last α queries can stay in the window
            att = view.attention[:, k - kk:]
            new = att[:, :, 0] if att.shape[2] == 1 else att.sum(dim=2)  # [N, kk, W]
            if max(firsts) > k - kk:  # some rows' first queries are before their window
                # (their columns hold 0: every earlier query was before the window too)
                before = torch.arange(k - kk, k) < view.row_tensor(view.per_row(firsts))
                new = new.masked_fill(before[:, :, None], 0.0)
            if k == 1:  # decode: row l·R + r's query in column (s_r - 1) mod α
                cols = [(s - 1) % a for s in view.seq_len] * view.num_layers
            else:
                per_request = [[(s - k + j) % a for j in range(k - kk, k)] for s in view.seq_len]
                cols = [x for row in view.per_row(per_request) for x in row]
        native = NATIVE["state"] and view.slot_pos.device.type == "cpu"
        rows: list[int] = []
        if native and total_name in view.state:
            # the tables' state in place; where the group's rows are apart, whole, and
            # request r at its row rows[r] (`RowsView.whole`: no copy out and back)
            (ring, rows), (total, _) = view.whole(ring_name), view.whole(total_name)
        else:
            ring = view.layered(ring_name)  # [L, R, W, α]
            # The engine keeps the total beside the ring; a view without it (the pure
            # policy tests') gets it from the ring: the same bits by construction.
            total = view.layered(total_name) if total_name in view.state else \
                _split(_fixed(ring, _shift(a)).sum(dim=3))
        if native:
            plan = torch.ops.kvserve_policy_state.pyramid_window(
                ring, total, new, cols, view.slot_pos, edges or [], drop or [], _shift(a),
                4 * a * 2.0 ** -24 + 2.0 ** -22, 2.0 ** -30, rows)
            return plan if drop else None
        _window_ring(ring, total, new, torch.tensor(cols, dtype=torch.int64).view(n, new.shape[1]),
                     _shift(a))
        return None

    @staticmethod
    def _kept_order_pool(scores: torch.Tensor, live: torch.Tensor, kernel: int) -> torch.Tensor:
        """`pool_scores` over each row's live slots in kept order (dead slots between
        them are not neighbours): pack the live slots first, pool, put them back. The
        packed row's zeros past its live slots pool as the padding does."""
        if kernel == 1:
            return scores
        w = live.shape[1]
        ar = torch.arange(w)
        order = torch.where(live, ar, w + ar).argsort(dim=1)  # live slots first, in order
        pooled = pool_scores(scores.gather(1, order), kernel)
        return torch.empty_like(pooled).scatter_(1, order, pooled)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return prefill_envelope(seq_len, prompt_len, self.max_live_decoding(seq_len))

    def max_live_decoding(self, seq_len: int, prompt_len: int | None = None,
                          block_size: int | None = None) -> int:
        """A layer's most once the prompt is in: the bottom layer's C_1 <= 2C - C/β."""
        total = resolve_budget(self.config.budget, seq_len)
        return min(seq_len, max(total, round(2 * total - Fraction(total, self.config.beta))))

    def max_live_total(self, seq_len: int, prompt_len: int | None, block_size: int | None,
                       num_layers: int, decoding: bool = False) -> int:
        """Most live tokens summed over the layers: L·C (eq. 1, Σ C_l = L·C at every
        length), although one layer alone may hold up to 2C - C/β (`max_live`). What
        admission reserves, since blocks are fungible across layers: reserving
        L · max_live would hold about twice the memory the pyramid ever uses.
        `decoding`: once the prompt is in (the prompt, kept whole until then, left out)."""
        after = min(seq_len, resolve_budget(self.config.budget, seq_len))
        return num_layers * (after if decoding else prefill_envelope(seq_len, prompt_len, after))


# The window total in fixed point (`_window_ring`): _DIGITS float32 digits of _DIGIT bits.
_DIGITS, _DIGIT = 3, 21


def _shift(alpha: int) -> int:
    """Fractional bits of the window total: a query's mass (summed over at most 4,096
    heads, so < 2^12) times 2^shift, over α queries, stays below 2^62."""
    return 50 - max(0, (alpha - 1).bit_length())


def _window_ring(ring: torch.Tensor, total: torch.Tensor, new: torch.Tensor,
                 cols: torch.Tensor, shift: int) -> None:
    """Write `new` [N, k, W] into the ring [L, R, W, α] at columns `cols` [N, k] and keep
    each slot's window total, in place: the torch form of `pyramid_window`'s update
    (state_cpu.cpp), the same bits.

    The total is exact: a query's mass m counts as the integer round(m · 2^shift) (2^-45
    at α = 32, far below float32's resolution of any mass that ranks), the total is
    their int64 sum, held as _DIGITS float32 digits (state is float32), and an
    overwritten column leaves it as the same integer it entered as; so it is the ring's
    sum whatever the history, and the step touches one column instead of α."""
    nl, r, w = ring.shape[:3]
    k = new.shape[1]
    if not k:
        return
    digits = 2 ** (_DIGIT * torch.arange(_DIGITS))  # int64
    s = (total.long() * digits).sum(dim=3)  # [L, R, W]
    idx = cols.view(nl, r, 1, k).expand(nl, r, w, k)
    values = new.reshape(nl, r, k, w).transpose(2, 3)
    s += (_fixed(values, shift) - _fixed(ring.gather(3, idx), shift)).sum(dim=3)
    ring.scatter_(3, idx, values)
    total.copy_(_split(s))


def _torch_sums(p: PyramidPolicy, view: RowsView) -> torch.Tensor:
    """The scores pyramid ranks by: each slot's window mass as torch sums its ring in
    float32, [N, W] (0 on dead slots). A sum's last bits depend on its order and a near
    tie between two slots breaks by them, so this is the reference the C++ plan keeps
    (`PyramidPolicy._shift_window`).
    The ring is summed from a row-major copy: torch sums an inner contiguous dim in its
    own order, and a strided one (the tables keep the ring by columns) in another."""
    c = p.config
    ring = view.layered(next(iter(p.state)))  # [L, R, W, α]
    n, w = view.shape
    full = ring.contiguous().view(n, w, c.obs_window).sum(dim=2)
    return full.masked_fill(view.positions < 0, 0.0)


def _fixed(x: torch.Tensor, shift: int) -> torch.Tensor:
    """round(x · 2^shift) as int64, halves to even (as the C++ op's llrint)."""
    return torch.round(x.double() * 2.0 ** shift).long()


def _split(s: torch.Tensor) -> torch.Tensor:
    """int64 [...] -> [..., _DIGITS] float32 digits (low first; the top one keeps the sign)."""
    low = [(s >> (_DIGIT * d)) & (2 ** _DIGIT - 1) for d in range(_DIGITS - 1)]
    return torch.stack([*low, s >> (_DIGIT * (_DIGITS - 1))], dim=-1).float()
