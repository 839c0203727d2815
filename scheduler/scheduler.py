"""Continuous batching: which tokens of which requests run in the next step.

Every step packs, within a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`): first the running requests (one decode token each, or the next chunk
of a prompt still being prefilled), then swapped-out requests coming back, then waiting
requests in order, whose prompts may be split into chunks. Blocks are allocated while
planning, so a plan never asks the pool for more than it has.

Memory management follows 003_12df107fdefa535c.txt:
- watermark admission: a waiting request is admitted only if its blocks fit while
  leaving `watermark` of the pool in reserve; running requests may grow into it;
- reservation for bounded requests: a request whose `kv_policy` bounds its cache
  (`Request.reserve_blocks`, from the policy's `max_live`) is admitted only if it can
  grow to that bound (while prompt chunks remain, to the bound plus a chunk), and the
  growth still ahead of running bounded requests is kept free for them; unbounded
  (`full`) requests are admitted on what they need now; when the newcomer and every
  running request are reserved, no watermark is kept (there is no unaccounted growth
  for it to absorb);
- preemption when a running request cannot grow: the victim is the lowest-priority,
  most recently arrived running request, one without a reservation first (never one
  resumed that has not yet produced a token, unless nothing else is left); it is
  swapped to host or dropped for recompute (`swap` | `recompute` | `auto` by cost model);
- no thrash: a preempted request is from then on reserved its peak (`peak_blocks`:
  prompt + max_tokens), so it comes back only once it can finish and is not preempted
  again. Admission stays optimistic until memory actually runs short (vLLM's), but a
  long generation is recomputed once instead of over and over: with all-`full` requests
  of 4,096 tokens in a pool for 8, the optimistic rule recomputed 523 times for 64
  requests (docs/benchmarks.md, issue 5). `reserve_preempted=False` restores vLLM's;
- prefix caching: full prompt blocks are looked up by chain hash and shared;
- tenant quotas: a tenant's blocks stay within its share plus what is left of the
  shared burst pool.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from kvpool.manager import DecodeBatch, KVCacheManager
from policies.catalog import build_policy
from scheduler.preemption import CostModel
from scheduler.request import Request, Status

# A request preempted this many times jumps the queues (and is preempted last).
STARVATION_LIMIT = 3
OVER_QUOTA = -1


@dataclass(slots=True)
class Chunk:
    request: Request
    start: int  # first token (by count of tokens computed) computed this step
    num_tokens: int
    # [L, num_tokens] pool slots to write K/V to; None for a decode token, whose slots
    # are a column of the plan's `decode.slots` (all decode tokens get theirs in one batch).
    slots: torch.Tensor | None
    # The chunk reaches the last known token, so it yields logits to sample from.
    completes: bool


@dataclass
class Plan:
    chunks: list[Chunk]
    preempted: list[Request]
    # The D decode chunks' (those with `slots` None) batch append, in chunk order.
    decode: DecodeBatch | None = None


@dataclass
class MemoryConfig:
    """The scheduler's memory rules (the watermark and prefix caching are the
    `KVCacheManager`'s: they describe memory, not order)."""

    preemption_mode: str = "recompute"  # swap | recompute | auto
    tenant_quotas: dict[str, float] = field(default_factory=dict)
    reserve_preempted: bool = True  # a preempted request waits until its peak fits


def _owed(req: Request, computed: int) -> int:
    """The blocks a bounded request is owed once `computed` tokens are in: its steady
    state, or while prompt chunks remain, its bound plus a chunk (`peak_blocks`):
    bounded prefill evicts only after each chunk (docs/memory.md, "Reservation")."""
    if computed < len(req.prompt_ids):
        return max(req.reserve_blocks, req.peak_blocks)
    return req.reserve_blocks


def _key(r: Request) -> tuple[bool, int, float]:
    return (r.num_preemptions < STARVATION_LIMIT, r.priority, r.arrival_time)


class Scheduler:
    """Order and token budget; every block it needs goes through `kv`."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 memory: MemoryConfig | None = None, cost: CostModel | None = None) -> None:
        self.kv = kv
        self.num_layers = kv.num_layers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mem = memory or MemoryConfig()
        self.cost = cost
        self.waiting: list[Request] = []  # sorted by _key
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.preemptions: dict[str, int] = {"swap": 0, "recompute": 0}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens served from the cache
        self.pending: dict[int, int] = {}  # prefix hash -> requests computing it now
        # Per policy name, tokens its requests' rings overwrote (evictions counted where
        # the decode append does them; `PolicyRunner` counts the policies' own).
        self.ring_evicted: dict[str, int] = {}

    # ---- queues ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        keys = [_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _key(req)), req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and give its blocks back."""
        for q in (self.running, self.waiting, self.swapped):
            if req in q:
                q.remove(req)
                break
        self._unpend(req)
        if req.cache is not None:
            self._release(req)
        req.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def tenant_blocks(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for r in self.running:
            if r.tenant is not None and r.cache is not None:
                used[r.tenant] = used.get(r.tenant, 0) + r.cache.num_blocks
        return used

    # ---- the plan ------------------------------------------------------------------
    def schedule(self) -> Plan:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        preempted: list[Request] = []
        # Decoding requests' cache rows and next positions; their blocks are taken below,
        # all at once. While the pool holds a block per layer for every one of them
        # (`roomy`), nobody counts: the append counts in one C++ pass. Once it might not,
        # `pending` counts them exactly, and preemption decides on exact counts.
        rows: list[int] = []
        positions: list[int] = []
        pending = 0
        roomy = True
        nl = self.num_layers
        free = self.kv.num_free  # changes only where this loop preempts or appends
        # In _key order (`_resume` keeps `running` so): no sort per step. Reversed, so the
        # next request pops off the end and a victim is removed from what is left.
        queue = self.running[::-1]
        running = Status.RUNNING
        while queue and budget > 0:
            req = queue.pop()
            left = req.num_tokens - req.num_computed
            # a decode token (budget and max_chunk are at least 1): min() is a tenth of
            # this loop's time at 64 decoding
            n = 1 if left == 1 else min(left, budget, req.max_chunk)
            cache = req.cache
            assert cache is not None
            if cache.ring:
                self._count_ring(req)
            if n == 1 and roomy and nl * (len(rows) + 1) <= free:
                need = 0
            else:
                if roomy:
                    roomy, pending = False, self.kv.decode_need(rows)
                need = self.kv.blocks_needed(cache, n)
            if need + pending > free:
                while need + pending > self.kv.num_free:
                    victim = self._victim(queue[::-1]) or req  # in planning order
                    if victim is not req:
                        queue.remove(victim)
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                free = self.kv.num_free
            if req.status is running:  # not preempted just above
                if n == 1:
                    rows.append(cache.row)
                    positions.append(req.num_computed - req.pos_offset)
                    pending += need
                    chunks.append(Chunk(req, req.num_computed, 1, None, left == 1))
                else:
                    chunks.append(self._chunk(req, n))
                    free = self.kv.num_free
                budget -= n
        # Every decode token's slots in one batch: the ops do not grow with their number.
        plan = Plan(chunks, preempted, self.kv.append_decode(rows, positions) if rows else None)
        if preempted:  # memory is short: bring nobody in this step
            return plan
        reserved = self._reserved() if self.waiting or self.swapped else 0  # only if needed
        while self.swapped and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.swapped[0]
            assert req.cache is not None
            n = min(req.num_tokens - req.num_computed, budget, req.max_chunk)
            need = req.cache.num_blocks + self.kv.blocks_needed(req.cache, n)
            growth = max(0, req.reserve_blocks - need) + reserved if self.running else 0
            if not self.kv.fits(need + growth, watermark=False):
                break
            self.swapped.pop(0)
            self._resume(req, swap_in=True)
            chunks.append(self._chunk(req, n))
            budget -= n
            reserved += self._ahead(req, n)
        if self.swapped:  # resume the swapped before admitting anyone new
            return plan
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            n = self._admit(req, budget, reserved)
            if n == OVER_QUOTA:  # only this tenant waits; others may still start
                i += 1
                continue
            if n == 0:  # FCFS: memory is short for the head of the queue
                break
            self.waiting.pop(i)
            chunks.append(self._chunk(req, n))
            budget -= n
            reserved += self._ahead(req, n)
        return plan

    def _ahead(self, req: Request, planned: int = 0) -> int:
        """Blocks a bounded request may still grow into (0 for unbounded ones), once the
        `planned` tokens of this step's chunk are in."""
        if not req.reserve_blocks or req.cache is None:
            return 0
        return max(0, _owed(req, req.num_computed + planned) - req.cache.num_blocks)

    def _reserved(self) -> int:
        """Blocks the running bounded requests may still grow into.

        Why: a request whose policy bounds its cache (streaming at a 25% budget, ...)
        has a known steady-state size, so admitting it only when that size fits means it
        never forces a preemption by growing; counting only what it holds now would
        admit more than the pool can carry and recompute the newest ones later (each
        a long re-prefill)."""
        bounded = [r for r in self.running
                   if r.reserve_blocks and r.cache is not None and r.cache.has_row]
        if not bounded:
            return 0
        # One read of the rows' sizes (`held_and_need`): summing each cache's blocks in
        # Python read L·H sizes a request, every step a per-head request borrows.
        held, _ = self.kv.held_and_need([r.cache for r in bounded])  # type: ignore[misc]
        return sum(max(0, _owed(r, r.num_computed) - h) for r, h in zip(bounded, held))

    def spare_blocks(self) -> int:
        """Free blocks no one is owed: past the running bounded requests' growth to
        their reservations and the watermark, while nobody waits or is swapped out (then
        none: what the pool frees goes to them). A scattered-eviction request over its
        reservation may borrow these instead of compacting (`PolicyRunner`)."""
        if self.waiting or self.swapped:
            return 0
        return max(0, self.kv.num_free - self._reserved() - self.kv.watermark_blocks)

    def _admit(self, req: Request, budget: int, reserved: int = 0) -> int:
        """Set up a waiting request's cache (prefix hits included) if it may start now;
        returns the tokens to compute this step (0: memory is short; OVER_QUOTA).

        Beside this step's blocks and the watermark, the blocks running bounded requests
        may still grow into (`reserved`) and this request's own growth to its bound stay
        free; with nothing running a request starts whatever its bound."""
        # A policy that scores the prompt by its queries (attention, their statistics:
        # `Needs.sees_prompt`) must see them, and prompt logprobs need its logits, so
        # such a request computes its prompt (and still publishes it) instead of hits.
        scores_prompt = (req.policy is not None and req.policy.needs.sees_prompt) or req.scoring_prompt
        hashes = req.block_hashes if self.kv.prefix_caching and not scores_prompt else []
        limit = self.kv.hit_limit(req.policy, len(req.prompt_ids))
        if limit is not None:
            hashes = hashes[:limit]
        found = self.kv.lookup(hashes)
        hits = len(found)
        if hits < len(hashes) and hashes[hits] in self.pending:
            # Another request (e.g. a sibling sample of n > 1) is computing this very
            # prefix right now: wait one prefill and share it instead of duplicating.
            self.kv.drop(found)
            return 0
        cache, computed = self.kv.admit(found, req.num_tokens)
        n = min(req.num_tokens - computed, budget, req.max_chunk)
        need = self.kv.blocks_needed(cache, n)
        owed = _owed(req, computed + n)
        ahead = max(0, owed - cache.num_blocks - need) if req.reserve_blocks else 0
        if not self.running:
            ahead = reserved = 0
        # The watermark is headroom for growth nobody accounted for; when this request
        # and every running one have their growth reserved, there is none (a pool of
        # exactly k reserved requests then runs k, not k - 1).
        unaccounted = not (req.reserve_blocks and all(r.reserve_blocks for r in self.running))
        if not self.kv.fits(need + ahead + reserved, watermark=unaccounted):
            self.kv.release(cache)
            return 0
        if not self._quota_ok(req, need + cache.num_blocks):
            self.kv.release(cache)
            return OVER_QUOTA
        req.cache = cache
        req.num_computed = computed
        req.registered = hits
        if req.num_preemptions == 0:
            self.prefix_queries += len(req.prompt_ids)
            self.prefix_hits += computed
            req.kv.prefix_hit_tokens = computed
        for h in hashes[hits:]:
            self.pending[h] = self.pending.get(h, 0) + 1
        self._resume(req, swap_in=False)
        return n

    def _quota_ok(self, req: Request, blocks: int) -> bool:
        quotas = self.mem.tenant_quotas
        if not quotas or req.tenant is None:
            return True
        total = self.kv.num_blocks
        used = self.tenant_blocks()
        burst = total * (1 - sum(quotas.values()))
        burst_used = sum(max(0.0, u - quotas.get(t, 0.0) * total) for t, u in used.items())
        mine = used.get(req.tenant, 0) + blocks
        return mine <= quotas.get(req.tenant, 0.0) * total + max(0.0, burst - burst_used)

    def _resume(self, req: Request, swap_in: bool) -> None:
        if swap_in:
            assert req.cache is not None
            t = time.perf_counter()
            moved = self.kv.swap_in(req.cache)
            if self.cost is not None:
                self.cost.observe_copy(moved, time.perf_counter() - t)
        req.status = Status.RUNNING
        req.resume_mark = len(req.output_ids)
        # In (starved, priority, arrival) order, after equal keys: the order planning
        # visits them in, kept here because a running request's key never changes.
        bisect.insort_right(self.running, req, key=_key)

    def _victim(self, queue: list[Request]) -> Request | None:
        """Lowest priority, then one whose growth nobody reserved, then newest; skip
        requests resumed without progress since.

        Why unreserved first: a reserved request (bounded policy, or preempted before)
        was admitted on the promise that its growth fits; the request that outgrew the
        plan is the one admitted on what it needed at the time."""
        candidates = [r for r in queue if r.num_preemptions == 0 or len(r.output_ids) > r.resume_mark]
        pool = candidates or queue
        if not pool:
            return None
        return max(pool, key=lambda r: (*_key(r)[:2], r.reserve_blocks == 0, r.arrival_time))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._unpend(req)
        assert req.cache is not None
        mode = self._mode(req)
        req.num_preemptions += 1
        if self.mem.reserve_preempted:
            req.reserve_blocks = max(req.reserve_blocks, req.peak_blocks)
        self.preemptions[mode] += 1
        if mode == "swap":
            t = time.perf_counter()
            moved = self.kv.swap_out(req.cache)
            if self.cost is not None:
                self.cost.observe_copy(moved, time.perf_counter() - t)
            req.status = Status.WAITING
            self.swapped.append(req)
            self.swapped.sort(key=_key)
            return
        self._release(req)
        req.num_computed = 0
        req.window_trimmed = 0
        req.pos_offset = 0
        req.prefill_done = False
        req.ringing = False
        req.reserve_ok_until = 0  # its growth is a prefill's again
        if req.policy is not None:  # its state described tokens that are gone
            req.policy = build_policy(req.kv_policy)
        self.add(req)

    def _release(self, req: Request) -> None:
        """Give a request's cache back (finished, or preempted for a recompute), its
        peak sizes kept in the request's usage."""
        assert req.cache is not None
        if req.cache.ring:
            self._count_ring(req)
        blocks, live = req.cache.peak()
        kv = req.kv
        kv.peak_blocks = max(kv.peak_blocks, blocks)
        kv.peak_live_tokens = max(kv.peak_live_tokens, live)
        spread = self.kv.head_spread(req.cache)
        if spread is not None:  # the last release (the finished request's) stays
            kv.head_live_min, kv.head_live_max = spread
        self.kv.release(req.cache)
        req.cache = None

    def _count_ring(self, req: Request) -> None:
        """Count what its ring overwrote since last asked as its policy's evictions."""
        assert req.cache is not None
        n = self.kv.take_overwritten(req.cache)
        if n:
            req.ringing = True
            req.kv.evicted_tokens += n
            self.ring_evicted[req.policy_name] = self.ring_evicted.get(req.policy_name, 0) + n

    def _mode(self, req: Request) -> str:
        mode = self.mem.preemption_mode
        assert req.cache is not None
        if mode == "recompute" or not self.kv.can_swap_out(req.cache):
            return "recompute"
        if mode == "swap" or self.cost is None:
            return "swap"
        return self.cost.choose(req.cache.num_blocks * self.kv.block_bytes, req.num_computed)

    def _chunk(self, req: Request, n: int) -> Chunk:
        assert req.cache is not None
        start = req.num_computed
        return Chunk(req, start, n, self.kv.allocate(req.cache, start - req.pos_offset, n),
                     start + n == req.num_tokens)

    # ---- after the forward ---------------------------------------------------------
    def publish(self, chunks: list[Chunk]) -> None:
        """Register prompt blocks computed this step in the prefix cache (only while
        every layer still holds every token, but what a sliding window dropped: an
        evicted block is no one's prefix)."""
        if not self.kv.prefix_caching:
            return
        for c in chunks:
            r = c.request
            if r.cache is None or r.registered >= len(r.block_hashes):
                continue
            if not r.cache.intact:
                self._unpend(r)
                r.registered = len(r.block_hashes)
                continue
            upto = min(r.num_computed // self.kv.block_size, len(r.block_hashes))
            self.kv.publish(r.cache, r.block_hashes, r.registered, upto, r.num_computed)
            for h in r.block_hashes[r.registered:upto]:
                self._pending_done(h)
            r.registered = max(r.registered, upto)

    def _unpend(self, req: Request) -> None:
        for h in req.block_hashes[req.registered:]:
            self._pending_done(h)
        req.registered = len(req.block_hashes)

    def _pending_done(self, h: int) -> None:
        c = self.pending.get(h, 0)
        if c <= 1:
            self.pending.pop(h, None)
        else:
            self.pending[h] = c - 1
