"""The KV-cache manager: the one object through which the scheduler touches KV memory.

vLLM v1 splits the same way (`kv_cache_manager` over a metadata-only `block_pool`): the
scheduler decides *who* runs and *how many* tokens; this module decides what that
costs in blocks and carries it out. It owns the `BlockPool` (device blocks, free list,
prefix groups), the `SlotTables` every request's cache is a row of, the host
`SwapSpace`, and the arithmetic of reservations, and it is the one door through which
the scheduler and the policy mechanism change memory: admission, allocation, a policy's
drops (`run_policy`), compaction, rings, release and preemption. The KV tensors are the
model runner's (`attention.storage.KVStorage`); the moves decided here reach them through
the pool's `storage` (tests/test_layering.py checks both rules).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from attention.swap import SwapSpace
from kvpool import compaction
from kvpool.policy_rows import Member, load_select, run_group
from kvpool.pool import BlockPool, load_mark
from kvpool.seq_cache import SeqCache
from kvpool.tables import SlotTables
from kvpool.windows import (
    NO_WINDOW,
    first_needed,
    longest_hit,
    longest_request,
    request_blocks,
    trim_positions,
)
from policies.rows import NATIVE

# Shortest prefill chunk a bounded policy is given: shorter chunks would hold even less
# memory, but each is a whole engine step (host overhead, a forward of few rows), and
# below a few hundred tokens prefill throughput falls off while the memory saved is a
# few hundred tokens per request.
MIN_PREFILL_CHUNK = 256


def load_memory_ops() -> dict[str, bool]:
    """Build (or load) the host-side C++ ops of memory: the policies' selection and state
    updates (`kvpool.policy_rows.load_select`) and the tables' passes; op -> loaded."""
    select = load_select()
    return {"select_cpu": select, "state_cpu": NATIVE["state"], "tables_cpu": load_mark()}


@dataclass
class DecodeBatch:
    """A step's decode tokens, appended in one batch (`KVCacheManager.append_decode`):
    where they go and what their attention reads. Why it travels with the plan: in the
    steady state (every input one decode token wanting its logits alone) the runner
    builds the step's attention from these rows and the tables alone
    (`engine.attention_groups.decode_batch_group`), touching no request or cache: that
    was a pass per request of cold Python objects after the previous forward."""

    slots: torch.Tensor  # [L, D] physical slots to write K/V to, in chunk order
    rows: list[int]  # the caches' rows of `tables`, in the same order
    blocks: int  # the most blocks any of them holds in a layer (after the append)
    tables: SlotTables


class KVCacheManager:
    def __init__(self, pool: BlockPool, num_layers: int, *, watermark: float = 0.01,
                 enable_prefix_caching: bool = True, swap: SwapSpace | None = None,
                 rows: int = 16, min_prefill_chunk: int = MIN_PREFILL_CHUNK,
                 heads: int = 1, head_roles: torch.Tensor | None = None,
                 slack_tokens: int | None = None,
                 windows: list[int | None] | None = None) -> None:
        """`num_layers`: a request's lanes (its page lists and lengths): one a layer, or
        one a (layer, kv head) over a per-head pool, `heads` a layer (lane l·heads + h).
        Memory counts lanes where this class says layers; only the policies tell them
        apart (`RowsView.heads`). `slack_tokens`: the room a bounded request's
        reservation leaves in each lane past its bound (`reservation`); None: a page.
        `windows`: per lane, its sliding window or None (kvpool/windows.py: a windowed
        lane holds its window's pages, and is counted so); None: every lane global."""
        self.pool = pool
        self.min_prefill_chunk = min_prefill_chunk
        self.num_layers = num_layers
        self.block_size = pool.block_size
        self.slack_tokens = pool.block_size if slack_tokens is None else slack_tokens
        self.watermark_blocks = int(watermark * pool.num_blocks)
        self.prefix_caching = enable_prefix_caching
        self.swap = swap
        # Whether a policy's ring (StreamingLLM's fixed-size cache, `SlotTables.start_ring`)
        # is used: the engine turns it off for models with sliding-window layers, whose
        # trimming evicts by position under the ring.
        self.rings = True
        # Every cache is a row of these (kvpool/tables.py); they grow as needed.
        self.tables = SlotTables(num_layers, pool.block_size, rows=rows, heads=heads)
        self.tables.head_roles = head_roles  # what `duo` streams by (policies/duo_attention.py)
        self.windows: list[int | None] = list(windows or [None] * num_layers)
        assert len(self.windows) == num_layers
        windowed = [w is not None for w in self.windows]
        # A kv_policy acts on the global lanes alone: a windowed lane is bounded by its
        # window already (`policy_rows.run_group` keeps the drops off the others).
        self.policy_lanes = [lane for lane, w in enumerate(windowed) if not w]
        if any(windowed):
            self.tables.windowed = torch.tensor(windowed)
            pool.optional_lanes = frozenset(i for i, w in enumerate(windowed) if w)
        # [lanes] each lane's window, NO_WINDOW for global ones (`trim`)
        self._window_t = torch.tensor([NO_WINDOW if w is None else w for w in self.windows])
        self.min_window = min((w for w in self.windows if w is not None), default=NO_WINDOW)

    # ---- sizes ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        """Blocks the pool hands out in all."""
        return self.pool.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V of one layer, scales included)."""
        assert self.pool.storage is not None
        return self.pool.storage.block_bytes

    def blocks_for(self, tokens: int, chunk: int | None = None, bound: int | None = None) -> int:
        """Blocks (all lanes) that `tokens` tokens of a full cache hold at most, computed
        in chunks of at most `chunk` (None: at once), a global lane holding at most
        `bound` of them (a policy's; None: all): a windowed lane holds its window's
        pages (kvpool/windows.py)."""
        if self.min_window == NO_WINDOW and bound is None:
            return self.num_layers * -(-tokens // self.block_size)
        return request_blocks(tokens, self.windows, tokens if chunk is None else chunk,
                              self.block_size, bound)

    def tokens_within(self, blocks: int, chunk: int, most: int) -> int:
        """The longest request (up to `most` tokens) whose full cache fits in `blocks`."""
        return longest_request(blocks, self.windows, chunk, self.block_size, most)

    def head_spread(self, cache: SeqCache) -> tuple[int, int] | None:
        """(fewest, most) live tokens among a cache's (layer, kv head) lanes over a
        per-head pool; None over a per-layer pool."""
        if self.tables.heads == 1:
            return None
        live = cache.layer_live
        return min(live), max(live)

    def ring(self, policy: Any | None) -> tuple[int, int] | None:
        """(sink, cap) of the ring a request under `policy` gets at its window, or None."""
        return getattr(policy, "ring", None) if self.rings else None

    def reservation(self, policy: Any | None, prompt_len: int, total: int,
                    max_chunk: int) -> tuple[int, int]:
        """(reserve, peak) in blocks over all layers for a request of `total` tokens.

        `peak`: the most it can ever hold — prompt + max_tokens, or under a policy that
        bounds its cache, the bound plus one prefill chunk (eviction runs after each
        chunk) and a partly dead block. `reserve`: the steady-state size admission keeps
        free for a bounded request (0: unbounded, admitted on what it needs now); with a
        ring, exactly the blocks of its bound (the step's token goes over the oldest).
        A policy that keeps the prompt whole until it ends (snapkv, pyramid: its
        `max_live_decoding`) reserves what it holds after it; the prompt is its peak.

        The steady state in decode is the bound, the step's new token and `slack_tokens`
        in each lane: room for the holes scattered evictions leave (or a partly dead page
        at the old edge of the kept window) until a compaction packs the lane
        (scheduler/policy_runner.py). A page of slack, as a per-layer pool's 16 tokens,
        would cost a per-head pool of 64-token pages 64 tokens in every lane; either way
        a lane is compacted at most once per `slack_tokens` decode steps."""
        bs, layers, slack = self.block_size, self.num_layers, self.slack_tokens
        tokens = total - 1  # the last sampled token is never fed back: it needs no slot
        # A windowed lane holds its window and the longest chunk (a recompute re-prefills
        # prompt and output in chunks), and in decode its window (kvpool/windows.py).
        chunk = min(max_chunk, tokens)
        bound = None
        reserve = 0
        if policy is not None and hasattr(policy, "max_live"):
            live = policy.max_live(total, prompt_len, bs)
            steady = live
            if hasattr(policy, "max_live_decoding"):
                steady = policy.max_live_decoding(total, prompt_len, bs)
            ahead = min(max_chunk, prompt_len)
            peak = max(prompt_len, steady + ahead) if steady < live else live + ahead
            bound = min(tokens, peak + 2 * bs)
            if live + 1 < tokens:
                # For lanes of different bounds (pyramid), the same from the sum over
                # lanes: Σ_l ceil((n_l + 1 + s) / bs) <= ceil((Σ_l n_l + L·s) / bs) + L.
                glob = len(self.policy_lanes)
                reserve = glob * -(-(steady + 1 + slack) // bs)
                if self.ring(policy) is not None:
                    reserve = glob * -(-steady // bs)
                if hasattr(policy, "max_live_total") and glob == layers:
                    summed = policy.max_live_total(total, prompt_len, bs, layers,
                                                   decoding=True)
                    reserve = min(reserve, -(-(summed + layers * slack) // bs) + layers)
                if glob < layers:  # the windowed lanes in decode
                    reserve += self.blocks_for(tokens, 1, 0)
        return reserve, self.blocks_for(tokens, chunk, bound)

    def prefill_chunk(self, policy: Any | None, prompt_len: int, max_chunk: int) -> int:
        """Longest prefill chunk for a request under `policy` (`max_chunk`: the step's
        token budget).

        Why: a policy that evicts between prompt chunks bounds memory only if the
        chunks are bounded too; with the whole step budget as one chunk, a streaming
        request with a 64-token window held its whole 300-token prompt (issue 20). Its
        chunks are as long as the bound, at least `min_prefill_chunk`
        (EngineConfig, MIN_PREFILL_CHUNK by default): live tokens never exceed the bound
        plus one chunk (twice the bound, for bounds past the floor). A longer floor
        prefills faster and lets a scoring policy (h2o, tova, keydiff, lazy_eviction)
        rank more of the prompt at once, for more memory per request. A policy that
        keeps the prompt whole until it ends (its `max_live` during the prompt is the
        prompt so far) gains nothing from short chunks and keeps the step budget."""
        if policy is None or not hasattr(policy, "max_live") or prompt_len < 2:
            return max_chunk
        during = policy.max_live(prompt_len - 1, prompt_len, self.block_size)
        if during >= prompt_len - 1:
            return max_chunk
        return min(max_chunk, max(self.min_prefill_chunk, during))

    def hit_limit(self, policy: Any | None, prompt_len: int) -> int | None:
        """Most prefix-cache blocks of tokens a request may take at admission: under a
        policy that bounds its prompt (`prefill_chunk`'s case), the whole blocks of its
        bound: with the chunk its first step computes it holds at most the bound plus one
        chunk, as a chunked prefill would (a streaming request once took a whole cached
        750-token prompt for a 68-token window, then evicted it); None: no limit."""
        if policy is None or not hasattr(policy, "max_live") or prompt_len < 2:
            return None
        during = policy.max_live(prompt_len - 1, prompt_len, self.block_size)
        if during >= prompt_len - 1:
            return None
        return during // self.block_size

    def fits(self, blocks: int, watermark: bool = True) -> bool:
        """Whether `blocks` more can be taken now, keeping the watermark free (growth
        nobody accounted for) unless `watermark` is False (every holder's growth is
        reserved: then there is none for it to absorb)."""
        return self.pool.num_free - blocks >= (self.watermark_blocks if watermark else 0)

    # ---- caches --------------------------------------------------------------------
    def new_cache(self, tokens: int) -> SeqCache:
        """An empty cache (a row of the shared tables) with room for `tokens`."""
        return SeqCache(self.pool, self.num_layers, -(-tokens // self.block_size) + 1,
                        tables=self.tables)

    def admit(self, hits: list[torch.Tensor], tokens: int) -> tuple[SeqCache, int]:
        """A new cache for a request of `tokens` tokens, holding the prefix-cache `hits`
        `lookup` took for it; returns it and the tokens it already holds. `release`
        undoes it (the hits' references included)."""
        cache = self.new_cache(tokens)
        cache.adopt(hits)
        return cache, len(hits) * self.block_size

    def blocks_needed(self, cache: SeqCache, n: int) -> int:
        """Blocks (all layers) that `n` more tokens of `cache` would take."""
        return cache.blocks_needed(n)

    def allocate(self, cache: SeqCache, first: int, n: int) -> torch.Tensor:
        """Slots [L, n] for `n` tokens of `cache` at positions first.. (blocks taken as
        needed; PoolExhausted, the cache unchanged, if the pool has too few)."""
        return cache.append(torch.arange(first, first + n))

    def decode_need(self, rows: list[int]) -> int:
        """Blocks a decode append of these cache rows would take."""
        return self.tables.decode_need(rows)[0]

    def append_decode(self, rows: list[int], positions: list[int]) -> DecodeBatch:
        """Every decoding cache's next slot in one batch (`rows`: the caches' rows, their
        tokens at `positions`). The caller has checked that the pool holds the blocks."""
        slots, blocks = self.tables.append_decode(self.pool, rows, positions)
        return DecodeBatch(slots, rows, blocks, self.tables)

    def release(self, cache: SeqCache) -> None:
        """Give back everything a cache holds (device blocks, or swap space)."""
        if cache.swapped:
            assert self.swap is not None
            cache.discard_swapped(self.swap)
        else:
            cache.release()

    def swap_out(self, cache: SeqCache) -> int:
        assert self.swap is not None
        return cache.swap_out(self.swap)

    def swap_in(self, cache: SeqCache) -> int:
        assert self.swap is not None
        return cache.swap_in(self.swap)

    def can_swap_out(self, cache: SeqCache) -> bool:
        return self.swap is not None and cache.num_blocks <= self.swap.num_free

    # ---- what policies and windows change ------------------------------------------
    def run_policy(self, members: list[Member]) -> list[tuple[int, int]]:
        """Let a group of requests of one policy select and carry out its drops
        (`kvpool/policy_rows.py`); per member (evicted slots over all layers, freed blocks)."""
        return run_group(members)

    def compact(self, caches: list[SeqCache]) -> list[int]:
        """Pack each cache's live tokens into its first blocks (in the lanes a policy
        acts on); blocks freed per cache."""
        lanes = self.policy_lanes if len(self.policy_lanes) < self.num_layers else None
        return compaction.compact(self.tables, self.pool, caches, lanes)

    def held_and_need(self, caches: list[SeqCache]) -> tuple[list[int], list[int]]:
        """Per cache, the blocks it holds and the blocks its next decode token takes (one
        read of the rows' sizes: `SlotTables.held_and_need`)."""
        return self.tables.held_and_need([c.row for c in caches])

    def start_ring(self, cache: SeqCache, sinks: int, cap: int) -> bool:
        """From the next decode token, `cache` keeps `sinks` + a window of `cap` in a ring
        (StreamingLLM's fixed-size cache; `SeqCache.start_ring`); whether it started."""
        return cache.start_ring(sinks, cap)

    def hold(self, cache: SeqCache, blocks: int) -> bool:
        """Link `blocks` per layer ahead of the cache's tokens (a ring's window);
        whether the pool had them (`SeqCache.hold`)."""
        return cache.hold(blocks)

    def take_overwritten(self, cache: SeqCache) -> int:
        """Tokens a ring overwrote since the last call (its evictions)."""
        return self.tables.take_overwritten(cache.row)

    def trim(self, cache: SeqCache, computed: int) -> int:
        """Drop what no later query of a cache with `computed` tokens in sees from its
        windowed lanes, freeing the pages left empty (`SeqCache.drop_before`)."""
        return cache.drop_before(trim_positions(self._window_t, computed))

    # ---- prefix cache --------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[torch.Tensor]:
        """Take a reference on the cached groups of the longest prefix of `hashes` a
        request can start from: with sliding-window lanes, the longest whose windows'
        pages are all there, taking none of those lanes' older pages (-1 there;
        kvpool/windows.py, vLLM's `SlidingWindowManager.find_longest_cache_hit`)."""
        if not self.prefix_caching:
            return []
        if self.min_window == NO_WINDOW:
            hits: list[torch.Tensor] = []
            for h in hashes:
                ids = self.pool.acquire(h)
                if ids is None:
                    break
                hits.append(ids)
            return hits
        groups = []
        for h in hashes:
            group = self.pool.groups.get(h)
            if group is None:
                break
            groups.append(group)
        k, bs = longest_hit(groups, self.windows, self.block_size), self.block_size
        first = [0 if w is None else first_needed(k, w, bs) for w in self.windows]
        taken = []
        for j, h in enumerate(hashes[:k]):
            ids = self.pool.acquire(h, frozenset(i for i, f in enumerate(first) if j < f))
            assert ids is not None
            taken.append(ids)
        return taken

    def publish(self, cache: SeqCache, hashes: list[int], start: int, end: int,
                computed: int) -> None:
        """Register prompt blocks start..end-1 of an `intact` cache of `computed` tokens
        (an evicted block is no one's prefix); a windowed lane's block its window has
        already dropped is -1 in its group."""
        if self.min_window == NO_WINDOW:
            for i in range(start, end):
                self.pool.register(hashes[i], cache.table[:, i])
            return
        # An intact lane holds positions from its first page's on, one a slot: the
        # pages before are those its window dropped.
        gone = (computed - torch.tensor(cache.next_slot)) // self.block_size
        for i in range(start, end):
            col = i - gone
            ids = cache.table.gather(1, col.clamp(min=0)[:, None])[:, 0]
            self.pool.register(hashes[i], ids.masked_fill(col < 0, -1))

    def drop(self, hits: list[torch.Tensor]) -> None:
        """Give back the references `lookup` took (the request does not start now)."""
        for ids in hits:
            self.pool.release(ids[ids >= 0])

    # ---- accounting ----------------------------------------------------------------
    def check_invariants(self, running: Iterable[SeqCache],
                         swapped: Iterable[SeqCache]) -> None:
        """Pool ref counts equal owners, nothing both free and owned, swap space exact."""
        self.pool.check_invariants(c.owned_blocks() for c in running)
        if self.swap is not None:
            held = sum(c._held().numel() for c in swapped)
            assert held == self.swap.num_used, "swap space accounting"
