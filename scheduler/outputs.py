"""What the engine core hands upward: per-request outputs and per-step statistics.

Plain dataclasses so the server (or the offline API) can turn them into HTTP
responses and Prometheus samples without the scheduler knowing about either.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # the token's rank in its distribution (1 = most likely); prompt only


@dataclass(slots=True)
class KVUsage:
    """This request's KV footprint, reported in `usage.kv_cache`."""

    peak_live_tokens: int = 0  # live slots summed over layers / num_layers, at the peak
    peak_blocks: int = 0  # blocks held (all layers) at the peak
    # slots evicted by its kv_policy, summed over the layers it acts on / their number
    # (the global ones on a model with sliding-window layers)
    evicted_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    peak_bytes: int = 0  # peak_blocks × the pool's bytes per block (scales included)
    # Over a per-head pool: live tokens of the (layer, kv head) holding the fewest and
    # the most when the request let its cache go (how unevenly its heads kept tokens).
    head_live_min: int = 0
    head_live_max: int = 0


@dataclass(slots=True)
class RequestOutput:
    """Delta since the previous output of the same request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # detokenized delta; text after a matched stop string is cut
    logprobs: list[TokenLogprob] | None  # one per new token when requested
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    kv: KVUsage | None = None  # set on the final output
    arrival_time: float = 0.0  # time.monotonic() at submission
    first_scheduled_time: float | None = None  # left the waiting queue
    first_token_time: float | None = None
    num_preemptions: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the
    # first, which nothing predicts), on the request's first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class StepStats:
    """One engine step, for histograms (seconds)."""

    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    policy_s: float = 0.0
    total_s: float = 0.0


@dataclass
class EngineStats:
    """A snapshot read at scrape time; counters are cumulative since start."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    live_slots: int = 0  # live token slots summed over layers
    slot_capacity_used: int = 0  # slots in used blocks (live + dead + not yet filled)
    kv_cache_dtype: str = ""  # the pool's: float32, bfloat16, ..., int8, fp8_e4m3, int4
    block_bytes: int = 0  # bytes of one block (K and V, one layer, scales included)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: dict[str, int] = field(default_factory=dict)  # by mode
    swap_bytes_total: dict[str, int] = field(default_factory=dict)  # "out" / "in"
    blocks_cached_free: int = 0  # free blocks still holding a reusable prefix
    tenant_blocks: dict[str, int] = field(default_factory=dict)  # blocks used per tenant
    prefix_cache_queries_total: int = 0  # tokens
    prefix_cache_hits_total: int = 0  # tokens
    requests_by_policy_total: dict[str, int] = field(default_factory=dict)
    evicted_tokens_by_policy_total: dict[str, int] = field(default_factory=dict)
    freed_blocks_by_policy_total: dict[str, int] = field(default_factory=dict)
    policy_seconds_total: dict[str, float] = field(default_factory=dict)  # eviction time

    # The cumulative fields (`blocks_total` is the pool's size, not a counter).
    COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "preemptions_total",
                "swap_bytes_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                "requests_by_policy_total", "evicted_tokens_by_policy_total",
                "freed_blocks_by_policy_total", "policy_seconds_total")

    def since(self, base: EngineStats) -> EngineStats:
        """These stats with `base`'s counters taken off: what happened after `base` was
        read. The server's warm-up runs requests through the engine before it is ready;
        they are no client's and must not show in the Prometheus counters."""
        diff = {}
        for name in self.COUNTERS:
            now, before = getattr(self, name), getattr(base, name)
            if isinstance(now, dict):
                diff[name] = {k: v - before.get(k, 0) for k, v in now.items()}
            else:
                diff[name] = now - before
        return replace(self, **diff)
