"""How a step's inputs are grouped for attention (the runner's one call per layer per group).

Why groups: decode rows (one query each) and prefill chunks (padded to the longest) must
not pad each other, and requests whose policy reads attention mass go apart, so nobody
else pays for the explicit softmax. A decode group takes per-row flags instead where a
statistic costs only the rows that ask (KeyDiff's scores): splitting a group costs a
gather and a scatter of q per layer. Each group reads its members' rows of the shared
`SlotTables` in one op; the torch path splits a group further by length (padding).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attention.torch_attention import PAD_QUERY_POS
from kvpool.rows import rows_slice
from native.host import bool_tensor, int64_tensor

if TYPE_CHECKING:  # the runner's input type (engine.runner imports this module)
    from engine.model_config import ModelConfig
    from engine.step import SeqInput
    from kvpool.manager import DecodeBatch


@dataclass
class AttentionGroup:
    members: list[int]  # indices into the step's SeqInput list
    q_index: torch.Tensor  # [B, Tq] rows of the packed token axis (padding -> 0)
    valid: torch.Tensor  # [B, Tq] bool
    q_pos: torch.Tensor  # [B, Tq]
    tables: torch.Tensor  # [L, B, NB]
    slot_pos: torch.Tensor  # [L, B, NB*bs]
    want_probs: bool
    # Decode groups: [B] bool, the members whose KeyDiff scores the kernel returns
    # (None: no member's); a flag per row, so scoring some splits no group.
    want_kd: torch.Tensor | None
    sum_heads: bool = False  # the kernel may sum the mass over kv heads (`execute`)
    # Decode rows of the whole step in input order (a decode-only step with one group):
    # attention takes q as it is and its output is the layer's, no gather or scatter.
    whole: bool = False
    # [B] int64: `tables` / `slot_pos` are every row of the engine's tables and member b
    # reads row table_rows[b] (`SlotTables.rows_of(whole=True)`); None: row b is member b.
    table_rows: torch.Tensor | None = None
    # [L, B or every row, >= NB*bs] float32, rows as `tables`': the per-slot state the
    # decode kernel adds the members' mass into (`SeqInput.accumulate` names it), or None.
    accumulate: torch.Tensor | None = None
    ring: RingTarget | None = None  # the window ring the kernel writes the mass into
    # > 1: a decode group over a per-head pool as the C++ kernel takes it (`by_head`'s
    # `in_kernel`): q, q_pos, want_kd and the ring's columns a member, as they were; the
    # tables' rows a (kv head, member), `heads` blocks (`paged_attention_cpu(heads=)`).
    heads: int = 1


@dataclass(slots=True)
class RingTarget:
    """A decode group's window ring (`SeqInput.ring`) as the kernel takes it
    (`paged_attention_cpu(ring=)`): the tables' state in storage order, rows as the
    group's `tables`, and each member's column."""

    values: torch.Tensor  # [L, B or every row, α, >= NB*bs] float32, slots contiguous
    total: torch.Tensor  # [L, B or every row, 3, >= NB*bs] float32, its exact total
    cols: torch.Tensor  # [B] int64: member b's query index mod α
    shift: int  # the total's fixed-point bits


def build_group(members: list[int], inputs: list[SeqInput], offsets: list[int],
                 want_probs: bool, want_kd: torch.Tensor | None = None,
                 sum_heads: bool = False, in_place: bool = False,
                 accumulate: bool = False) -> AttentionGroup:
    """`in_place`: a decode group's attention reads rows by index (the C++ kernel), so
    rows that are not consecutive are not gathered (`SlotTables.rows_of(whole=True)`).
    `accumulate` (a decode group read in place): the members' mass goes into their
    `SeqInput.accumulate` state or `ring`, handed as the same rows as the tables."""
    seqs = [inputs[i] for i in members]
    tables = seqs[0].cache.tables
    assert all(s.cache.tables is tables for s in seqs), "one step reads one SlotTables"
    lens = [len(s.token_ids) for s in seqs]
    tq = max(lens)
    # The members' rows of the shared tables: views, or one gather each, whatever B.
    table, slot_pos, rows = tables.rows_of([s.cache.row for s in seqs],
                                           max(s.cache.max_blocks for s in seqs),
                                           whole=in_place and tq == 1)
    if tq == 1:  # decode: no padding
        q_index = int64_tensor([offsets[i] for i in members])[:, None]
        q_pos = int64_tensor([s.start_pos for s in seqs])[:, None]
        valid = torch.ones_like(q_index, dtype=torch.bool)
        acc = ring = None
        if accumulate:  # read after rows_of, which may have grown the tables
            assert in_place
            width = slot_pos.shape[-1]
            # the tables' rows as handed: every row (with `rows`), else a consecutive slice
            at = [s.cache.row for s in seqs] if rows is None else None
            if seqs[0].ring is not None:
                name, total, shift, _ = seqs[0].ring
                assert all(s.ring is not None and s.ring[0] == name for s in seqs)
                values = _storage_rows(tables.state[name], at, width)
                ring = RingTarget(values, _storage_rows(tables.state[total], at, width),
                                  int64_tensor([s.ring[3] % values.shape[2] for s in seqs]),  # type: ignore[index]
                                  shift)
            else:
                name = seqs[0].accumulate
                assert name is not None and all(s.accumulate == name for s in seqs)
                state = tables.state[name]
                acc = state.narrow(2, 0, width) if at is None else rows_slice(state, at, width)
        return AttentionGroup(members, q_index, valid, q_pos, table, slot_pos, want_probs, want_kd,
                              sum_heads, table_rows=rows, accumulate=acc, ring=ring)
    ar = torch.arange(tq)
    valid = ar[None, :] < torch.tensor(lens)[:, None]
    q_index = torch.where(valid, torch.tensor([offsets[i] for i in members])[:, None] + ar, 0)
    starts = torch.tensor([s.start_pos for s in seqs])[:, None]
    q_pos = torch.where(valid, starts + ar, PAD_QUERY_POS)
    return AttentionGroup(members, q_index, valid, q_pos, table, slot_pos, want_probs, None,
                          sum_heads)


def _storage_rows(state: torch.Tensor, rows: list[int] | None, width: int) -> torch.Tensor:
    """A state stored by columns ([L, R, S, k] over [L, R, k, S] memory) as that memory,
    [L, ., k, width]: every row (None), or the consecutive `rows` as `rows_of` hands
    them (a view either way)."""
    t = state.transpose(2, 3).narrow(3, 0, width)
    return t if rows is None else t.narrow(1, rows[0], len(rows))


def decode_batch_group(decode: DecodeBatch, q_pos: torch.Tensor, in_place: bool
                       ) -> AttentionGroup:
    """The one group of a step whose every input is one decode token wanting its logits
    alone (the steady state), `whole`: what `build_group` gives for it, built from the
    scheduler's batch append (rows and the widest table) and `q_pos` [B] (the step's
    positions) with no pass over the inputs or their caches."""
    b = len(decode.rows)
    table, slot_pos, rows = decode.tables.rows_of(decode.rows, decode.blocks, whole=in_place)
    q_index, valid = _batch_index(b)
    return AttentionGroup(list(range(b)), q_index, valid, q_pos.view(b, 1), table, slot_pos,
                          False, None, table_rows=rows)


@functools.lru_cache(maxsize=64)
def _batch_index(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, 1] rows 0..B-1, [B, 1] all valid): read only, kept per batch size (after the
    forward each op a step runs starts cold, ~10-20 us for a tensor this small)."""
    q_index = torch.arange(b).view(b, 1)
    return q_index, torch.ones_like(q_index, dtype=torch.bool)


# Attention cost is (sequences × the group's longest context): a group is split when the
# padding it would carry outweighs one more kernel call per layer.
MIN_SPLIT = 8


def kd_rows(members: list[int], inputs: list[SeqInput]) -> torch.Tensor | None:
    """The decode group's [B] flags of the members that want KeyDiff's scores, or None."""
    flags = [inputs[i].wants_key_diversity for i in members]
    return bool_tensor(flags) if any(flags) else None


def split_by_length(members: list[int], inputs: list[SeqInput]) -> list[list[int]]:
    """Order a group by cached length and cut it where padding would waste the most.

    Greedy halving: a sorted run is cut in two at its median while the halves would
    save at least a tenth of its padded work. Decode batches of mixed lengths (the
    common case under continuous batching) typically end up in 2-4 groups."""
    def cost(run: list[int]) -> int:
        return len(run) * max(inputs[i].cache.max_blocks + len(inputs[i].token_ids) for i in run)

    order = sorted(members, key=lambda i: inputs[i].cache.max_blocks + len(inputs[i].token_ids))
    out, todo = [], [order]
    while todo:
        run = todo.pop()
        half = len(run) // 2
        if half >= MIN_SPLIT and cost(run[:half]) + cost(run[half:]) < 0.9 * cost(run):
            todo += [run[half:], run[:half]]
        else:
            out.append(run)
    return out


def step_slots(inputs: list[SeqInput], offsets: list[int], total: int, num_layers: int,
                 decode_slots: torch.Tensor | None) -> torch.Tensor:
    """[L, T] pool slots of the packed token axis: the decode tokens' come as one
    [L, D] tensor from the scheduler (a decode-only step uses it as it is)."""
    if decode_slots is not None and decode_slots.shape[1] == len(inputs) == total:
        return decode_slots
    out = torch.empty(num_layers, total, dtype=torch.int64)
    cols = [offsets[i] for i, s in enumerate(inputs) if s.slots is None]
    if cols:
        assert decode_slots is not None and decode_slots.shape[1] == len(cols)
        out[:, cols] = decode_slots
    for i, s in enumerate(inputs):
        if s.slots is not None:
            out[:, offsets[i] : offsets[i] + len(s.token_ids)] = s.slots
    return out


def fresh_prompts(inputs: list[SeqInput]) -> set[int]:
    """Inputs that are a prompt's first chunk with nothing else cached (no prefix hit),
    needing no attention statistics: their attention is causal self-attention over the
    chunk's own keys (in a sliding-window layer, banded to its window)."""
    return {
        i for i, s in enumerate(inputs)
        if len(s.token_ids) > 1 and s.start_pos == 0 and not s.wants_attention
        and s.cache.live == len(s.token_ids) * s.cache.num_layers
    }


def by_head(g: AttentionGroup, heads: int, num_layers: int, in_kernel: bool = False
            ) -> AttentionGroup:
    """A group over a per-head pool (`--kv-layout head`: the tables' lanes are (layer,
    kv head), `heads` of them a layer) as the kernels take it: each member's kv head h
    a sequence of its own with one kv head, row h·B + b of [L, H·B, ...] tables (views
    of the lanes, which are layer-major), so the same kernels read every head's own
    pages and length. q goes in as `heads_q` makes it and comes out through `heads_out`.
    A group read in place (every row of the tables, `table_rows`: `SlotTables.rows_of`
    hands a per-head pool's decode groups so) is viewed without a copy, and so are the
    lanes' state the kernel adds the mass into and the window ring.
    `in_kernel` (a decode group on the C++ kernel): the kernel makes the (kv head,
    member) rows itself (`AttentionGroup.heads`), so only the tables are viewed: no
    per-step index tensors, and no regrouping of q and the output (2 copies a layer)."""
    rows = g.tables.shape[1]

    def lanes(t: torch.Tensor, write: bool = False) -> torch.Tensor:  # [L·H, R, X] -> [L, H·R, X]
        shape = (num_layers, heads * rows, *t.shape[2:])
        return t.view(shape) if write else t.reshape(shape)  # a target must stay a view

    def each(t: torch.Tensor) -> torch.Tensor:  # a member's value, a row a kv head
        if in_kernel:  # the kernel reads a member's once for all its heads
            return t
        return t.repeat(heads, *[1] * (t.dim() - 1))

    table_rows = g.table_rows
    if table_rows is not None and not in_kernel:  # row r of head h: row h·R + r of the lanes
        table_rows = (torch.arange(heads)[:, None] * rows + table_rows[None]).reshape(-1)
    ring = None if g.ring is None else RingTarget(
        lanes(g.ring.values, True), lanes(g.ring.total, True), each(g.ring.cols), g.ring.shift)
    return AttentionGroup(
        g.members, g.q_index, g.valid, each(g.q_pos), lanes(g.tables), lanes(g.slot_pos),
        g.want_probs, None if g.want_kd is None else each(g.want_kd), False, g.whole, table_rows,
        None if g.accumulate is None else lanes(g.accumulate, True), ring,
        heads if in_kernel else 1)


def heads_q(q: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Tq, Hq, D] -> [H·B, Tq, Hq/H, D]: each kv head's query group, head-major."""
    b, tq, hq, d = q.shape
    return q.view(b, tq, heads, hq // heads, d).permute(2, 0, 1, 3, 4).reshape(
        heads * b, tq, hq // heads, d)


def heads_out(o: torch.Tensor, heads: int) -> torch.Tensor:
    """`heads_q`'s inverse: [H·B, Tq, G, D] -> [B, Tq, H·G, D]."""
    hb, tq, g, d = o.shape
    b = hb // heads
    return o.view(heads, b, tq, g, d).permute(1, 2, 0, 3, 4).reshape(b, tq, heads * g, d)


def lanes_of(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A statistic stacked over layers in the kernels' per-head rows, [L, H·B, ...],
    as the policies read it, one lane a (layer, kv head): [L·H, B, ...] (a view)."""
    return t.reshape(t.shape[0] * heads, t.shape[1] // heads, *t.shape[2:])


def layer_features(model: torch.nn.Module, config: ModelConfig) -> list[dict]:
    """Each layer's attention variants as keyword arguments of the attention kernels:
    `softcap` where the config has one, `sinks` [Hq] float32 where the model's
    `attention_sinks(layer)` gives a tensor (the model keeps the weights; the runner
    knows no family). Read once: CUDA graphs replay the same tensors."""
    sinks_of = getattr(model, "attention_sinks", None)
    out: list[dict] = []
    for layer in range(config.num_layers):
        kw: dict = {}
        if config.attn_softcap is not None:
            kw["softcap"] = float(config.attn_softcap)
        sinks = sinks_of(layer) if sinks_of is not None else None
        if sinks is not None:
            if sinks.shape != (config.num_heads,):
                raise ValueError(f"layer {layer}'s attention sinks are {tuple(sinks.shape)}, "
                                 f"not [{config.num_heads}] (one a query head)")
            kw["sinks"] = sinks.detach().float().contiguous()
        out.append(kw)
    return out


def heads_features(feat: dict, heads: int, members: int) -> dict:
    """`layer_features`' arguments for a group over a per-head pool (`by_head`: row
    h·B + b is member b's kv head h, with that head's G query heads): the sinks as
    [H·B, G], a row a sequence."""
    if "sinks" not in feat:
        return feat
    s = feat["sinks"]
    return {**feat, "sinks": s.view(heads, 1, -1).expand(heads, members, -1).reshape(
        heads * members, -1)}
