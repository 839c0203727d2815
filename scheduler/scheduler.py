"""Continuous batching: which tokens of which requests run in the next step.

Every step packs, within a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`): first the running requests (one decode token each, or the next chunk
of a prompt still being prefilled), then waiting requests in (priority, arrival) order,
whose prompts may be split into chunks. Blocks are allocated here, while planning, so
that a plan never asks the pool for more than it has. When a running request cannot
grow, the lowest-priority, most recently arrived running request is preempted by
recompute: its blocks are dropped and it re-prefills prompt + generated tokens later
(the client sees no token twice: generated tokens are kept, only their K/V is rebuilt).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from policies.catalog import build_policy
from scheduler.request import Request, Status


@dataclass
class Chunk:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int
    slots: torch.Tensor  # [L, num_tokens]

    @property
    def completes(self) -> bool:
        """The chunk reaches the last known token, so it yields logits to sample from."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class Plan:
    chunks: list[Chunk]
    preempted: list[Request]


class Scheduler:
    def __init__(self, pool: BlockPool, num_layers: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.num_layers = num_layers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.sort_key()), req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.cache is not None:
            req.cache.release()
            req.cache = None
        req.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        assert req.cache is not None
        req.cache.release()
        req.cache = None
        req.num_computed = 0
        req.window_trimmed = 0
        req.pos_offset = 0
        req.prefill_done = False
        if req.policy is not None:  # its state described tokens that are gone
            req.policy = build_policy(req.kv_policy)
        req.num_preemptions += 1
        self.preemptions += 1
        self.add(req)

    def schedule(self) -> Plan:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        preempted: list[Request] = []
        queue = sorted(self.running, key=Request.sort_key)
        while queue and budget > 0:
            req = queue.pop(0)
            n = min(req.num_tokens - req.num_computed, budget)
            assert req.cache is not None
            while req.cache.blocks_needed(n) > self.pool.num_free:
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            chunks.append(self._chunk(req, n))
            budget -= n
        if preempted:  # memory is short: admit nobody new this step
            return Plan(chunks, preempted)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            cache = SeqCache(self.pool, self.num_layers,
                             capacity_blocks=-(-req.num_tokens // self.pool.block_size) + 1)
            if cache.blocks_needed(n) > self.pool.num_free:
                break
            self.waiting.pop(0)
            req.cache = cache
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        return Plan(chunks, preempted)

    def _chunk(self, req: Request, n: int) -> Chunk:
        assert req.cache is not None
        start = req.num_computed
        slots = req.cache.append(torch.arange(start, start + n) - req.pos_offset)
        return Chunk(req, start, n, slots)

    def owned_blocks(self) -> list[torch.Tensor]:
        return [r.cache.owned_blocks() for r in self.running if r.cache is not None]
