"""CUDA graphs for decode steps: the whole forward replayed as one launch.

Why: on a GPU an eager decode step of the 160M model is ~490 kernel launches issued by
Python, and the GPU sat idle ~87% of each 23 ms step (shared/gpu/README.md). A graph
captured once per batch-size bucket replays all of them from one host call. vLLM and
SGLang do the same; what is ours is that eviction still works: a graph reads no
request's lengths or tables from its capture, only from static device buffers that
each step refills with one host-to-device copy, so a policy that evicted slots between
two steps (a -1 in the slot's position) is simply seen by the next replay.

A step runs in a graph when every input is one decode token that asks the forward for
nothing but logits (no attention mass, norms, KeyDiff scores or prompt logprobs: those
steps run eagerly), its batch fits the largest bucket, and its longest table fits the
buffers (`max_len`, vLLM's max_seq_len_to_capture). The batch is padded up to its
bucket: padded rows see no slot (query position -1), write their K/V to the pool's
scratch block (`BlockPool(scratch=True)`: outside its accounting), and their logits are
dropped. The tables are padded to a
fixed width; the kernel walks only the step's width (`slot_count`, read on the device),
so stale columns of earlier, longer steps are never read.

`capture=False` runs the same buffers and padding eagerly: what the tests check on a
CPU (through Triton's interpreter), since only capture itself needs CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpool.triton_attention import paged_attention_triton

if TYPE_CHECKING:  # the runner imports this module
    from engine.runner import ModelRunner, SeqInput

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


def graph_step(s: SeqInput) -> bool:
    """Whether an input can run in a graph: one decode token wanting logits alone."""
    return (len(s.token_ids) == 1 and s.slots is None and s.wants_logits
            and not (s.wants_attention or s.wants_key_diversity or s.wants_norms)
            and s.score is None)


class DecodeGraphs:
    """Static buffers, one graph per batch bucket (captured on first use, or all at once
    by `capture_all` during warm-up), and the step that fills and replays them."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int,
                 capture: bool = True) -> None:
        cfg, pool, dev = runner.config, runner.pool, runner.device
        self.runner = runner
        self.capture = capture
        self.buckets = batch_buckets(min(max_batch, MAX_BATCH))
        bs = pool.block_size
        self.max_len = max_model_len
        self.max_blocks = -(-min(max_model_len, MAX_LEN) // bs)
        nl, bmax, nbm = cfg.num_layers, self.buckets[-1], self.max_blocks
        if pool.scratch_slot is None:
            raise ValueError("CUDA graphs need a pool with a scratch block (scratch=True)")
        self.scratch_slot = pool.scratch_slot
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(bmax, **i64)
        self.pos = torch.zeros(bmax, **i64)
        self.q_pos = torch.full((bmax, 1), -1, **i64)
        self.write_slots = torch.full((nl, bmax), self.scratch_slot, **i64)
        self.tables = torch.full((nl, bmax, nbm), -1, **i32)
        self.slot_pos = torch.full((nl, bmax, nbm * bs), -1, **i32)
        self.slot_count = torch.zeros(1, **i32)
        # One host-to-device copy a step: everything is staged in one int32 buffer
        # (pinned on CUDA, so the copy is asynchronous), then spread on the device.
        n = 3 * bmax + 1 + nl * bmax * (1 + nbm + nbm * bs)
        self._host = torch.empty(n, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._dev = torch.empty(n, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0  # decode steps run through the graphs
        self.eager_steps = 0  # decode-only steps that did not fit (run eagerly)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, inputs: list[SeqInput], decode_slots: torch.Tensor) -> torch.Tensor | None:
        """The step's logits [B, V] (float32, valid until the next replay), or None when
        the step does not fit a graph (then the runner runs it eagerly)."""
        b = len(inputs)
        if decode_slots.shape[1] != b:  # prefill chunks in the step
            return None
        bucket = self.bucket(b)
        caches = [s.cache for s in inputs]
        nb = max(c.max_blocks for c in caches)
        if bucket is None or nb > self.max_blocks or not all(map(graph_step, inputs)):
            self.eager_steps += 1
            return None
        if bucket not in self.logits:
            self._capture(bucket)
        self._stage(inputs, caches, decode_slots, bucket, nb)
        if self.capture:
            self.graphs[bucket].replay()
        else:
            self.logits[bucket] = self._forward(bucket)
        self.steps += 1
        return self.logits[bucket][:b]

    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so the smaller ones reuse its memory
        pool): warm-up pays this instead of the first steps of each size."""
        for bucket in reversed(self.buckets):
            if bucket not in self.logits:
                self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        """Warm the forward on all-padding inputs (Triton compiles, cuBLAS picks its
        kernels: neither may happen inside a capture), then capture it."""
        self._pad(bucket)
        logits = self._forward(bucket)
        if not self.capture:
            self.logits[bucket] = logits
            return
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self.logits[bucket] = self._forward(bucket)
        torch.cuda.synchronize()
        self.graphs[bucket] = graph

    def _pad(self, bucket: int) -> None:
        """Every row of the bucket padding: it writes the scratch block and sees nothing."""
        self.ids[:bucket] = 0
        self.pos[:bucket] = 0
        self.q_pos[:bucket] = -1
        self.write_slots[:, :bucket] = self.scratch_slot
        self.slot_count.zero_()

    def _stage(self, inputs: list[SeqInput], caches: list, decode_slots: torch.Tensor,
               bucket: int, nb: int) -> None:
        """The step's inputs into the static buffers: rows b < B are the step's, the
        rest padding; tables and positions fill the first nb columns (`slot_count`).
        Every piece is written into the pinned staging buffer in turn, crosses in one
        copy, and is spread into its buffer by a device copy."""
        b, nl, width = len(inputs), self.runner.config.num_layers, nb * self.runner.pool.block_size
        table, slot_pos, _ = caches[0].tables.rows_of([c.row for c in caches], nb)
        pos = [x.start_pos for x in inputs]
        pad = bucket - b
        small = torch.tensor([x.token_ids[0] for x in inputs] + [0] * pad + pos + [0] * pad
                             + pos + [-1] * pad + [width], dtype=torch.int32)
        write = torch.empty(nl, bucket, dtype=torch.int64)
        write[:, :b] = decode_slots
        write[:, b:] = self.scratch_slot
        pieces = [  # (host data, where it lands)
            (small[:bucket], self.ids[:bucket]),
            (small[bucket : 2 * bucket], self.pos[:bucket]),
            (small[2 * bucket : 3 * bucket], self.q_pos[:bucket, 0]),
            (small[3 * bucket :], self.slot_count),
            (write, self.write_slots[:, :bucket]),
            (table, self.tables[:, :b, :nb]),
            (slot_pos, self.slot_pos[:, :b, :width]),
        ]
        staged, a = [], 0
        for data, _ in pieces:
            n = data.numel()
            self._host[a : a + n].view(data.shape).copy_(data)
            staged.append((a, n))
            a += n
        self._dev[:a].copy_(self._host[:a], non_blocking=True)
        for (o, n), (data, dst) in zip(staged, pieces):
            dst.copy_(self._dev[o : o + n].view(data.shape))

    def _forward(self, bucket: int) -> torch.Tensor:
        """The decode forward over the first `bucket` rows of the static buffers."""
        r = self.runner
        pool, windows, scale = r.pool, r.config.sliding_windows, r.scale
        ws, q_pos = self.write_slots[:, :bucket], self.q_pos[:bucket]
        tables, slot_pos, count = self.tables[:, :bucket], self.slot_pos[:, :bucket], self.slot_count

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool.write(ws[layer], k, v)
            o, _ = pool.attend(paged_attention_triton, q[:, None], tables[layer],
                               slot_pos[layer], q_pos, scale, windows[layer], False,
                               slot_count=count)
            return o[:, 0]

        with torch.inference_mode():
            # every position is below max_model_len (the engine's checks), padding's 0
            hidden = r.model(self.ids[:bucket], self.pos[:bucket], attn, self.max_len - 1)
            return r.model.compute_logits(hidden).float()
