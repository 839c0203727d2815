"""A request's state as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.penalties import TokenHistory
from engine.sampling import SamplingParams
from kvpool.seq_cache import SeqCache
from scheduler.detokenizer import Detokenizer
from scheduler.outputs import KVUsage, TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    priority: int = 0
    kv_policy: object | None = None  # the validated config (policies.config)
    policy_name: str = "full"
    policy: object | None = None  # built from kv_policy; None for "full"
    rope_shift: bool = False  # kv_policy asked for rope: "shift"
    # (sink, cap) of its policy's ring (`KVCacheManager.ring`): its cache starts one once
    # a layer holds cap tokens (`PolicyRunner.run`).
    ring: tuple[int, int] | None = None
    # Its ring has written over a token: from then on every layer stays at exactly its
    # cap, so its policy has nothing to drop and its cache never grows (the policy runner
    # skips it). Reset when preempted by recompute.
    ringing: bool = False
    # The kv_policy as canonical JSON, set on its first policy step: requests with equal
    # keys share a policy group (a string hashes once; a pydantic model on every step).
    policy_key: str | None = None
    # Its policy group's key as of its last policy step (`PolicyRunner.run`: rebuilt
    # when the step size or the policy's `needs` changes, not built anew every step).
    policy_group: tuple | None = None
    # The policy's `needs` object that key was built from: requests of one config share
    # the key, whose own `needs` is the first one's (each policy has its own object).
    policy_needs: object | None = None
    # RoPE shift: positions inside the cache are re-numbered after eviction, so the
    # position given to the next token is num_computed - pos_offset.
    pos_offset: int = 0
    prefill_done: bool = False  # the last prompt token's K/V were computed
    tenant: str | None = None  # quota accounting (the API key's tenant)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache keys of the prompt
    # Blocks (all layers) a request whose policy bounds its cache may grow to once its
    # prompt is in; admission keeps them free for it. 0: unbounded (admitted on what it
    # needs now, as vLLM does; it preempts or is preempted when it grows).
    reserve_blocks: int = 0
    # `PolicyRunner._note_reserve` need not look again before num_computed reaches this:
    # decoding adds at most a block per layer a step, and the headroom was that many
    # steps' worth (reset when preempted by recompute).
    reserve_ok_until: int = 0
    # The most blocks (all layers) it can ever hold: prompt + max_tokens, or its policy's
    # peak. Once preempted, a request is reserved this much (MemoryConfig.reserve_preempted).
    peak_blocks: int = 0
    # Most tokens of one prefill chunk. A policy that evicts between prompt chunks
    # (streaming) gets chunks no longer than its bound, so its cache stays within twice
    # that from the first prompt token on (`KVCacheManager.prefill_chunk`).
    max_chunk: int = 2**62
    # Token ids that end it: its stop_token_ids, and the model's EOS unless ignore_eos.
    stop_ids: frozenset[int] = frozenset()
    registered: int = 0  # prompt blocks published to (or taken from) the prefix cache
    resume_mark: int = 0  # len(output_ids) when last resumed (thrash protection)
    output_ids: list[int] = field(default_factory=list)
    # Sampled tokens still on the device (async scheduling, EngineCore.step): counted in
    # `num_tokens`, so the next step is planned before they reach `output_ids`; the
    # row of the step whose sampled ids hold the newest one.
    pending_tokens: int = 0
    pending_row: int = 0
    # Tokens whose K/V are in the cache. Reset to 0 when preempted by recompute: the
    # prompt and the tokens generated so far are then prefilled again.
    num_computed: int = 0
    window_trimmed: int = 0  # sliding-window lanes: trimmed for this many tokens computed
    status: Status = Status.WAITING
    cache: SeqCache | None = None
    detok: Detokenizer | None = None
    # Its tokens as a repetition / frequency / presence penalty reads them (None: none)
    history: TokenHistory | None = None
    # Its grammar's matcher (engine/structured.py; None: unconstrained)
    matcher: object | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv: KVUsage = field(default_factory=KVUsage)
    # With params.prompt_logprobs: one entry per prompt token scored so far ([None] for
    # the first). It only grows: a recompute after preemption scores from where it is.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False  # handed upward with the first output

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt's positions
        must run through the model, so the prefix cache is not read."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

