"""The bridge between the policies and the pool on the one policy path, behind the
KV-cache manager's door (`KVCacheManager.run_policy`: the scheduler's policy runner
never reads the tables itself).

A step's requests whose policies are equal (class and config) and computed the same
number of tokens form a group; the group is read from the shared `SlotTables` as one
`RowsView` (rows l·R + r over each layer's logical slots: the tables' own [L, R, ...]
order, so reading and writing back are views and one copy, a fixed number of ops
whatever the group's size), the policy class selects for every row at once
(`select`), its per-slot state goes back to the tables in one copy per name, and the
drops are carried out for every member at once (`SlotTables.evict_mask`). A request
alone is a group of one: there is no other path.

Re-rotation for `rope: "shift"` and `compact` act on the members that asked, after
their drops, one request at a time (rare, and inherently per request).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import chain

import torch

from attention.stats import AttentionMass
from kvpool import compaction
from kvpool.head_stats import head_sum, share_heads
from kvpool.rows import by_columns, consecutive, put_rows, rows_slice, take_rows
from kvpool.seq_cache import SeqCache
from native.build import load_ops
from native.host import int64_tensor
from policies import rows as policy_rows
from policies.base import Needs
from policies.norms import keydiff_scores
from policies.rows import RowsView


def load_select() -> bool:
    """Build and load the C++ selection (policies/csrc/select_cpu.cpp) and the state
    updates (state_cpu.cpp) once; the torch forms stay in use without a compiler (or
    with KVSERVE_CPU_KERNEL=0). Returns whether the selection loaded."""
    policy_rows.NATIVE["select"] = load_ops("kvserve_select_cpu")
    policy_rows.NATIVE["state"] = load_ops("kvserve_state_cpu")
    return policy_rows.NATIVE["select"]


Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Member:
    cache: SeqCache
    policy: object  # a policy with `select`
    seq_len: int
    prompt_len: int
    num_new: int
    prefill_done: bool
    attention: AttentionMass | None  # the runner's output for this request
    rotate: Rotate | None = None  # `rope: "shift"`: re-number survivors, re-rotate keys
    compact: bool = False
    # Its cache's live slots per layer, if the caller read them already this step (the
    # runner does, for `idle`); None: the view reads them.
    lengths: list[int] | None = None


def group_key(policy: object, config: Hashable, num_new: int) -> tuple:
    """Members of one group: the same policy class and config, the same step size
    (the attention's query count), and what the policy needs now."""
    return type(policy), config, num_new, policy.needs  # type: ignore[attr-defined]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[L, R, ...] -> [L·R, ...] (row l·R + r): a view, no copy."""
    return t.reshape(-1, *t.shape[2:])


def _from_runner(members: list[Member], width: int,
                 pick: Callable[[AttentionMass], torch.Tensor | None],
                 post: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The members' rows of a statistic the runner returned, [L·R, ..., W]: `pick`
    gives a member's group tensor [L, B, ..., S]; per runner group (usually one) a row
    select, sliced or zero-padded to W slots and `post` applied in the same pass,
    joined in member order."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i, m in enumerate(members):
        assert m.attention is not None
        t = pick(m.attention)
        assert t is not None
        g = groups.setdefault(id(t), (t, [], []))
        g[1].append(m.attention.row)
        g[2].append(i)
    parts, order = [], []
    for t, rows, which in groups.values():
        sel = t.narrow(1, rows[0], len(rows)) if consecutive(rows) \
            else t.index_select(1, int64_tensor(rows))
        s = sel.shape[-1]
        sel = sel[..., :width] if s >= width else torch.nn.functional.pad(sel, (0, width - s))
        parts.append(sel if post is None else post(sel))
        order += which
    a = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if order != sorted(order):  # back to member order
        a = a.index_select(1, int64_tensor(order).argsort())
    return _rows(a)


def _attention(members: list[Member], width: int, heads: bool) -> torch.Tensor:
    """The members' mass [L·R, Tq, Hkv, W], summed over the kv heads (Hkv = 1) unless
    `heads`, in the same pass that copies it out (or as the decode kernel summed them)."""
    tq = members[0].num_new
    return _from_runner(members, width, lambda a: a.group,
                        lambda sel: sel[:, :, :tq] if heads or sel.shape[3] == 1
                        else head_sum(sel[:, :, :tq]))


def _fused_key_diversity(members: list[Member], width: int) -> torch.Tensor | None:
    """KeyDiff's scores [L·R, W] as the decode kernel returned them with attention
    (`Needs.key_diversity` where the runner fuses it), or None if any member's are
    missing (a prefill chunk, a pool the kernel does not serve): the pool's op then."""
    if any(m.attention is None or m.attention.key_diversity is None for m in members):
        return None
    return _from_runner(members, width, lambda a: a.key_diversity)


def build_view(members: list[Member]) -> RowsView:
    load_select()  # once per process (a dict lookup after the first call)
    first = members[0].cache
    tables, nl, bs = first.tables, first.num_layers, first.bs
    policy = members[0].policy
    needs: Needs = policy.needs  # type: ignore[attr-defined]
    # `derived_state`: per-slot values that cache a function of `state` (pyramid's
    # window total), kept and moved like it; a view without them is still complete.
    state = {**getattr(policy, "state", {}), **getattr(policy, "derived_state", {})}
    tables.declare_state(state, getattr(policy, "state_columns", ()))
    rows = [m.cache.row for m in members]
    lives = [m.cache.layer_live if m.lengths is None else m.lengths for m in members]
    nb = max(m.cache.max_blocks for m in members)
    width = nb * bs
    view = RowsView(
        num_layers=nl, num_new=members[0].num_new,
        seq_len=[m.seq_len for m in members], prompt_len=[m.prompt_len for m in members],
        prefill_done=[m.prefill_done for m in members],
        lengths=list(chain.from_iterable(zip(*lives))),  # lane-major, every lane's rows
        slot_pos=rows_slice(tables.slot_pos, rows, width), block_size=bs, heads=tables.heads)
    # How the lanes of a layer keep tokens over a per-head pool (policies/heads.py).
    mode = getattr(getattr(policy, "config", None), "heads_mode", None)
    mode = mode(tables.heads > 1) if mode is not None else "shared"
    view.adaptive = mode == "adaptive" and tables.heads > 1
    view.head_roles = tables.head_roles
    view.in_place = frozenset(getattr(policy, "state_in_place", ()))
    whole = set()
    for name in state:
        if name in view.in_place:  # [L, r, W, ...]: the tables' own slice when it can be
            t = tables.state[name]
            if not consecutive(rows) and by_columns(t):  # whole, rows by index
                view.state[name] = t.narrow(2, 0, width)
                whole.add(name)
            else:
                view.state[name] = rows_slice(t, rows, width)
        else:
            view.state[name] = _rows(take_rows(tables.state[name], rows, width))
    if whole:
        view.handed_whole, view.state_rows = frozenset(whole), rows
        view.copy_rows = lambda t: rows_slice(t, rows, width)  # a copy: rows apart
    if needs.attention:
        # the decode kernel added the step's mass into the state (a step's group is all
        # or none: one policy, one step size, one kernel)
        added = [m.attention is not None and m.attention.accumulated for m in members]
        view.accumulated = all(added)
        assert view.accumulated or not any(added), "a group partly accumulated"
        if not view.accumulated:
            view.attention = _attention(members, width, needs.attention_heads)
    if needs.new_key_norm or needs.new_value_norm:
        _new_norms(view, members, needs)
    if needs.key_diversity:  # from the decode kernel, else the pool's C++ op, else torch
        view.key_diversity = _fused_key_diversity(members, width)
    pool_diversity = needs.key_diversity and view.key_diversity is None
    if needs.key_norm or needs.keys or needs.value_norm or pool_diversity:
        table = _rows(take_rows(tables.table, rows, nb))  # [N, nb]
        store, n = first.pool.storage, table.shape[0]
        if pool_diversity:
            view.key_diversity = store.key_diversity(table, view.positions)
        torch_diversity = needs.key_diversity and view.key_diversity is None
        if needs.key_norm or needs.keys or needs.value_norm or torch_diversity:
            phys = (table.clamp(min=0)[:, :, None] * bs + torch.arange(bs)).view(-1)
            stats = {name: t.view(n, width, *t.shape[1:]) for name, t in store.gather_stats(
                phys, needs.key_norm, needs.keys or torch_diversity, needs.value_norm).items()}
            if torch_diversity:
                view.key_diversity = keydiff_scores(stats["keys"], view.live)
            for name, t in stats.items():
                if name != "keys" or needs.keys:
                    setattr(view, name, t)
    if needs.query_stats is not None:
        _query_sums(view, members, first.pool.storage.heads_per_page)
    if mode == "shared" and tables.heads > 1:  # every lane its layer's statistics
        share_heads(view, needs.attention_heads)
    return view


def _query_sums(view: RowsView, members: list[Member], hkv: int) -> None:
    """`Needs.query_stats`: the members' prompt query sums, the runner's [L, Hq, ...]
    each, as the view's rows: lane l·H + h of request r gets the query heads of its
    `hkv` kv heads, [N, hkv, G, ...] (a per-head pool's lane, hkv = 1: its head's group)."""
    stats = [m.attention.queries if m.attention is not None else None for m in members]
    if any(q is None for q in stats):
        raise RuntimeError("a step of a policy that needs query sums computed none "
                           "(SeqInput.query_stats unset)")
    heads = view.heads

    def rows(parts: list[torch.Tensor]) -> torch.Tensor:
        t = torch.stack(parts, dim=1)  # [L, R, Hq, ...]
        nl, r, hq = t.shape[:3]
        t = t.view(nl, r, heads, hkv, hq // (heads * hkv), *t.shape[3:]).movedim(2, 1)
        return t.reshape(nl * heads * r, *t.shape[3:])

    view.query_sum = rows([q.total for q in stats])  # type: ignore[union-attr]
    outer = [q.outer for q in stats]  # type: ignore[union-attr]
    view.query_outer = None if any(o is None for o in outer) else rows(outer)  # type: ignore[arg-type]
    view.query_count = [q.count for q in stats]  # type: ignore[union-attr]
    view.rope = (stats[0].inv_freq, stats[0].scaling)  # type: ignore[union-attr]
    view.attn_scale = stats[0].attn_scale  # type: ignore[union-attr]


def _new_norms(view: RowsView, members: list[Member], needs: Needs) -> None:
    """The norms of this step's new tokens (the last `num_new` slots of every row) and
    where they are (`new_slots`, `new_index`, made on the host as one tensor: torch
    arithmetic over [N, k] index tensors was ten small ops a step). The norms are the
    runner's, taken as it wrote the step's K/V (`engine.runner.new_norms`), else (a
    quantized pool) read back from the step's slots."""
    first = members[0].cache
    nl, k, r = first.num_layers, view.num_new, len(members)
    n = nl * r
    nexts = [m.cache.next_slot for m in members]
    if k == 1:  # decode: one slot per (layer, member), the last one written
        slots = [x - 1 for x in chain.from_iterable(zip(*nexts))]  # lane-major
        index = int64_tensor([*_lanes_members(nl, r), *slots]).view(3, n, 1)
    else:  # a windowed lane trimmed past a chunk's first tokens has them no more: their
        # norms go to its slot 0, which its own token's then overwrites (no policy reads
        # a windowed lane: `run_group`)
        index = int64_tensor([x for layer in range(nl) for x in [layer] * (r * k)]
                             + [i for i in range(r) for _ in range(k)] * nl
                             + [max(s, 0) for layer in range(nl) for nxt in nexts
                                for s in range(nxt[layer] - k, nxt[layer])]).view(3, n, k)
    view.new_index = index
    view.new_slots = index[2]
    runner = [m.attention for m in members]
    if all(a is not None and a.key_norm is not None for a in runner):
        tokens = int64_tensor([a.token + j for a in runner for j in range(k)])  # type: ignore[union-attr]
        a0 = runner[0]
        assert a0 is not None and a0.key_norm is not None and a0.value_norm is not None
        if needs.new_key_norm:
            view.new_key_norm = a0.key_norm.index_select(1, tokens).view(n, k, -1)
        if needs.new_value_norm:
            view.new_value_norm = a0.value_norm.index_select(1, tokens).view(n, k, -1)
        return
    tables, bs = first.tables, first.bs
    rows = int64_tensor([m.cache.row for m in members]).repeat(nl)
    # the slots' table entries: (layer · Rt + row) · Wt + slot // bs, offset slot % bs
    entry = ((index[0].view(-1) * tables.table.shape[1] + rows.repeat_interleave(k))
             * tables.table.shape[2] + index[2].view(-1) // bs)
    phys = tables.table.view(-1).index_select(0, entry).mul_(bs).add_(index[2].view(-1) % bs)
    got = first.pool.storage.gather_stats(phys, key_norm=needs.new_key_norm,
                                          value_norm=needs.new_value_norm)
    for name, t in got.items():
        setattr(view, f"new_{name}", t.view(n, k, -1))


@functools.lru_cache(maxsize=64)
def _lanes_members(nl: int, r: int) -> tuple[int, ...]:
    """A decode step's rows' lanes then members, lane-major: a step's batch repeats."""
    return (*[lane for lane in range(nl) for _ in range(r)], *list(range(r)) * nl)


def run_group(members: list[Member]) -> list[tuple[int, int]]:
    """Let the members' policy select for all of them and carry out its drops; per
    member (evicted slots over all layers, freed blocks). A sliding-window lane keeps
    what the policy would drop: its window bounds it already, so the policy's budget is
    the global layers' (docs/policies.md, "Models with sliding windows")."""
    view = build_view(members)
    policy = members[0].policy
    drop = type(policy).select([m.policy for m in members], view)  # type: ignore[attr-defined]
    first = members[0].cache
    tables, nl = first.tables, first.num_layers
    rows = [m.cache.row for m in members]
    width = view.shape[1]
    r = len(members)
    for name, t in view.state.items():  # the policy's updates, one copy per name
        if name not in view.in_place:
            put_rows(tables.state[name], rows, t.view(nl, r, *t.shape[1:]))
        elif name in view.handed_whole:  # updated in place, or in the copy `layered` made
            if name in view.gathered:
                put_rows(tables.state[name], rows, view.gathered[name])
        elif not consecutive(rows):  # a copy of scattered rows: back where it came from
            put_rows(tables.state[name], rows, t)
    if drop is None:
        return [(0, 0)] * r
    dead = drop.view(nl, r, width)
    if tables.windowed is not None:  # a windowed lane is its window's (kvpool/windows.py)
        dead = dead.masked_fill(tables.windowed[:, None, None], False)
    return carry_out([m.cache for m in members], dead,
                     [m.compact for m in members], [m.rotate for m in members])


def carry_out(caches: list[SeqCache], dead: torch.Tensor, compact: list[bool],
              rotate: list[Rotate | None]) -> list[tuple[int, int]]:
    """Drop the slots where `dead` [L, R, W] is True (`SlotTables.evict_mask`: emptied
    blocks freed at once), then, for the caches that asked, pack the survivors of the
    layers that lost tokens (`compact`) or re-number them 0..n-1 and re-rotate their
    keys (`rotate`, RoPE shift); per cache (evicted slots, freed blocks)."""
    first = caches[0]
    evicted = first.tables.evict_mask(first.pool, caches, dead)
    done = [(died, freed) for died, freed, _ in evicted]
    asked = [i for i, (died, _) in enumerate(done)
             if died and (compact[i] or rotate[i] is not None)]
    if not asked:
        return done
    # the layers that lost tokens
    layers = {i: [x for x, n in enumerate(evicted[i][2]) if n] for i in asked}
    packs: dict[tuple[int, ...], list[int]] = {}  # compacted together: the same layers
    for i in asked:
        if compact[i]:
            packs.setdefault(tuple(layers[i]), []).append(i)
    for which_layers, which in packs.items():
        freed = compaction.compact(first.tables, first.pool, [caches[i] for i in which],
                                   list(which_layers))
        for i, f in zip(which, freed):
            done[i] = (done[i][0], done[i][1] + f)
    for i in asked:  # after the packing, as one request at a time did it
        if rotate[i] is not None:
            for layer in layers[i]:
                caches[i].renumber(layer, rotate[i])
    return done
