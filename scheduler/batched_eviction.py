"""Carrying out one decode step of many requests' scoring policies at once.

Why: a scoring policy (h2o, tova, knorm, keydiff) plans on every decode step once its
request is at the budget, and the per-request path (`scheduler/eviction.py`: build a
view, `policy.step`, apply the plan) costs a few dozen small tensor ops per request —
at 30 requests that was half of the whole engine step. In that steady state every
(request, layer) holds the same n = C + 1 live tokens, so R requests of one policy
class and config stack into [R·L, n] rows: the view is gathered with a handful of ops
per request, the policy selects once for all rows (`step_batch`), and the drops go back
to each cache as logical slots (`SeqCache.evict_slots`), with no position search.

The kept sets are exactly the per-request path's (tests/test_policies_batched.py runs
both engines side by side); anything outside the steady state — prefill chunks, uneven
layers, `rope: "shift"`, `compact`, a ratio budget resolving differently per member —
takes the per-request path.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from engine.runner import AttentionMass
from kvpool.seq_cache import SeqCache
from policies.base import BatchView, Needs, Policy, StepView
from scheduler.eviction import gather_stats


@dataclass
class Member:
    cache: SeqCache
    policy: Policy
    header: StepView  # `eviction.step_header` of this step
    attention: AttentionMass | None  # the runner's output for this request


def batch_key(policy: Policy, config: Hashable, header: StepView, rope_shift: bool,
              compact: bool) -> tuple | None:
    """The group a request's step may join, or None for the per-request path: a
    decode step after the prompt, every layer at the same live count, a policy class
    with `step_batch`, no re-rotation or compaction to carry out. Members also share
    what they need now (knorm asks for every norm once, then for the new token's)."""
    lengths = header.lengths
    if (header.num_new != 1 or header.seq_len <= header.prompt_len or rope_shift or compact
            or not hasattr(type(policy), "step_batch") or not lengths
            or lengths.count(lengths[0]) != len(lengths)):
        return None
    return type(policy), config, lengths[0], policy.needs


def _member_major(t: torch.Tensor) -> torch.Tensor:
    """[L, R, ...] -> [R·L, ...] (row r·L + l, the BatchView order)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _attention(members: list[Member], idx: torch.Tensor) -> torch.Tensor:
    """The members' mass at their live slots, [R·L, Hkv, n]: per group tensor of the
    runner (usually one), one row select and one gather. Gathered per group before
    joining, because groups may be padded to different slot widths."""
    nl, n = members[0].cache.num_layers, idx.shape[1]
    per_member = idx.view(len(members), nl, n)
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i, m in enumerate(members):
        assert m.attention is not None
        g = groups.setdefault(id(m.attention.group), (m.attention.group, [], []))
        g[1].append(m.attention.row)
        g[2].append(i)
    parts, order = [], []
    for group, rows, which in groups.values():
        sel = _member_major(group[:, :, 0].index_select(1, torch.tensor(rows)))  # [r·L, Hkv, S]
        at = per_member[torch.tensor(which)].view(-1, n)  # [r·L, n]
        parts.append(sel.gather(2, at[:, None, :].expand(-1, sel.shape[1], n)))
        order += which
    a = torch.cat(parts) if len(parts) > 1 else parts[0]
    if order != sorted(order):  # back to member order
        rank = torch.tensor(order).argsort()
        a = a.view(len(members), nl, *a.shape[1:]).index_select(0, rank).view(a.shape)
    return a


def build_batch(members: list[Member]) -> tuple[BatchView, torch.Tensor]:
    """The members' stacked view and the logical slot of each row token ([R·L, n]):
    what a drop index maps back to. A fixed number of ops whatever R: the members'
    rows of the shared tables are read with one gather each."""
    first = members[0].cache
    tables, nl, bs = first.tables, first.num_layers, first.bs
    n = members[0].header.lengths[0]
    needs = members[0].policy.needs
    rows = torch.tensor([m.cache.row for m in members], dtype=torch.int64)
    width = max(max(m.cache.next_slot) for m in members)
    sp = tables.slot_pos[:, :, :width].index_select(1, rows)  # [L, R, width]
    sp = _member_major(sp)  # [R·L, width]
    idx = (sp >= 0).nonzero()[:, 1].view(-1, n)  # every row holds exactly n live
    view = BatchView(seq_len=[m.header.seq_len for m in members],
                     prompt_len=[m.header.prompt_len for m in members], num_layers=nl,
                     positions=sp.gather(1, idx))
    if needs.attention and all(m.attention is not None for m in members):
        view.attention = _attention(members, idx)
    if needs.key_norm or needs.keys or needs.value_norm or needs.new_key_norm:
        nb = -(-width // bs)
        table = _member_major(tables.table[:, :, :nb].index_select(1, rows))  # [R·L, nb]
        phys = table.gather(1, idx // bs) * bs + idx % bs
        rows_n = phys.shape[0]
        if needs.key_norm or needs.keys or needs.value_norm:
            for name, t in gather_stats(first.pool, phys.view(-1), needs).items():
                setattr(view, name, t.view(rows_n, n, *t.shape[1:]))
        if needs.new_key_norm:  # a decode step: the one new token is each row's last
            norms = gather_stats(first.pool, phys[:, -1], Needs(key_norm=True))
            view.new_key_norm = norms["key_norm"].view(rows_n, 1, -1)
    return view, idx


def run_batch(members: list[Member]) -> list[torch.Tensor] | None:
    """Every member's drops as logical slots ([L, d] each; d may be 0), or None when
    the policy declines the batch (nothing changed: run each member alone)."""
    view, idx = build_batch(members)
    drops = type(members[0].policy).step_batch([m.policy for m in members], view)
    if drops is None:
        return None
    nl = view.num_layers
    per_member = idx.view(len(members), nl, -1)
    if len({d.shape[1] for d in drops}) == 1:  # one gather for all
        d = torch.stack(drops)
        return list(per_member.gather(2, d).unbind(0))
    return [i.gather(1, d) for i, d in zip(per_member, drops)]
