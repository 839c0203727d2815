"""Running the running requests' `kv_policy` after each step, and what it cost.

Why a module of its own: the engine step only needs "let every policy act on the slot
layout the forward saw"; how requests are grouped for their policies
(`kvpool/policy_rows.py`: one group per policy class, config and step size, a
request alone being a group of one), how a request is kept within its reservation, and the per-policy counters behind
`EngineStats` and the Prometheus metrics all live here. The offline perplexity
protocol (`benchmarks/policy_eval.py`) calls the same `run`, so it evicts exactly as
serving does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from attention.stats import AttentionMass
from kvpool.manager import KVCacheManager
from kvpool.policy_rows import Member, Rotate, group_key
from policies.base import StepView
from scheduler.request import Request
from scheduler.scheduler import Chunk


@dataclass
class PolicyRunner:
    kv: KVCacheManager  # the one door to memory: drops, compaction, rings
    num_layers: int
    rotate: Rotate  # re-rotates kept keys for `rope: "shift"` (the model's RoPE)
    batch: bool = True  # EngineConfig.batch_policies
    # Free blocks no one is owed (`Scheduler.spare_blocks`), asked only when a request
    # is about to outgrow its reservation; None: never borrow, always compact.
    spare: Callable[[], int] | None = None
    # Per policy name, cumulative since start (EngineStats' *_by_policy_total).
    requests: dict[str, int] = field(default_factory=dict)
    evicted_tokens: dict[str, int] = field(default_factory=dict)
    freed_blocks: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    _to_compact: list[Request] = field(default_factory=list)  # this step's, see _compact
    # this step's requests whose reservation `_check_reserves` looks at, with num_new
    _to_check: list[tuple[Request, int]] = field(default_factory=list)
    # Group keys by value -> one object of that value: members are grouped by the key's
    # id (a frozen `Needs` hashes every field on every lookup; 64 lookups a step showed).
    _keys: dict[tuple, tuple] = field(default_factory=dict)

    def admitted(self, name: str) -> None:
        self.requests[name] = self.requests.get(name, 0) + 1

    def acts(self, r: Request, c: Chunk) -> bool:
        """Whether r's policy will act after the step that computes chunk c (its `idle`
        says no), asked before the forward, from the same sizes `run` will see, by a
        statistic only acting requests should pay for: KeyDiff's scores in the decode
        kernel (a request within its budget would have them computed for nothing)."""
        idle = getattr(r.policy, "idle", None)
        if idle is None:
            return True
        n = r.num_computed + c.num_tokens  # as `run` sees it: counted before the forward
        assert r.cache is not None
        return not idle(_sizes(r, c, n, not r.prefill_done and n >= len(r.prompt_ids),
                               self._global(r.cache.layer_live)))

    def _global(self, live: list[int]) -> list[int]:
        """A cache's live slots per lane as its policy's `idle` reads them: 0 in the
        sliding-window lanes, which the policy leaves to their window."""
        if len(self.kv.policy_lanes) == len(live):
            return live
        return [n if w is None else 0 for n, w in zip(live, self.kv.windows)]

    def run(self, chunks: list[Chunk], attention: dict[int, AttentionMass]) -> None:
        """Let each running request's policy look at its cache and carry out its plan,
        requests of equal policies together (`kvpool/policy_rows.py`).
        `attention` maps a chunk's index to its attention mass (runner output).

        This runs for every request on every step, so its Python is kept to what
        changes between steps (issue 18: per-request bookkeeping was a third of a cheap
        policy's step): a request's group key is rebuilt only when its step size or its
        policy's `needs` changes, and time and counters are added once per group."""
        groups: dict[tuple[int, bool], list[tuple[Request, Member]]] = {}
        idle_s: dict[str, float] = {}
        for i, c in enumerate(chunks):
            r = c.request
            policy = r.policy
            cache = r.cache
            if policy is None or cache is None or r.ringing:  # full cache, finished, or
                continue  # a ring at its cap: nothing to drop, never a block more
            t = time.perf_counter()
            first_full = False
            if not r.prefill_done:
                first_full = r.prefill_done = r.num_computed >= len(r.prompt_ids)
            idle = getattr(policy, "idle", None)
            live = cache.layer_live  # read once: `idle` decides on it, the group's view reads it
            if r.ring is not None and not cache.ring:
                if min(live) >= r.ring[1]:
                    self.kv.start_ring(cache, *r.ring)  # from the next decode token (else: next step)
                elif first_full and r.reserve_blocks:  # the window's blocks, reserved: together
                    self.kv.hold(cache, -(-r.ring[1] // cache.bs))
            if idle is not None and idle(_sizes(r, c, r.num_computed, first_full,
                                                self._global(live))):
                self._note_reserve(r, c.num_tokens)
                name = r.policy_name
                idle_s[name] = idle_s.get(name, 0.0) + time.perf_counter() - t
                continue
            mass = attention.get(i)
            m = Member(cache, policy, r.num_computed, len(r.prompt_ids), c.num_tokens,
                       first_full, mass, self.rotate if r.rope_shift else None,
                       getattr(r.kv_policy, "compact", False), live)
            key = r.policy_group
            needs = policy.needs  # type: ignore[attr-defined]
            if key is None or key[2] != c.num_tokens or r.policy_needs is not needs:
                if r.policy_key is None:
                    r.policy_key = r.kv_policy.model_dump_json()  # type: ignore[attr-defined]
                key = group_key(policy, r.policy_key, c.num_tokens)
                if len(self._keys) > 4096:  # prefill chunk sizes vary: keep it bounded
                    self._keys.clear()
                key = r.policy_group = self._keys.setdefault(key, key)
                r.policy_needs = needs
            # apart: members whose statistics the kernel kept (a group is all or none)
            into = mass is not None and mass.accumulated
            groups.setdefault((id(key), into) if self.batch else (id(r), into), []).append((r, m))
        for name, sec in idle_s.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + sec
        for members in groups.values():
            t = time.perf_counter()
            if len(members) > 1:
                members.sort(key=lambda rm: rm[1].cache.row)  # consecutive rows read as slices
            done = self.kv.run_policy([m for _, m in members])
            name = members[0][0].policy_name  # one policy config per group
            evicted_tokens = freed_blocks = 0  # the group's, added to the counters once
            for (r, m), (evicted, freed) in zip(members, done):
                if evicted or freed:
                    if m.rotate is not None and evicted:
                        r.pos_offset = r.num_computed - r.cache.live // r.cache.num_layers
                    tokens = evicted // len(self.kv.policy_lanes)
                    r.kv.evicted_tokens += tokens
                    evicted_tokens += tokens
                    freed_blocks += freed
                self._note_reserve(r, m.num_new)
            self._count(name, evicted_tokens, freed_blocks)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        self._check_reserves()
        self._compact()

    def _count(self, name: str, evicted_tokens: int, freed_blocks: int) -> None:
        self.evicted_tokens[name] = self.evicted_tokens.get(name, 0) + evicted_tokens
        self.freed_blocks[name] = self.freed_blocks.get(name, 0) + freed_blocks

    def _note_reserve(self, r: Request, num_new: int) -> None:
        """Queue a request whose reservation may be near (`_check_reserves`, once the
        step's evictions are done). `num_new`: the tokens this step computed for it."""
        if r.reserve_blocks and r.num_computed >= r.reserve_ok_until:
            self._to_check.append((r, num_new))

    def _check_reserves(self) -> None:
        """Note the queued requests about to outgrow their reservation (`_compact`), with
        one read of their rows' sizes (`SlotTables.held_and_need`: at budget, most of a
        scattered-eviction policy's requests are checked every step). A decoding request
        (num_new 1: the next steps add at most a block per layer each) far from its
        reservation is not looked at again until it could be near
        (`Request.reserve_ok_until`)."""
        todo, self._to_check = self._to_check, []
        if not todo:
            return
        held, need = self.kv.held_and_need([r.cache for r, _ in todo])  # type: ignore[misc]
        nl = self.num_layers
        left: int | None = None  # spare blocks not yet lent this step, read on first need
        for (r, num_new), h, n in zip(todo, held, need):
            if h + nl > r.reserve_blocks:  # close: counted exactly
                if h + n > r.reserve_blocks:
                    # Borrow the spare instead of compacting, up to an eighth over the
                    # reservation. Why: a compaction moves every live token after the
                    # first hole, and a request at its budget needs one each time its
                    # slack (a block a layer) fills; with an eighth more it compacts
                    # several times less often (16 knorm requests of 1k tokens, 200
                    # steps: 95 compactions, 12.8 ms, against 14, 6.4 ms). The borrowed
                    # blocks come back at the first step with no spare (someone waits,
                    # or the pool is full): the request is then compacted as before.
                    if left is None:
                        left = self.spare() if self.spare is not None else 0
                    if left > 0 and n <= left and h + n <= r.reserve_blocks + r.reserve_blocks // 8:
                        left -= n
                    else:
                        self._to_compact.append(r)
            elif num_new == 1:
                r.reserve_ok_until = r.num_computed + (r.reserve_blocks - h) // nl

    def _compact(self) -> None:
        """Scattered survivors pin partly dead blocks: pack them, in place and for every
        noted request at once (`KVCacheManager.compact`), so each one's next token fits in
        the memory admission reserved for it (instead of preempting someone when every
        block is reserved)."""
        reqs, self._to_compact = self._to_compact, []
        if not reqs:
            return
        t = time.perf_counter()
        caches = [r.cache for r in reqs]
        freed = self.kv.compact(caches)  # type: ignore[arg-type]
        share = (time.perf_counter() - t) / len(reqs)
        for r, f in zip(reqs, freed):
            name = r.policy_name
            self.freed_blocks[name] = self.freed_blocks.get(name, 0) + f
            self.seconds[name] = self.seconds.get(name, 0.0) + share


def _sizes(r: Request, c: Chunk, seq_len: int, first_full: bool,
           lengths: list[int]) -> StepView:
    """The step in sizes only (`lengths`: the cache's live slots per layer, host ints):
    enough for `idle` to decide. Positional: seq_len, prompt_len, num_new, prefill_done,
    block_size, lengths."""
    cache = r.cache
    assert cache is not None
    return StepView(seq_len, len(r.prompt_ids), c.num_tokens, first_full, cache.bs, lengths)
