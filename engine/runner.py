"""The model runner: one packed forward over every scheduled token of a step.

Prefill chunks and decode tokens of many requests are concatenated along one token
axis (the model has no batch dimension). Attention is the only part that needs to know
which token belongs to which request; it runs per *group* — decode rows (one query
each) and prefill chunks (padded to the longest) — and within a group every sequence is
attended in the same tensor call. Requests whose policy needs attention statistics go
into their own groups, so nobody else pays for the explicit softmax. A prompt's first
chunk with nothing cached before it needs no pool read at all: plain causal SDPA.

A model's attention variants reach every kernel as keyword arguments, per layer
(`layer_features`: Gemma 2's soft-capping from `ModelConfig.attn_softcap`, gpt-oss's
learned sinks from the model's `attention_sinks(layer)`); a plain model's calls get none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attention.cpu_attention import (
    accumulates,
    causal_prefill_cpu,
    fuses_key_diversity,
    paged_attention_cpu,
    paged_decode_key_diversity,
    prefix_prefill_cpu,
    prefix_prefill_runs,
)
from attention.select import sums_any_heads
from attention.stats import AttentionMass
from attention.storage import KVStorage
from attention.torch_attention import causal_self_attention, paged_attention
from engine.attention_groups import (
    AttentionGroup,
    build_group,
    by_head,
    decode_batch_group,
    fresh_prompts,
    heads_features,
    heads_out,
    heads_q,
    kd_rows,
    lanes_of,
    layer_features,
    split_by_length,
    step_slots,
)
from engine.model_config import ModelConfig
from engine.sampler import TokenScores, score_tokens, scores_to_host
from engine.step import (
    AttentionFn,
    DecodeReplay,
    IdsFrom,
    SeqInput,
    StepOutput,
    new_norms,
    query_sums,
)
from native.host import int64_tensor

if TYPE_CHECKING:
    from kvpool.manager import DecodeBatch

# Scored rows' logits are computed this many [rows x vocab] elements at a time (64 MiB of
# fp32), so a long prompt chunk never holds a [chunk, vocab] tensor.
_SCORE_ELEMS = 1 << 24


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, storage: KVStorage,
                 attention_fn: AttentionFn, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.storage = storage  # the KV tensors: the runner owns them (kvpool holds ids)
        self.attention_fn = attention_fn
        self.device = device
        self.scale = config.attn_scale
        # Each layer's attention variants as the kernels take them ({} for a plain model).
        self.features = layer_features(model, config)
        # Lanes a layer has in the pool's tables: 1, or its kv heads in a per-head pool
        # (`--kv-layout head`), where every kv head is attended as a sequence of its own.
        self.heads = config.num_kv_heads // storage.heads_per_page
        self.lanes = config.num_layers * self.heads
        # KeyDiff's scores from the decode kernel (`wants_key_diversity`) where it serves
        # this pool; decided on the first step that asks (the kernel builds then).
        self._fuse_kd: bool | None = None
        # CUDA graphs for decode steps (engine/cuda_graphs.py), set by the engine on CUDA.
        self.graphs: DecodeReplay | None = None
        # Whether the decode kernel adds mass into a state (`accumulates`); decided on
        # the first step that asks.
        self._adds: bool | None = None

    def execute(self, inputs: list[SeqInput], decode: DecodeBatch | None = None,
                ids_from: IdsFrom | None = None, greedy: bool = False) -> StepOutput:
        """`decode`: the scheduler's batch append of the inputs whose `slots` is None (in
        order): their slots and rows. `ids_from`: the inputs' ids are on the device
        (their `token_ids` are placeholders); only a graph step takes them. `greedy`:
        every row's token is its logits' argmax and nobody reads the logits (no
        logprobs): where the LM head takes the argmax as it computes them (a CPU panel
        layer, `compute_greedy`), the step returns the ids (`StepOutput.ids`) and writes no logits."""
        if self.graphs is not None and decode is not None:
            out = self.graphs.run(inputs, decode, ids_from)
            if out is not None:  # the step was a graph's; else it runs eagerly here
                return out
        if ids_from is not None:
            raise ValueError("input ids on the device need a CUDA graph step")
        cfg, dev = self.config, self.device
        offsets: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        total = top = 0
        asks = False  # an input wants more than its logits (statistics, scores)
        for s in inputs:
            offsets.append(total)
            n = len(s.token_ids)
            total += n
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + n))
            top = max(top, s.start_pos + n - 1)  # the largest position: RoPE needs no sync
            if (s.wants_attention or s.score is not None or s.wants_norms
                    or s.wants_key_diversity or not s.wants_logits or s.query_stats is not None):
                asks = True
        # The step's inputs: host lists to tensors, one copy each to the device.
        input_ids = int64_tensor(ids)
        positions = int64_tensor(pos)
        heads = self.heads
        write_slots = step_slots(inputs, offsets, total, self.lanes,
                                  decode.slots if decode is not None else None)  # [lanes, T]
        if heads > 1:  # a layer's lanes' slots in a row: [L, H·T], head-major
            write_slots = write_slots.view(cfg.num_layers, heads * total)
        windows = cfg.sliding_windows
        kernel = self.attention_fn is paged_attention_cpu
        # a fresh prompt's causal attention over its own keys: the C++ op beside the kernel
        causal = causal_prefill_cpu if kernel else causal_self_attention
        # Only the torch path pads a group to its longest sequence; the kernels walk
        # each sequence's own blocks, so they take a group whole.
        pads = self.attention_fn is paged_attention
        scored: list[int] = []
        fresh: set[int] = set()
        if (decode is not None and len(decode.rows) == len(inputs) == total and not asks
                and not pads):  # the steady state: one group, from the batch append
            groups = [decode_batch_group(decode, positions, kernel)]
        else:
            scored = [i for i, s in enumerate(inputs) if s.score is not None]
            fresh = fresh_prompts(inputs)
            groups = self._groups(inputs, offsets, fresh, kernel, pads)
        if heads > 1:
            groups = [by_head(g, heads, cfg.num_layers, kernel and g.q_index.shape[1] == 1)
                      for g in groups]
        score_rows, score_targets = _score_rows(inputs, offsets, scored)
        if dev.type != "cpu":  # every host-built input in one host-to-device copy
            flat = [input_ids, positions, write_slots, score_rows, score_targets]
            for g in groups:
                flat += [g.q_index, g.valid, g.q_pos, g.tables, g.slot_pos]
            up = upload(flat, dev)
            input_ids, positions, write_slots, score_rows, score_targets = up[:5]
            groups = [AttentionGroup(g.members, *up[5 + 5 * j : 10 + 5 * j], g.want_probs, g.want_kd,
                             g.sum_heads) for j, g in enumerate(groups)]
        if (len(groups) == 1 and not fresh and groups[0].members == list(range(len(inputs)))
                and groups[0].q_index.shape[1] == 1):
            groups[0].whole = True
        # Prompt chunks after a cached prefix wanting no statistics: one `causal_prefill`
        # call a sequence over the pool in place (`prefix_prefill_cpu`) instead of the
        # torch path's gather, mask and SDPA, in each layer whose sliding window (if any)
        # is wider than the group's last position (the op has no window). -> that position
        # (q_pos's first B rows: over a per-head pool `by_head` repeats them a kv head)
        prefixed = {j: int(g.q_pos[: len(g.members)][g.valid].max()) for j, g in enumerate(groups)
                    if kernel and g.q_index.shape[1] > 1 and not g.want_probs
                    and g.want_kd is None}
        mass: dict[int, list[torch.Tensor]] = {j: [] for j, g in enumerate(groups) if g.want_probs}
        kds: dict[int, list[torch.Tensor]] = {j: [] for j, g in enumerate(groups)
                                              if g.want_kd is not None}
        store = self.storage
        norms: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if asks and store.quant is None and any(s.wants_norms for s in inputs):
            norms = []
        sums = query_sums(inputs, offsets, self.model.rotary, dev, self.scale) if asks else None

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            feat = self.features[layer]
            if sums is not None:  # before attention, which may write its output over q
                sums.add(q)
            store.write(write_slots[layer], k, v)  # per head: [T, H, D] at [H·T] slots
            if norms is not None:
                norms.append(new_norms(k, v, store.storage_dtype))
            whole = bool(groups) and groups[0].whole
            out = q if whole else torch.empty_like(q)  # `whole`: replaced below
            window = windows[layer]
            for i in fresh:
                a, n = offsets[i], len(inputs[i].token_ids)
                causal(q[a : a + n], k[a : a + n], v[a : a + n], self.scale, out=out[a : a + n],
                       window=window, **feat)
            for j, g in enumerate(groups):
                if (j in prefixed and (window is None or window > prefixed[j])
                        and prefix_prefill_runs(q.dtype, q.shape[-1], store.storage_dtype,
                                                store.quant is not None)):
                    self._prefix_prefill(g, layer, q, k, v, out, inputs, offsets, feat)
                    continue
                qg = q[:, None] if whole else q[g.q_index]
                regroup = heads > 1 and g.heads == 1  # else the kernel reads q as it is
                args = (heads_q(qg, heads) if regroup else qg, g.tables[layer],
                        g.slot_pos[layer], g.q_pos, self.scale, window, g.want_probs)
                kw = dict(heads_features(feat, heads, len(g.members)) if regroup else feat)
                if g.heads > 1:
                    kw["heads"] = g.heads
                if g.sum_heads:
                    kw["sum_heads"] = True
                if g.table_rows is not None:  # the C++ kernel's: rows read in place
                    kw["table_rows"] = g.table_rows
                if g.accumulate is not None:  # the mass into the state, none back
                    kw["accumulate"] = g.accumulate[layer]
                if g.ring is not None:  # the mass as the ring's column, none back
                    kw.update(ring=g.ring.values[layer], ring_total=g.ring.total[layer],
                              ring_cols=g.ring.cols, ring_shift=g.ring.shift)
                if g.want_kd is not None:
                    o, probs, kd = store.attend(paged_decode_key_diversity, *args, **kw,
                                               rows=g.want_kd)
                    kds[j].append(kd)
                else:
                    o, probs = store.attend(self.attention_fn, *args, **kw)
                if regroup:
                    o = heads_out(o, heads)
                if whole:
                    out = o[:, 0]
                else:
                    out[g.q_index[g.valid]] = o[g.valid]
                if probs is not None:
                    mass[j].append(probs)
            return out

        # The rows to take logits of (None: every row, in order: a decode-only step).
        last = None if not asks and total == len(inputs) else [
            offsets[i] + len(s.token_ids) - 1 for i, s in enumerate(inputs) if s.wants_logits]
        # Only the forward is inference-mode: the bookkeeping tensors above (block
        # tables) outlive the step and are updated in place later.
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, attn, top)
            scores = (self._score(hidden, score_rows, score_targets, inputs, scored)
                      if scored else {})
            if last is not None and len(last) < hidden.shape[0]:
                hidden = hidden[torch.tensor(last, dtype=torch.int64, device=dev)]
            ids = self.model.compute_greedy(hidden) if greedy else None
            logits = self.model.compute_logits(hidden) if ids is None else None
            attention: dict[int, AttentionMass] = {}
            for j in mass.keys() | kds.keys():  # one stack and one copy per group
                stacked = torch.stack(mass[j]).cpu() if j in mass else None
                kd = torch.stack(kds[j]) if j in kds else None  # on the CPU already
                if heads > 1:  # [L, H·B, ...] -> one lane a (layer, kv head)
                    stacked = None if stacked is None else lanes_of(stacked, heads)
                    kd = None if kd is None else lanes_of(kd, heads)
                for row, i in enumerate(groups[j].members):
                    if stacked is not None or inputs[i].wants_key_diversity:
                        attention[i] = AttentionMass(stacked, row, len(inputs[i].token_ids),
                                                     kd if inputs[i].wants_key_diversity else None)
            for g in groups:  # their mass went into their state during attention
                if g.accumulate is not None or g.ring is not None:
                    for row, i in enumerate(g.members):
                        attention[i] = AttentionMass(None, row, 1, accumulated=True)
            if norms is not None:  # [L, T, Hkv] each, one stack and one copy
                kn = torch.stack([x[0] for x in norms]).cpu()
                vn = torch.stack([x[1] for x in norms]).cpu()
                if heads > 1:  # [L, T, H] -> [L·H, T, 1]: one lane a kv head
                    kn, vn = (x.transpose(1, 2).reshape(self.lanes, -1, 1) for x in (kn, vn))
                for i, s in enumerate(inputs):
                    if s.wants_norms:
                        a = attention.get(i) or AttentionMass(None, 0, len(s.token_ids))
                        a.key_norm, a.value_norm, a.token = kn, vn, offsets[i]
                        attention[i] = a
            if sums is not None:
                sums.attach(attention, inputs)
        # Logits stay on the model's device: sampling runs there and only the ids come
        # back (engine.sampler.to_host).
        return StepOutput(logits=logits, attention=attention, scores=scores, ids=ids)

    def _groups(self, inputs: list[SeqInput], offsets: list[int], fresh: set[int],
                kernel: bool, pads: bool) -> list[AttentionGroup]:
        """The step's attention groups (engine/attention_groups.py): decode rows apart
        from prefill chunks, rows that want the mass apart from those that do not."""
        # The kernel sums the mass over kv heads for policies that read no head apart:
        # the C++ decode kernel in head_sum's order (up to 4 heads; from 8 on torch's sum
        # takes another), Triton at any count (on a GPU, 1/Hkv of the mass to copy out).
        hkv = self.storage.heads_per_page  # what one kernel call's sequences have
        sums_heads = hkv > 1 and ((kernel and hkv <= 4) or sums_any_heads(self.attention_fn))
        # (decode, returns the mass, summed over kv heads, the state the kernel puts it
        # into: "" none) -> members
        buckets: dict[tuple[bool, bool, bool, str], list[int]] = {}
        for i, s in enumerate(inputs):
            if i not in fresh:
                decode = len(s.token_ids) == 1
                summed = s.wants_attention and not s.attention_heads and sums_heads
                into = ""  # the kernel adds or writes the mass summed over every head
                if (decode and (s.accumulate or s.ring) and not s.wants_key_diversity and kernel
                        and (summed or hkv == 1) and self._accumulates()):
                    name = s.accumulate or s.ring[0]  # type: ignore[index]
                    into = name if name in s.cache.tables.state else ""
                buckets.setdefault((decode, s.wants_attention and not into, summed, into),
                                   []).append(i)
        fuse_kd = kernel and any(s.wants_key_diversity for s in inputs) and self._fuses_kd()
        return [
            build_group(part, inputs, offsets, want,
                        kd_rows(part, inputs) if decode and fuse_kd else None, summed, kernel,
                        bool(into))
            for (decode, want, summed, into), m in sorted(buckets.items())
            for part in (split_by_length(m, inputs) if pads or not decode else [m])
        ]

    def _prefix_prefill(self, g: AttentionGroup, layer: int, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, inputs: list[SeqInput],
                        offsets: list[int], feat: dict) -> None:
        """Prompt chunks after a cached prefix, one `prefix_prefill_cpu` call a member
        (and a kv head over a per-head pool: its row h·B + b of the group's lanes, its
        query group and its own K/V; the op copies what is not contiguous)."""
        heads, members = self.heads, len(g.members)
        kv_heads, group = k.shape[1] // heads, q.shape[1] // heads
        for b, i in enumerate(g.members):
            a, n = offsets[i], len(inputs[i].token_ids)
            for h in range(heads):
                qs, ks = slice(h * group, (h + 1) * group), slice(h * kv_heads, (h + 1) * kv_heads)
                kw = feat if "sinks" not in feat else {**feat, "sinks": feat["sinks"][qs]}
                into = out[a : a + n] if heads == 1 else None
                o, _ = self.storage.attend(prefix_prefill_cpu, q[a : a + n, qs], k[a : a + n, ks],
                                           v[a : a + n, ks], g.tables[layer, h * members + b],
                                           g.slot_pos[layer, h * members + b],
                                           inputs[i].start_pos, self.scale, out=into, **kw)
                if into is None:
                    out[a : a + n, qs] = o

    def _accumulates(self) -> bool:
        if self._adds is None:
            self._adds = accumulates(self.storage)
        return self._adds

    def _fuses_kd(self) -> bool:
        if self._fuse_kd is None:
            self._fuse_kd = fuses_key_diversity(self.storage, self.config.sliding_windows)
        return self._fuse_kd

    def _score(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
               inputs: list[SeqInput], scored: list[int]) -> dict[int, TokenScores]:
        """Prompt logprobs of the scored rows: logits, log-softmax, the target's logprob
        and rank and the top-N, all on the model's device, a slice of rows at a time;
        only those numbers come to the host, in one copy for the whole step (a second
        device-to-host copy beside `engine.sampler.to_host`, in steps that score)."""
        n = max(inputs[i].score.top_n for i in scored)  # type: ignore[union-attr]
        step = max(1, _SCORE_ELEMS // self.config.vocab_size)
        packed = torch.cat([
            score_tokens(self.model.compute_logits(hidden[rows[a : a + step]]).float(),
                         targets[a : a + step], n)
            for a in range(0, rows.shape[0], step)])
        host = scores_to_host(packed, n)
        out, a = {}, 0
        for i in scored:
            sc = inputs[i].score
            assert sc is not None
            b = a + len(sc.targets)
            k = sc.top_n
            out[i] = TokenScores(host.logprob[a:b], host.rank[a:b],
                                 [t[:k] for t in host.top_ids[a:b]],
                                 [t[:k] for t in host.top_logprobs[a:b]])
            a = b
        return out


def _score_rows(inputs: list[SeqInput], offsets: list[int], scored: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed token axis' rows to score and their target tokens, input order."""
    rows: list[int] = []
    targets: list[int] = []
    for i in scored:
        sc = inputs[i].score
        assert sc is not None
        a = offsets[i] + sc.offset
        rows.extend(range(a, a + len(sc.targets)))
        targets.extend(sc.targets)
    return int64_tensor(rows), int64_tensor(targets)


def upload(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Integer and bool host tensors -> the same tensors on `device`, through one int64
    buffer and one copy (a step's inputs and attention metadata; on a GPU each separate
    copy is a launch and a synchronisation point)."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if torch.device(device).type == "cuda":  # pinned: an asynchronous copy, no sync
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    out = []
    for part, t in zip(flat.split([t.numel() for t in tensors]), tensors):
        part = part.view(t.shape)
        out.append(part.bool() if t.dtype == torch.bool else part.to(t.dtype))
    return out
