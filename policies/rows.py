"""What a policy sees and returns on the one policy path: a batch of rows.

A step's requests under one policy class and config are handed to the policy together
(`select`), a single request being a batch of one. Row l·R + r is layer l of request
r, over that layer's logical slots 0..W-1 in table order — which is position order, so
"the most recent tokens" are the last live slots and ties that break toward the earlier
position break toward the lower slot. Rows hold different live counts (a prefill chunk,
pyramid's per-layer budgets, lazy clocks) as a `live` mask rather than as ragged
lists, so a policy scores and selects for every row with one op per stage whatever the
number of requests, and answers with a drop mask over the same slots.

Per-token state a policy keeps (H2O's cumulative attention, LazyEviction's activation
times) lives beside the positions in the engine's `SlotTables` (declared by the
policy's `state`: name -> a new slot's value): the view carries it as [N, W] tensors
that the policy updates in place, and the engine writes them back. It moves with its
token when blocks are freed or compacted, so no policy re-aligns state by position.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import torch

from policies.base import NATIVE, resolve_budget
from policies.heads import adaptive_drops

# Up to this many drops per row a partial top-k plus a tie count beats a full stable sort
# (about 10x on a thousand scores); beyond it (a prompt's one big plan) we sort.
_TOPK_MAX = 64


@dataclass
class RowsView:
    """A group's step: row l·R + r is layer l of request r, over its W logical slots
    (layer-major, the engine's tables' own order, so the view costs no transpose)."""

    num_layers: int  # lanes: layers, or (layer, kv head) pairs over a per-head pool
    num_new: int  # tokens computed this step per request (queries of `attention`)
    seq_len: list[int]  # per request: tokens processed so far, this step's included
    prompt_len: list[int]
    prefill_done: list[bool]  # per request: this step computed the last prompt token
    lengths: list[int]  # per row: live slots before the plan (host ints, no sync)
    # Original position per slot, -1 = none: [N, W] int64, or [L, R, W] as the engine's
    # tables hold it (row l·R + r at [l, r], their own slice when the rows are
    # consecutive). The C++ ops read either in place; `positions` is the [N, W] form.
    slot_pos: torch.Tensor
    block_size: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # [N, W(, k)] float32
    # Names of `state` handed as [L, R, W(, k)] slices of the engine's tables (the
    # policy's `state_in_place`), updated in place without a copy out and back; read
    # them through `layered`, which gives every state that shape.
    in_place: frozenset[str] = frozenset()
    # Where the group's rows are not consecutive, the in-place states named here (stored
    # by columns: pyramid's ring and total) are handed whole, [L, every row, W, k], and
    # request r of the view is their row state_rows[r]: a C++ op reads them there
    # (`whole`); `layered` copies the rows out on first use (`copy_rows`, the engine's
    # copy of those rows), and the engine puts that copy back. Copying them out for
    # every step was the cost (a ring is 128 bytes a slot).
    handed_whole: frozenset[str] = frozenset()
    state_rows: list[int] = field(default_factory=list)
    copy_rows: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    gathered: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # [N, Tq, Hkv, W] float32: this step's queries' probability mass on each slot,
    # summed over the query heads of each kv group (0 on dead slots); Hkv is 1, the sum
    # over every head, unless the policy asked for `Needs.attention_heads`.
    attention: torch.Tensor | None = None
    # The step's mass was added into the policy's `Needs.accumulate` state during
    # attention (decode, the kernel's): `attention` is None then.
    accumulated: bool = False
    key_norm: torch.Tensor | None = None  # [N, W, Hkv] float32 (dead slots: anything)
    value_norm: torch.Tensor | None = None
    keys: torch.Tensor | None = None  # [N, W, Hkv, D] float32, as stored (rotated)
    # [N, W] float32: `policies.norms.keydiff_scores` of the row's live keys (dead: any)
    key_diversity: torch.Tensor | None = None
    new_slots: torch.Tensor | None = None  # [N, num_new]: this step's tokens' slots
    # [3, N, num_new]: (layer, request, slot) of each of them, as `layered` indexes: the
    # engine builds it with `new_slots` in one host-made tensor (`set_new` else derives it).
    new_index: torch.Tensor | None = None
    new_key_norm: torch.Tensor | None = None  # [N, num_new, Hkv] float32
    new_value_norm: torch.Tensor | None = None  # [N, num_new, Hkv] float32
    # Lanes a layer has: 1, or its kv heads over a per-head pool (`--kv-layout head`),
    # where lane l·heads + h is kv head h of layer l and keeps its own tokens (its
    # statistics are that head's: Hkv = 1 above). A policy that treats layers apart
    # (pyramid's budgets) reads layer = lane // heads.
    heads: int = 1
    # `"heads": "adaptive"` (AdaKV, policies/heads.py): the drops `keep_highest` makes are
    # spread over a layer's heads by score instead of each head dropping to its budget.
    adaptive: bool = False
    # The served model's head roles (`kv_head_roles.json`), [lanes] float32, higher =
    # more needed for retrieval: what `duo` reads to choose its streaming heads.
    head_roles: torch.Tensor | None = None
    # `Needs.query_stats`: this step's pre-RoPE query sums of each row's query heads,
    # [N, Hkv, G, D] float64 (Hkv as `keys` has it, G query heads a kv head), their outer
    # products [N, Hkv, G, D, D] (None unless asked), the tokens summed per request, and
    # the model's RoPE: (inv_freq [rotary_dim // 2], the attention scaling), and its
    # attention softmax's scale (ModelConfig.attn_scale: Gemma's query_pre_attn_scalar).
    query_sum: torch.Tensor | None = None
    query_outer: torch.Tensor | None = None
    query_count: list[int] = field(default_factory=list)
    rope: tuple[torch.Tensor, float] | None = None
    attn_scale: float | None = None
    _live: torch.Tensor | None = field(default=None, repr=False)
    _positions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.seq_len)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, W): rows and slots."""
        w = self.slot_pos.shape[-1]
        return self.slot_pos.numel() // max(1, w), w

    @property
    def positions(self) -> torch.Tensor:
        """[N, W] int64 positions: `slot_pos`, or its copy made on first use when it is
        the tables' [L, R, W] slice. For the torch forms: the C++ ops read `slot_pos`
        where it lies (copying ~0.5 MB of positions out of the tables was ~70 us of a
        policy step at 16 requests of ~1k tokens)."""
        if self._positions is None:
            self._positions = self.slot_pos.reshape(self.shape)
        return self._positions

    def positions_of(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, W] int64: the positions of rows `rows` [M], copied from `slot_pos`."""
        if self.slot_pos.dim() == 2:
            return self.slot_pos[rows]
        r = self.slot_pos.shape[1]
        return self.slot_pos[rows // r, rows % r]

    @property
    def live(self) -> torch.Tensor:
        """[N, W] bool: the slots holding a token."""
        if self._live is None:
            self._live = (self.slot_pos >= 0).reshape(self.shape)
        return self._live

    @property
    def live_or_positions(self) -> torch.Tensor:
        """What `drop_lowest` reads to tell live slots: the live mask if a policy has
        built it already (a byte a slot), else the positions where they lie (a mask made
        only for the selection would cost more than the eight bytes a slot it saves)."""
        return self._live if self._live is not None else self.slot_pos

    def layered(self, name: str) -> torch.Tensor:
        """State `name` as [L, R, W(, k)] (row l·R + r at [l, r]): the tables' slice as
        handed, or a view of the [N, W(, k)] copy."""
        t = self.state[name]
        if name in self.handed_whole:  # the group's rows, copied out once
            if name not in self.gathered:
                assert self.copy_rows is not None
                self.gathered[name] = self.copy_rows(t)
            return self.gathered[name]
        if name in self.in_place:
            return t
        return t.view(self.num_layers, self.num_requests, *t.shape[1:])

    def whole(self, name: str) -> tuple[torch.Tensor, list[int]]:
        """In-place state `name` for a C++ op that reads rows by index: the tensor and
        request r's row in it (none: r itself, the view's own rows)."""
        if name in self.handed_whole and name not in self.gathered:
            return self.state[name], self.state_rows
        return self.layered(name), []

    def set_new(self, name: str, values: torch.Tensor) -> None:
        """State `name` of this step's new tokens (`new_slots`) := values [N, k], written
        through `layered` (in place in the tables for a `state_in_place` name)."""
        assert self.new_slots is not None
        t = self.layered(name)
        if self.new_index is not None:
            t[self.new_index[0], self.new_index[1], self.new_index[2]] = values
            return
        rows = torch.arange(self.new_slots.shape[0])[:, None].expand_as(self.new_slots)
        t[rows // self.num_requests, rows % self.num_requests, self.new_slots] = values

    def set_new_norm_score(self, name: str, key_norm: torch.Tensor,
                           value_norm: torch.Tensor | None,
                           torch_form: Callable[[], torch.Tensor]) -> None:
        """`set_new(name, torch_form())` for the two scores of the new tokens' norms
        ([N, k, Hkv] each): knorm's -mean over heads of ‖k‖ (`value_norm` None) and
        PagedEviction's mean of ‖v‖ / max(‖k‖, 1e-12). On CPU with up to four kv heads
        one C++ op (state_cpu.cpp::new_scores) gives the torch form's bits: torch sums
        that few values of an inner dim in order, then divides. After the forward each
        of the torch form's ops (the mean, a negation or a clamp and a division, the
        scatter) starts cold, ~50 us a step together."""
        if NATIVE["state"] and self.new_index is not None and key_norm.device.type == "cpu" \
                and key_norm.shape[-1] <= 4:
            torch.ops.kvserve_policy_state.new_scores(self.layered(name), self.new_index,
                                                      key_norm, value_norm)
            return
        self.set_new(name, torch_form())

    def rows_mask(self, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A plan [N, W] from one made for some rows only (`rows` [M], `mask` [M, W]):
        the other rows drop nothing. For policies that score only the rows deciding this
        step (rows are independent)."""
        out = torch.zeros(self.shape, dtype=torch.bool)
        out[rows] = mask
        return out

    def per_row(self, values: list[int] | list[float] | list[bool]) -> list:
        """Per-request host values repeated for each of its layers' rows."""
        return list(values) * self.num_layers  # rows are lane-major

    def by_layer(self, values: list[list]) -> list:
        """Per request, per layer host values ([R][L]) as one per row."""
        return list(chain.from_iterable(zip(*values)))  # lane-major: transposed

    def rows_of(self, r: int) -> slice:
        """Request r's rows (one per layer), as a slice of the row dim."""
        return slice(r, None, self.num_requests)

    def budgets(self, budget: int | float, from_prompt: bool = False) -> list[int]:
        """Per row, the tokens a budget keeps: C resolved on the sequence length once
        the prompt is complete and every token before; `from_prompt`: C resolved on
        the whole prompt's length from its first chunk on (bounded prefill)."""
        keep = []
        for s, p, done in zip(self.seq_len, self.prompt_len, self.prefill_done):
            if from_prompt:
                keep.append(resolve_budget(budget, max(s, p)))
            else:
                keep.append(resolve_budget(budget, s) if done or s > p else s)
        return self.per_row(keep)

    def excess(self, keep: list[int]) -> list[int]:
        """Per row, the live tokens past keep[i] (0 where within): what it drops. A row a
        (lane, request), 128 at 16 requests of 4 layers of 2 kv heads: no call a row."""
        return [d if d > 0 else 0 for d in map(operator.sub, self.lengths, keep)]

    def within(self, keep: list[int]) -> bool:
        """Every row holds at most keep[i] live tokens: nothing to drop."""
        return all(map(operator.le, self.lengths, keep))

    def row_tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Per-row host values as an [N, 1] tensor, to broadcast against [N, W]."""
        return torch.tensor(values, dtype=dtype)[:, None]


def live_from_end(live: torch.Tensor) -> torch.Tensor:
    """[N, W] bool -> [N, W] int: live slots at or after each slot in its row (1 on the
    newest live slot), so `live & (from_end <= w)` is the most recent w tokens."""
    return live.flip(1).cumsum(dim=1).flip(1)


def _ints(values: list[int]) -> torch.Tensor:
    """Host ints as a 1-D int64 tensor through `array` (native/host.py's `int64_tensor`,
    ~3x cheaper than `torch.tensor(list)`; policies import no other layer)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _per_row(values: list[int] | int, n: int) -> torch.Tensor:
    return _ints(values if isinstance(values, list) else [values] * n)


def drop_lowest(positions: torch.Tensor, scores: torch.Tensor, drop: list[int],
                first: list[int] | int = 0, last: list[int] | int = 0,
                divisor: torch.Tensor | None = None) -> torch.Tensor:
    """The policies' one selection: the [N, W] bool mask of the drop[i] lowest-scoring
    candidates of each row (`scores` [N, W], or a state as `RowsView.layered` gives it,
    [L, R, W], which the C++ op reads in place), a candidate being a live slot
    (positions >= 0; `positions` [N, W] or [L, R, W] as `RowsView.slot_pos`, or the rows'
    bool live mask, `RowsView.live`, which the C++ op reads at a byte a slot instead of
    eight) outside the
    row's first `first[i]` and last `last[i]` live slots (sinks, the recent window;
    an int for every row). Ties toward the later slot (among equal scores the earlier
    token stays) and a NaN above every number: exactly the last drop[i] candidates of a
    stable descending sort.

    On CPU a C++ op reads each row once (policies/csrc/select_cpu.cpp). The torch form:
    decode drops a token or a few per row, so a top-k finds each row's drop[i]-th lowest
    value t, then every candidate < t and of those == t the last ones; a NaN among the
    lowest (sort and top-k may order NaN differently), a threshold at the mask's +inf
    (NaN candidates to drop) or a large drop takes the sort.

    `divisor` [N] float32: rank row i's scores / divisor[i] (TOVA's head mean: a mass
    over the row's total), the quotients as torch divides, which can tie values the
    scores do not; the C++ op divides as it reads a row instead of a pass of its own."""
    w = positions.shape[-1]
    n = math.prod(positions.shape[:-1])
    dmax = max(drop, default=0)
    if dmax == 0:
        return torch.zeros(n, w, dtype=torch.bool)
    if NATIVE["select"] and scores.device.type == "cpu":  # reads [L, R, W] scores in place
        # the three per-row counts as one host-made tensor (each is ~6 us to make)
        counts = _ints([*(first if isinstance(first, list) else [first] * n),
                        *(last if isinstance(last, list) else [last] * n),
                        *drop]).view(3, n)
        if scores.dtype != torch.float32:
            scores = scores.float()
        return torch.ops.kvserve_policies.select_drop(scores, positions, counts, divisor)
    positions = positions.reshape(n, w)  # [L, R, W] -> [N, W] (a copy)
    scores = scores.reshape(n, w)  # [L, R, W] state -> [N, W] (a copy)
    if divisor is not None:
        scores = scores / divisor[:, None]
    live = positions if positions.dtype == torch.bool else positions >= 0
    cand = live
    if first != 0:
        cand = cand & (live.cumsum(dim=1) > _per_row(first, n)[:, None])
    if last != 0:
        cand = cand & (live_from_end(live) > _per_row(last, n)[:, None])
    d = torch.tensor(drop)[:, None]
    masked = scores.masked_fill(~cand, float("inf"))
    if dmax <= min(_TOPK_MAX, scores.shape[1] - 1):
        low = torch.topk(masked, dmax, dim=1, largest=False).values
        t = low.gather(1, (d - 1).clamp(min=0))
        # a NaN, or a threshold at the mask's +inf (NaN candidates to drop), takes the sort
        if not bool((torch.isnan(low).any(dim=1, keepdim=True) | torch.isinf(t)).logical_and(d > 0).any()):
            below = masked < t
            tied = masked == t
            wanted = d - below.sum(dim=1, keepdim=True)  # ties to drop, from the end
            from_end = tied.flip(1).cumsum(dim=1).flip(1)
            return (below | (tied & (from_end <= wanted))) & cand & (d > 0)
    # Candidates last (a NaN sorts above +inf, so the mask's +inf alone cannot put
    # non-candidates first), each group in stable descending score order.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(cand.gather(1, order).to(torch.uint8), dim=1,
                                       stable=True).indices)
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
    return (rank >= order.shape[1] - d) & cand


def drop_earliest(view: RowsView, drop: list[int], first: int = 0) -> torch.Tensor | None:
    """The drop mask of each row's drop[i] oldest live tokens after its first `first`
    (the streaming family keeps sinks and the most recent); None when no row drops.
    On CPU a C++ walk stops at each row's last drop; the torch form is a cumsum."""
    if not any(drop):
        return None
    if NATIVE["select"] and view.slot_pos.device.type == "cpu":
        return torch.ops.kvserve_policies.drop_earliest(
            view.slot_pos, _per_row(first, len(drop)), _ints(drop))
    live = view.live
    rank = live.cumsum(dim=1)  # 1 on the first live slot
    return live & (rank > first) & (rank <= view.row_tensor(drop) + first)


def keep_highest(view: RowsView, scores: torch.Tensor, keep: list[int],
                 first: list[int] | int = 0, last: list[int] | int = 0,
                 divisor: torch.Tensor | None = None) -> torch.Tensor:
    """The drop mask that leaves keep[i] live tokens in row i: its first `first` and
    last `last` live ones (together at most keep[i]) and the highest `scores` ([N, W],
    or [L, R, W] as `drop_lowest` takes it; over `divisor` as it says) among the rest.
    Rows already within keep[i] drop nothing. `view.adaptive`: a layer's heads keep the
    sum of keep[i] over them, by score (AdaKV, `adaptive_drops`)."""
    if view.adaptive:
        drop = adaptive_drops(scores, view.live, view.lengths, keep, view.heads,
                              view.num_requests, first, last, divisor)
    else:
        drop = view.excess(keep)
    return drop_lowest(view.live_or_positions, scores, drop, first, last, divisor)
