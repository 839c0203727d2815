"""The policy contract and the helpers several policies share.

A policy is a small object built from one request's validated `kv_policy` config. After
every step that computed tokens for its request the engine hands the step's requests of
equal policies to the policy class together (`select`, policies/rows.py: a `RowsView`
of every (request, layer) as a row of slots, with the statistics the policy declared in
`needs` and its per-slot `state`), and the class answers with the slots to drop. It
never frees memory nor reads the pool: the engine carries the drops out (marking slots
dead, returning empty blocks at once, optionally compacting or re-rotating keys), so a
policy is a pure function of (configs, its state, the view), testable without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

# Set by the engine once the C++ selection (policies/csrc/select_cpu.cpp) and state
# updates (state_cpu.cpp) are loaded (kvpool/policy_rows.py::load_select).
NATIVE: dict[str, bool] = {"select": False, "state": False}


@dataclass(frozen=True)
class Needs:
    """Statistics a policy asks for; the engine computes only these, only for it.
    Frozen (a policy that changes what it needs assigns a new one), so it can be part
    of a group's key."""

    attention: bool = False  # attention mass of this step's queries over live tokens
    # ... per kv head; without it the mass comes summed over the heads ([.., Tq, 1, W]),
    # which is all the decode-time policies read (a pass over Hkv× less data for each).
    attention_heads: bool = False
    key_norm: bool = False  # ‖K‖₂ per live token and kv head
    value_norm: bool = False  # ‖V‖₂ per live token and kv head
    keys: bool = False  # the key vectors themselves (as stored: rotated)
    # KeyDiff's score per live slot, -cos(k, the row's mean unit key) averaged over the
    # kv heads: computed by the pool over its keys in place (attention/key_stats.py), so a
    # step reads every key once per pass instead of copying them all into the view.
    key_diversity: bool = False
    # ‖K‖₂ of this step's new tokens only: for a policy that keeps each token's score as
    # per-slot state from the step that computed it (a stored key never changes), so a
    # step costs O(new).
    new_key_norm: bool = False
    new_value_norm: bool = False  # ‖V‖₂ of this step's new tokens only (the same reason)
    # With `attention`: the per-slot state (a name of the policy's `state`) the step's
    # mass, summed over heads and queries, is added into. Where the decode kernel can
    # (attention/cpu_attention.py::accumulates) it adds each row as it writes it, and the
    # view says so (`RowsView.accumulated`); else the policy adds the view's mass itself.
    accumulate: str | None = None
    # With `attention`: a window ring, (state, its total's state, fixed-point bits), that
    # each decode query's mass, summed over heads, is written into as its column (query
    # index mod α; pyramid's observation window, policies/pyramid.py::_shift_window).
    # Where the decode kernel can, it writes the column and the total as it writes the
    # mass (native/csrc/window_ring.h: the same bits), and the view says so.
    ring: tuple[str, str, int] | None = None
    # (first, outer): the sums of the pre-RoPE queries of this step's prompt tokens at
    # positions >= first, per layer and query head (Σq, and Σqqᵀ if `outer`): what
    # Expected Attention models the future queries with (policies/expected_attention.py).
    query_stats: tuple[int, bool] | None = None

    @property
    def sees_prompt(self) -> bool:
        """Whether the statistics come from the prompt's own queries, which a prefix-cache
        hit would skip: such a request computes its prompt instead."""
        return self.attention or self.query_stats is not None

    def __hash__(self) -> int:
        """The fields' hash, computed once: every running request's group key holds its
        policy's `Needs`, and the generated hash re-hashed every field each step."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f) for f in self.__dataclass_fields__))
            object.__setattr__(self, "_hash", h)
        return h


@dataclass(slots=True)
class StepView:
    """A request's step in sizes only, for `Policy.idle`: the engine decides from it
    whether the policy has anything to do before it builds any view."""

    seq_len: int  # tokens processed so far (prompt + generated, whose K/V were computed)
    prompt_len: int
    num_new: int  # tokens computed this step
    prefill_done: bool  # this step computed the last prompt token (first time only)
    block_size: int
    lengths: list[int] = field(default_factory=list)  # live tokens per layer, before the plan

    @property
    def num_layers(self) -> int:
        return len(self.lengths)


class Policy(Protocol):
    name: str
    needs: Needs  # may be narrowed after a step (e.g. snapkv stops needing attention)

    # Optional: `state: dict[str, float]` (usually a ClassVar), per-slot values the
    # engine keeps for the policy beside each token (name -> a new slot's value), handed
    # over as `RowsView.state` and written back after `select`. Also optional:
    # `state_in_place` (names handed as the tables' own [L, R, W(, k)] slices, for state
    # a step changes in a few places: read them with `RowsView.layered`),
    # `state_columns` (names whose k values per slot the tables store column by column)
    # and `derived_state` (state that caches a function of `state`, e.g. pyramid's window
    # total: kept and moved like it by the engine; `select` must not need it).

    # `select(policies, view: RowsView) -> Tensor | None`, a staticmethod of the class
    # taking the policies of the view's requests (equal configs): the [N, W] bool mask
    # of the slots to drop (None: nothing), per-slot state updated in place.

    # Optional: `idle(view: StepView) -> bool`: True only when `select` would drop
    # nothing *and* leave the policy's state unchanged, so the engine may skip the
    # request this step. A policy that accumulates statistics every step (h2o, pyramid,
    # lazy_eviction) has none (tests/test_policies_idle.py checks every `idle`).

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        """Most live tokens any one layer holds after this policy's plan was applied, at
        any step whose sequence length is <= seq_len (non-decreasing in seq_len).

        `prompt_len` None means the worst prompt length; `block_size` (the pool's) only
        matters to block-granular policies. During a step, before the plan, a layer
        also holds that step's new tokens: the engine adds one chunk to this bound."""
        ...

    # Optional: `max_live_total(seq_len, prompt_len, block_size, num_layers,
    # decoding=False) -> int`, the most live tokens summed over all layers, for a policy
    # whose layers hold different counts (pyramid): admission reserves by it when it is
    # below num_layers · max_live (blocks are fungible across layers).

    # Optional: `max_live_decoding(seq_len, prompt_len, block_size) -> int`, `max_live`
    # counting only the steps after the prompt is complete, for a policy that keeps the
    # prompt whole until it ends (`prefill_envelope`): a request's steady state, what
    # admission reserves for it once its prompt is in (the prompt is its peak).


def resolve_budget(budget: int | float, length: int) -> int:
    """A budget is a token count (int >= 1) or a ratio of `length` (float in (0, 1])."""
    if isinstance(budget, float):
        return max(1, round(budget * length))
    return budget


def prompt_budget(budget: int | float, view: StepView) -> int:
    """C during a prompt and after it: resolved on the whole prompt length while the
    prompt is still being computed (so every prompt chunk aims at the C the prompt's end
    will have), on the sequence length from then on."""
    return resolve_budget(budget, max(view.seq_len, view.prompt_len))


def chunked_envelope(budget: int | float, seq_len: int, prompt_len: int | None,
                     over: int = 0, least: int = 0) -> int:
    """`max_live` of a policy that evicts down to C after every prompt chunk and keeps
    at most C + `over` tokens in decode (C = `prompt_budget`, at least `least`: a
    window the policy keeps whatever the budget): bounded from the first prompt token
    on. A ratio budget with an unknown prompt length bounds nothing."""
    if prompt_len is None and isinstance(budget, float):
        return seq_len
    c = max(resolve_budget(budget, max(seq_len, prompt_len or 0)), least)
    return min(seq_len, c + (over if prompt_len is None or seq_len > prompt_len else 0))


def prefill_envelope(seq_len: int, prompt_len: int | None, after: int) -> int:
    """`max_live` of a policy that evicts nothing before the prompt is complete and at
    most `after` live tokens from then on: intermediate prefill chunks keep up to
    prompt_len - 1 tokens, and with an unknown prompt length every token may still be
    part of the prompt."""
    if prompt_len is None or seq_len < prompt_len:
        return seq_len
    return min(seq_len, max(prompt_len - 1, after))


def prompt_once_live(budget: int | float, seq_len: int, prompt_len: int | None,
                     decoding: bool = False) -> int:
    """`max_live` of a policy that compresses the complete prompt once to its budget and
    never evicts a generated token (SnapKV, Expected Attention); `decoding`: its
    `max_live_decoding`, the prompt's own peak left out."""
    if prompt_len is None:
        return seq_len
    kept = min(prompt_len, resolve_budget(budget, prompt_len))
    after = min(seq_len, kept + max(0, seq_len - prompt_len))
    return after if decoding else prefill_envelope(seq_len, prompt_len, after)


def sum_dims(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """t summed over `dims`, which are dropped. Where they all have size 1 (a decode
    step's one query, the view's one kv group) a view of t: the same values, and torch's
    sum would still run a reduction kernel over them."""
    if all(t.shape[d] == 1 for d in dims):
        return t.squeeze(dims)
    return t.sum(dim=dims)


def head_parts(attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_mean`'s numerator [..., Tq, n] and denominator [..., Tq], for a caller that
    divides elsewhere (LazyEviction's C++ tracking) and must round as it does.

    On CPU with the policies' C++ ops the denominator is `row_sums`
    (policies/csrc/state_cpu.cpp): torch's sum of a decode step's [rows, slots] runs on
    OpenMP threads that a server leaves asleep, a wake-up per step."""
    if NATIVE["state"] and attention.device.type == "cpu" and attention.dtype == torch.float32:
        flat = attention.flatten(-2)
        total = torch.ops.kvserve_policy_state.row_sums(flat.reshape(-1, flat.shape[-1]))
        return sum_dims(attention, (-2,)), total.view(attention.shape[:-2])
    return (sum_dims(attention, (-2,)),
            attention.sum(dim=(-2, -1), keepdim=False).clamp_min(1e-30))


def head_mean(attention: torch.Tensor) -> torch.Tensor:
    """[..., Tq, Hkv, n] mass summed per kv group -> [..., Tq, n] probability averaged
    over all query heads (each query row sums to 1 over its live tokens; a row of the
    view sums to H = Hkv·G)."""
    per, total = head_parts(attention)
    return per / total[..., None]
