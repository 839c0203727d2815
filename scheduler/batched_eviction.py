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

from kvpool.seq_cache import SeqCache
from policies.base import BatchView, Needs, Policy, StepView
from scheduler.eviction import gather_stats, live_layout, physical_slots


@dataclass
class Member:
    cache: SeqCache
    policy: Policy
    header: StepView  # `eviction.step_header` of this step
    attention: list[torch.Tensor] | None  # per layer [1, Hkv, S] (runner output)
    live: tuple[torch.Tensor, torch.Tensor] | None = None  # `live_layout`, if computed


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


def build_batch(members: list[Member]) -> tuple[BatchView, list[torch.Tensor]]:
    """The members' stacked view and, per member, the logical slot of each row token
    ([L, n]): what a drop index maps back to."""
    first = members[0].cache
    nl, n = first.num_layers, members[0].header.lengths[0]
    needs = members[0].policy.needs
    idxs, positions, att, phys, newest = [], [], [], [], []
    for m in members:
        sp, live = m.live or live_layout(m.cache)
        idx = live.nonzero()[:, 1].view(nl, n)
        idxs.append(idx)
        positions.append(sp.gather(1, idx))
        if needs.attention and m.attention is not None:
            a = torch.stack(m.attention)[:, 0]  # [L, Hkv, S]
            att.append(a.gather(2, idx[:, None, :].expand(nl, a.shape[1], n)))
        if needs.key_norm or needs.keys or needs.value_norm:
            phys.append(physical_slots(m.cache, idx))
        if needs.new_key_norm:  # a decode step: the one new token is each row's last
            newest.append(physical_slots(m.cache, idx[:, -1:]))
    view = BatchView(seq_len=[m.header.seq_len for m in members],
                     prompt_len=[m.header.prompt_len for m in members], num_layers=nl,
                     positions=torch.cat(positions))
    rows = view.positions.shape[0]
    if att:
        view.attention = torch.cat(att)
    if phys:
        for name, t in gather_stats(first.pool, torch.cat(phys).view(-1), needs).items():
            setattr(view, name, t.view(rows, n, *t.shape[1:]))
    if newest:
        norms = gather_stats(first.pool, torch.cat(newest).view(-1), Needs(key_norm=True))
        view.new_key_norm = norms["key_norm"].view(rows, 1, -1)
    return view, idxs


def run_batch(members: list[Member]) -> list[torch.Tensor] | None:
    """Every member's drops as logical slots ([L, d] each; d may be 0), or None when
    the policy declines the batch (nothing changed: run each member alone)."""
    view, idxs = build_batch(members)
    drops = type(members[0].policy).step_batch([m.policy for m in members], view)
    if drops is None:
        return None
    return [idx.gather(1, d) for idx, d in zip(idxs, drops)]
