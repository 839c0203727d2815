"""CUDA graphs for decode steps: the whole forward replayed as one launch.

Why: on a GPU an eager decode step of the 160M model is ~490 kernel launches issued by
Python, and the GPU sat idle ~87% of each 23 ms step (shared/gpu/README.md). A graph
captured once per batch-size bucket replays all of them from one host call. vLLM and
SGLang do the same; what is ours is that eviction still works: a graph reads no
request's lengths or tables from its capture, only from static device buffers that
each step refills with one host-to-device copy, so a policy that evicted slots between
two steps (a -1 in the slot's position) is simply seen by the next replay.

A step runs in a graph when every input is one decode token wanting logits (no prompt
logprobs, no KeyDiff scores, no mass per kv head: those steps run eagerly), its batch
fits the largest bucket, and its longest table fits the buffers (`max_len`, vLLM's
max_seq_len_to_capture).

Policies that read attention statistics run inside graphs too (issue 23's fused
statistics): each bucket has a second graph (captured with the plain ones in the
warm-up, `capture_all`), whose attention
adds the Triton kernel's mass pass (`paged_attention_triton(sum_heads=True)`: every
slot's probability summed over all heads, for the rows flagged in a static buffer,
zeros elsewhere, no atomics) and which keeps each layer's new K/V norms
(`engine.runner.new_norms`, for knorm and PagedEviction). After the replay the step's
columns of these buffers cross to the host in one copy each, as the eager step's
`AttentionMass`, so the policies are the same code either way. This is what vLLM's
fused kernels could not give H2O-style eviction (vLLM #3532): the statistic costs one
more pass over the keys inside the same graph, not an eager step.

The batch is padded up to its bucket: padded rows see no slot (query position -1), write
their K/V to the pool's scratch block (`KVStorage(scratch=True)`: outside its
accounting), and their logits are dropped. The tables are padded to a fixed width; the
kernel walks only the step's width (`slot_count`, read on the device), so stale columns
of earlier, longer steps are never read.

`capture=False` runs the same buffers and padding eagerly: what the tests check on a
CPU (through Triton's interpreter), since only capture itself needs CUDA.
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from typing import TYPE_CHECKING

import torch

from attention.triton_attention import paged_attention_triton

if TYPE_CHECKING:  # the runner imports this module
    from engine.runner import ModelRunner
    from engine.step import IdsFrom, SeqInput, StepOutput
    from kvpool.manager import DecodeBatch

# Longest table (in tokens) a graph step takes; longer steps run eagerly. The buffers
# hold L x max_batch x max_len positions, so this bounds their memory (vLLM: 8192).
MAX_LEN = 8192
MAX_BATCH = 512


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch, and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def graph_step(s: SeqInput, norms: bool) -> bool:
    """Whether an input can run in a graph: one decode token wanting its logits and at
    most the statistics a graph keeps (mass summed over heads; the step's K/V norms
    where `norms`: an unquantized pool, as the eager runner's `new_norms`)."""
    return (len(s.token_ids) == 1 and s.slots is None and s.wants_logits
            and not (s.wants_key_diversity or s.attention_heads or (s.wants_norms and not norms))
            and s.score is None and s.query_stats is None)


class DecodeGraphs:
    """Static buffers, one graph per batch bucket (captured on first use, or all at once
    by `capture_all` during warm-up), and the step that fills and replays them."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int,
                 capture: bool = True) -> None:
        cfg, store, dev = runner.config, runner.storage, runner.device
        self.runner = runner
        self.capture = capture
        self.buckets = batch_buckets(min(max_batch, MAX_BATCH))
        bs = store.block_size
        self.max_len = max_model_len
        self.max_blocks = -(-min(max_model_len, MAX_LEN) // bs)
        nl, bmax, nbm = cfg.num_layers, self.buckets[-1], self.max_blocks
        if store.scratch_slot is None:
            raise ValueError("CUDA graphs need a pool with a scratch block (scratch=True)")
        self.scratch_slot = store.scratch_slot
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(bmax, **i64)
        self.pos = torch.zeros(bmax, **i64)
        self.q_pos = torch.full((bmax, 1), -1, **i64)
        self.write_slots = torch.full((nl, bmax), self.scratch_slot, **i64)
        self.tables = torch.full((nl, bmax, nbm), -1, **i32)
        self.slot_pos = torch.full((nl, bmax, nbm * bs), -1, **i32)
        self.slot_count = torch.zeros(1, **i32)
        self.mass_rows = torch.zeros(bmax, **i32)  # statistics graphs: rows wanting mass
        self.norms = store.quant is None  # the step's K/V norms as the pool stores them
        # One host-to-device copy a step: everything is staged in one int32 buffer
        # (pinned on CUDA, so the copy is asynchronous), then spread on the device.
        n = 4 * bmax + 1 + nl * bmax * (1 + nbm + nbm * bs)
        self._host = torch.empty(n, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._dev = torch.empty(n, **i32)
        # Recorded after each step's copy out of `_host`: with async scheduling the next
        # step is staged while this one may still wait in the stream, and its copy must
        # have read the pinned buffer before the host writes it again.
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        # keyed (bucket, statistics): the statistics graph also returns (mass
        # [L, bucket, 1, 1, nbm*bs], K norms, V norms [L, bucket, Hkv]) in `stats`
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.replays: Counter[tuple[int, bool]] = Counter()  # decode steps per graph
        self.eager_steps = 0  # decode-only steps that did not fit (run eagerly)

    @property
    def steps(self) -> int:
        """Decode steps run through the graphs."""
        return sum(self.replays.values())

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, slots: int) -> bool:
        """Whether a table of `slots` slots, the longest of a step, fits the buffers
        (with a block to spare: where a row's slots start in its last block)."""
        return -(-slots // self.runner.storage.block_size) < self.max_blocks

    def run(self, inputs: list[SeqInput], decode: DecodeBatch,
            ids_from: IdsFrom | None = None) -> StepOutput | None:
        """The step's output (logits float32, valid until the next replay; the
        statistics its inputs asked for, on the host), or None when the step does not
        fit a graph (then the runner runs it eagerly). `decode`: the scheduler's batch
        append, whose rows and widest table stand for the inputs' caches. `ids_from`:
        the input ids are rows of a tensor on the device (async scheduling: a step in
        flight sampled them), not the inputs' own."""
        from engine.step import StepOutput  # the runner imports this module

        b = len(inputs)
        if decode.slots.shape[1] != b:  # prefill chunks in the step
            return None
        bucket = self.bucket(b)
        nb = decode.blocks
        if (bucket is None or nb > self.max_blocks
                or not all(graph_step(s, self.norms) for s in inputs)):
            self.eager_steps += 1
            return None
        stats = any(s.wants_attention or s.wants_norms for s in inputs)
        key = (bucket, stats)
        if key not in self.logits:
            self._capture(bucket, stats)
        self._stage(inputs, decode, bucket, stats, ids_from)
        if self.capture:
            self.graphs[key].replay()
        else:
            self.logits[key] = self._forward(bucket, stats)
        self.replays[key] += 1
        out = StepOutput(logits=self.logits[key][:b], graph=True)
        if stats:
            self._statistics(inputs, bucket, nb * self.runner.storage.block_size, out)
        return out

    def capture_all(self) -> None:
        """Capture every bucket's graphs now, plain and statistics (largest first, so
        the smaller ones reuse its memory pool): warm-up pays this instead of the first
        steps of each size, and a policy's first request does not stall the batch."""
        for stats in (False, True):
            for bucket in reversed(self.buckets):
                if (bucket, stats) not in self.logits:
                    self._capture(bucket, stats)

    def _capture(self, bucket: int, stats: bool) -> None:
        """Warm the forward on all-padding inputs (Triton compiles, cuBLAS picks its
        kernels: neither may happen inside a capture), then capture it."""
        self._pad(bucket)
        logits = self._forward(bucket, stats)
        if not self.capture:
            self.logits[bucket, stats] = logits
            return
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture (torch.cuda.graph collects just
        # before it): a cycle holding a pinned host tensor (an eager step's upload, a
        # swap copy) freed there records a CUDA event, which invalidates a capture: the
        # likely cause of a parity test under swap preemption whose capture of bucket 1
        # was invalidated on an H200 (docs/benchmarks.md at commit 85b7755; not reproduced).
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._mempool):
                self.logits[bucket, stats] = self._forward(bucket, stats)
        finally:
            if enabled:
                gc.enable()
        torch.cuda.synchronize()
        self.graphs[bucket, stats] = graph

    def _statistics(self, inputs: list[SeqInput], bucket: int, width: int,
                    out: StepOutput) -> None:
        """The replay's mass and norms as the eager runner hands them (`AttentionMass`):
        the step's rows and columns, one device-to-host copy per statistic asked."""
        from attention.stats import AttentionMass

        b = len(inputs)
        mass_all, kn_all, vn_all = self.stats[bucket]
        mass = (mass_all[:, :b, :, :, :width].cpu()
                if any(s.wants_attention for s in inputs) else None)
        kn = vn = None
        if any(s.wants_norms for s in inputs):
            kn, vn = kn_all[:, :b].cpu(), vn_all[:, :b].cpu()
        for i, s in enumerate(inputs):
            if s.wants_attention or s.wants_norms:
                a = AttentionMass(mass if s.wants_attention else None, i, 1)
                if s.wants_norms:  # the packed token axis is the batch here
                    a.key_norm, a.value_norm, a.token = kn, vn, i
                out.attention[i] = a

    def _pad(self, bucket: int) -> None:
        """Every row of the bucket padding: it writes the scratch block and sees nothing."""
        self.ids[:bucket] = 0
        self.pos[:bucket] = 0
        self.q_pos[:bucket] = -1
        self.write_slots[:, :bucket] = self.scratch_slot
        self.slot_count.zero_()
        self.mass_rows[:bucket] = 0

    def _stage(self, inputs: list[SeqInput], decode: DecodeBatch, bucket: int,
               stats: bool, ids_from: IdsFrom | None = None) -> None:
        """The step's inputs into the static buffers: rows b < B are the step's, the
        rest padding; tables and positions fill the first nb columns (`slot_count`).
        Every piece is written straight into the pinned staging buffer (the tables'
        rows by `SlotTables.rows_into`, nb columns each), crosses in one copy, and is
        spread into its buffer by a device copy. With `ids_from` the ids staged are the
        rows to take from its tensor, gathered on the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy is done (it always is by now)
        b, nl, nb = len(inputs), self.runner.config.num_layers, decode.blocks
        width = nb * self.runner.storage.block_size
        pos = [x.start_pos for x in inputs]
        pad = bucket - b
        flags = [int(x.wants_attention) for x in inputs] + [0] * pad if stats else []
        ids = ids_from[1] if ids_from is not None else [x.token_ids[0] for x in inputs]
        small = torch.tensor(ids + [0] * pad + pos + [0] * pad
                             + pos + [-1] * pad + [width] + flags, dtype=torch.int32)
        self._host[: small.numel()].copy_(small)
        spread: list[tuple[int, tuple[int, ...], torch.Tensor]] = []  # (at, shape, where)
        a = small.numel()

        def host(shape: tuple[int, ...], dst: torch.Tensor) -> torch.Tensor:
            nonlocal a
            n = math.prod(shape)
            spread.append((a, shape, dst))
            a += n
            return self._host[a - n : a].view(shape)

        write = host((nl, bucket), self.write_slots[:, :bucket])
        write[:, :b] = decode.slots
        write[:, b:] = self.scratch_slot
        decode.tables.rows_into(decode.rows, nb, host((nl, b, nb), self.tables[:, :b, :nb]),
                                host((nl, b, width), self.slot_pos[:, :b, :width]))
        self._dev[:a].copy_(self._host[:a], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        small_dev = self._dev[: small.numel()]
        if ids_from is None:
            self.ids[:bucket].copy_(small_dev[:bucket])
        else:  # the staged rows of its tensor; padding's take row 0's id: they see nothing
            torch.index_select(ids_from[0], 0, small_dev[:bucket], out=self.ids[:bucket])
        for dst, at in ((self.pos, bucket), (self.q_pos[:, 0], 2 * bucket)):
            dst[:bucket].copy_(small_dev[at : at + bucket])
        self.slot_count.copy_(small_dev[3 * bucket : 3 * bucket + 1])
        if stats:
            self.mass_rows[:bucket].copy_(small_dev[3 * bucket + 1 :])
        for at, shape, dst in spread:
            dst.copy_(self._dev[at : at + math.prod(shape)].view(shape))

    def _forward(self, bucket: int, stats: bool) -> torch.Tensor:
        """The decode forward over the first `bucket` rows of the static buffers; with
        `stats`, also the mass of the flagged rows and every row's K/V norms (kept in
        `self.stats[bucket]`)."""
        from engine.step import new_norms  # the runner imports this module

        r = self.runner
        store, windows, scale = r.storage, r.config.sliding_windows, r.scale
        ws, q_pos = self.write_slots[:, :bucket], self.q_pos[:bucket]
        tables, slot_pos, count = self.tables[:, :bucket], self.slot_pos[:, :bucket], self.slot_count
        kw = {"sum_heads": True, "mass_rows": self.mass_rows[:bucket]} if stats else {}
        mass: list[torch.Tensor] = []
        norms: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            store.write(ws[layer], k, v)
            if stats and self.norms:
                norms.append(new_norms(k, v, store.storage_dtype))
            # the layer's attention variants: a float and the model's sinks, no host sync
            o, probs = store.attend(paged_attention_triton, q[:, None], tables[layer],
                                   slot_pos[layer], q_pos, scale, windows[layer], stats,
                                   slot_count=count, **kw, **r.features[layer])
            if probs is not None:
                mass.append(probs)
            return o[:, 0]

        with torch.inference_mode():
            # every position is below max_model_len (the engine's checks), padding's 0
            hidden = r.model(self.ids[:bucket], self.pos[:bucket], attn, self.max_len - 1)
            if stats:
                none = torch.zeros(len(mass), bucket, r.config.num_kv_heads, device=r.device)
                self.stats[bucket] = (torch.stack(mass),
                                      torch.stack([x[0] for x in norms]) if norms else none,
                                      torch.stack([x[1] for x in norms]) if norms else none)
            return r.model.compute_logits(hidden).float()
