"""How big the KV pool is when nobody says (`--num-blocks`, `--kv-cache-memory`): the rule,
as arithmetic over plain numbers, and what the start-up log and `/metrics` say about it.

The rule (docs/memory.md, "How big is the pool"), read once the weights are loaded:

    budget = fraction × available − reserve                    (CPU: host memory)
    budget = fraction × total − (total − free) − reserve      (CUDA: vLLM's form)
    blocks = min(budget // bytes per block, cap)

- **available**: on a CPU, `native.memory.available_bytes()`: MemAvailable, the cgroup's
  headroom, `KVSERVE_MEMORY_LIMIT`, whichever is smallest. On CUDA, the device's free
  bytes (`torch.cuda.mem_get_info`), and its total.
- **fraction**: `CPU_FRACTION` = 0.5 of what is available. The pool is host memory that
  is committed (zero-touched) at start-up and never given back, and the same memory
  must still hold what the estimate below does not see: the server's HTTP process (a
  second Python with torch, transformers and a tokenizer: ~350 MiB, more under load),
  glibc's arenas and oneDNN's per-shape state that the engine grows into once warm
  (docs/memory.md, "Process memory"), the page cache the weights are read through, and
  whatever else the machine runs (MemAvailable counts reclaimable cache that other
  processes may want back). Half leaves all of that room and still gives the pool the
  lion's share on a dedicated machine; a deployment that knows better passes
  `--kv-cache-memory`. `CUDA_FRACTION` = 0.9 of the device's total, less what is in use
  (the weights, the CUDA context, anybody else's): vLLM's `gpu_memory_utilization`.
- **reserve**: activations of the largest step, `activation_reserve`: the widest row of
  the model's forward (the MLP's fused gate and up projection, or q+k+v, or the hidden
  size) for every token of `max_num_batched_tokens`, in the model's dtype,
  `ACTIVATION_FACTOR` = 4 times (the residual, the normed input, a projection's output
  and the next one's live at once), or on a mixture-of-experts model what its sparse
  block holds where that is more (`moe_token_bytes`: every token runs `top_k` experts'
  rows), plus the sampled rows' fp32 logits and probabilities; on a CPU also the swap
  space (`--swap-space`, host memory) when preemption may swap.
- **cap**: `max_num_seqs` sequences of `max_model_len` tokens, every layer: the most the
  engine can ever fill. A bigger pool would only be zeroed and never used (a test's tiny
  model gets a tiny pool; the demo model 512 MiB).
- **too little**: fewer blocks than one sequence of `max_model_len` tokens needs is a
  start-up error (`KVPoolTooSmall`, naming `--kv-cache-memory`), as vLLM refuses a pool
  that cannot hold one request of the model's context.
"""

from __future__ import annotations

from dataclasses import dataclass

from native.memory import gib

CPU_FRACTION = 0.5
CUDA_FRACTION = 0.9
ACTIVATION_FACTOR = 4
SOURCES = ("auto", "kv_cache_memory", "num_blocks")  # what sized the pool
# native.memory's sources, for people (the log line and the error)
WHERE = {"MemAvailable": "/proc/meminfo MemAvailable",
         "cgroup_v2": "cgroup v2 memory.max − working set",
         "cgroup_v1": "cgroup v1 memory.limit_in_bytes − working set",
         "KVSERVE_MEMORY_LIMIT": "KVSERVE_MEMORY_LIMIT − resident memory"}


class KVPoolTooSmall(ValueError):
    """The memory left after the weights does not hold one request of the model's
    context: a start-up error (`kvserve serve` exits 2 with it)."""


@dataclass(frozen=True)
class AutoSize:
    num_blocks: int
    budget: int  # bytes the rule gives the pool before the cap
    capped: bool  # the cap, not the memory, decided


def auto_pool_blocks(available: int, bytes_per_block: int, cap_blocks: int, reserve: int,
                     fraction: float, *, total: int | None = None, min_blocks: int = 1,
                     where: str = "available", context: int | None = None,
                     reserved_for: str = "activations") -> AutoSize:
    """The rule above. `available`: bytes free after the weights; `total`: the device's
    size, for the CUDA form (None: the host form). `min_blocks`: one request's blocks
    (of `context` tokens), below which it raises KVPoolTooSmall (`where` names the
    memory in its message, `reserved_for` what the reserve holds)."""
    if bytes_per_block < 1 or fraction <= 0:
        raise ValueError("bytes_per_block and fraction must be positive")
    if total is None:
        budget = int(fraction * available) - reserve
        of = f"{fraction:.0%} of {gib(available)} {where}"
    else:
        budget = int(fraction * total) - (total - available) - reserve
        of = f"{fraction:.0%} of {gib(total)} {where}, {gib(total - available)} in use"
    fits = max(0, budget) // bytes_per_block
    blocks = min(fits, cap_blocks)
    if blocks < min_blocks:
        one = ("one request of the model's context" if context is None else
               f"one request of {context:,} tokens (the model's context, --max-model-len)")
        raise KVPoolTooSmall(
            f"too little memory for the KV pool: {of}, minus {gib(reserve)} for "
            f"{reserved_for}, leaves {gib(max(0, budget))}, and {one} needs "
            f"{gib(min_blocks * bytes_per_block)}. Pass --kv-cache-memory "
            "SIZE (or --num-blocks N) to size the pool yourself (requests longer than it "
            "holds are refused), lower --max-model-len, or give kvserve more memory")
    return AutoSize(blocks, budget, fits > cap_blocks)


def activation_reserve(batched_tokens: int, widest_row: int, itemsize: int,
                       sampled_rows: int, vocab_size: int,
                       factor: int = ACTIVATION_FACTOR, token_bytes: int = 0) -> int:
    """Bytes the largest step's activations take: `factor` rows of `widest_row` elements
    for each of `batched_tokens` (or `token_bytes` a token where that is more: a sparse
    block's, `moe_token_bytes`), plus fp32 logits and probabilities of `sampled_rows`."""
    per_token = max(factor * widest_row * itemsize, token_bytes)
    return batched_tokens * per_token + 2 * sampled_rows * vocab_size * 4


def moe_token_bytes(hidden: int, intermediate: int, top_k: int, itemsize: int) -> int:
    """Bytes a token's activations take through a sparse mixture-of-experts block, whose
    grouped GEMMs run `top_k` rows a token (engine/models/moe.py, `Experts.forward`).
    Each (token, expert) pair holds its sorted copy of the input (hidden), gate and up's
    output (2 × intermediate), the activation and its temporaries or a biased copy of
    gate and up (2 × intermediate), down's output (hidden) in the model's dtype and its
    fp32 copy; each token the fp32 sum of its experts and its cast back, beside the
    residual stream and the normed input (hidden each). The sum of them all: each lives
    for part of the block only, so this is an upper bound, as ACTIVATION_FACTOR is."""
    pair = (2 * hidden + 4 * intermediate) * itemsize + 4 * hidden
    return top_k * pair + 4 * hidden + 3 * hidden * itemsize


def blocks_for(seqs: int, tokens: int, block_size: int, num_layers: int) -> int:
    """Blocks `seqs` sequences of `tokens` hold with every layer full (the cap, and with
    one sequence the minimum)."""
    return seqs * -(-tokens // block_size) * num_layers


@dataclass(frozen=True)
class KVSizing:
    """What sized the pool and why: the start-up log line and `/metrics` read it."""

    source: str  # one of SOURCES
    num_blocks: int
    block_bytes: int
    # tokens it holds with every layer whole: num_blocks × block_size / layers (with
    # sliding-window layers kept to their windows it holds more: `requests`)
    tokens: int
    why: str  # e.g. "auto: 50% of 12.4 GiB available after the weights, ..."
    available: int = 0  # auto: the bytes seen after the weights
    available_source: str = ""  # auto: which limit (native.memory's names, or "cuda")
    context: int = 0  # a request's tokens that `requests` counts (max_model_len)
    # requests of `context` tokens it holds at once, each windowed lane at its window and a
    # prefill chunk (vLLM's "maximum concurrency"), and the longest one (<= `context`)
    requests: int = 0
    longest: int = 0
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None: global
    hybrid: bool = True  # windowed layers keep their windows' pages (else held whole)
    block_lanes: int = 0  # lanes one of vLLM's blocks spans (vllm:cache_config_info)

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        """The start-up line: on a model with sliding-window layers kept to their windows,
        what it holds in requests of the context, as every layer whole understates it."""
        head = f"KV pool: {gib(self.bytes)} ({self.why}) = {self.num_blocks:,} blocks"
        sliding = [w for w in self.windows if w is not None]
        if not sliding:
            return f"{head} = {self.tokens:,} tokens"
        if not self.hybrid:
            return (f"{head} = {self.tokens:,} tokens (hybrid KV cache off: its "
                    f"{len(sliding)} sliding-window layers are kept whole)")
        held = (f"{self.requests:,} request{'s' * (self.requests != 1)} of "
                f"{self.context:,} tokens at once" if self.requests else
                f"one request of up to {self.longest:,} tokens")
        spans = "/".join(f"{w:,}" for w in sorted(set(sliding)))
        glob = len(self.windows) - len(sliding)
        layers = (f"its {glob} global layer{'s' * (glob != 1)} holding each one's context, "
                  f"its {len(sliding)} sliding-window layers only their window ({spans} "
                  "tokens)" if glob else f"all {len(sliding)} layers sliding-window, each "
                  f"holding only its window ({spans} tokens)")
        return f"{head} = {held} ({layers}); {self.tokens:,} tokens with every layer whole"
