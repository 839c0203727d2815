"""The synchronous engine: model + pool + scheduler, advanced one step at a time.

Here: building it from an `EngineConfig` (scheduler/engine_config.py), requests in and
out, the step (whether it may overlap the one in flight) and the statistics. A step is
launched by `StepLaunch` (scheduler/step_launch.py) and completed by `StepComplete`
(scheduler/step_complete.py), whose methods `EngineCore` takes.

Not thread-safe by design: the async front end calls every method from one worker
thread, between steps; the offline `LLM` calls them from the caller's thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import AutoTokenizer

from attention.select import select_attention
from attention.storage import KVStorage
from attention.swap import SwapSpace
from engine.cpu_memory import keep_freed_memory
from engine.expert_choice import choose_kernels
from engine.generation_defaults import load_sampling_defaults
from engine.linear_choice import LinearChoice
from engine.loader import load_model
from engine.penalties import TokenHistory
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.structured import Grammars
from kvpool.manager import KVCacheManager
from kvpool.pool import BlockPool
from native.memory import parse_bytes
from policies.catalog import build_policy
from policies.config import KVPolicyConfig
from scheduler.detokenizer import Detokenizer
from scheduler.engine_config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from scheduler.head_roles import load_roles, roles_path
from scheduler.inflight import HostIds, Launch
from scheduler.limits import fit_shifted_positions, shifts_rope
from scheduler.outputs import (
    EngineStats,
    RequestOutput,
    RequestRejected,
    StepStats,
)
from scheduler.policy_runner import PolicyRunner
from scheduler.pool_shape import (
    heads_per_page,
    num_lanes,
    page_tokens,
    reserve_slack,
    size_kv_pool,
    windows_of,
)
from scheduler.preemption import MODES, calibrate
from scheduler.prefix import block_hashes
from scheduler.request import Request
from scheduler.resolve import ModelLimits
from scheduler.scheduler import MemoryConfig, Scheduler
from scheduler.step_complete import StepComplete
from scheduler.step_launch import NO_NEEDS, StepLaunch

logger = logging.getLogger("kvserve.engine")


class EngineCore(StepLaunch, StepComplete):
    def __init__(self, config: EngineConfig,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.config = config
        self.on_step = on_step
        dev = config.device
        self.device = torch.device("cuda" if dev == "auto" and torch.cuda.is_available()
                                   else ("cpu" if dev == "auto" else dev))
        for name, known in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES[1:])):
            value = getattr(config, name)
            if value != "auto" and value not in known:
                raise ValueError(f"unknown {name} {value!r}; use auto or one of {sorted(known)}")
        dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
        # The served context reaches the model: Phi-3's longrope picks its factor set by it.
        self.model, self.model_config = load_model(config.model, dtype=dtype, device=str(self.device),
                                                   max_model_len=config.max_model_len)
        # each linear layer shape's layout (panels, oneDNN, dense) and each MoE stacked
        # projection's kernel (panels, grouped mm), timed on this CPU or cached
        # (engine/linear_choice.py, engine/expert_choice.py)
        self.linear_choices: list[LinearChoice] = []
        if self.device.type == "cpu" and config.cpu_prepack:
            self.linear_choices = choose_kernels(self.model, config.cpu_kernels,
                                                 config.max_num_seqs,
                                                 config.max_num_batched_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # The pool may be narrower than the model (vLLM's --kv-cache-dtype): K/V are
        # rounded once when written and widened to fp32 inside attention, so decode reads
        # half the bytes of an fp32 pool. A quantized format (int8, fp8_e4m3, int4) is
        # passed by name: codes plus scales, dequantized inside attention (attention/quant.py).
        kv_dtype: torch.dtype | str = (
            next(self.model.parameters()).dtype if config.kv_cache_dtype == "auto"
            else DTYPES.get(config.kv_cache_dtype, config.kv_cache_dtype))
        # The tokens a page holds (pool_shape.page_tokens), fixed from here on.
        self.config = config = replace(config, block_size=page_tokens(config, mc, kv_dtype))
        # The pool's size: --num-blocks, else --kv-cache-memory, else what the memory
        # left after the weights allows (attention/sizing.py's rule); logged with why.
        self.kv_sizing = size_kv_pool(config, mc, self.device, self.max_model_len, kv_dtype,
                                      next(self.model.parameters()).dtype.itemsize)
        logger.info(self.kv_sizing.describe(), extra={"fields": {
            "kv_sizing": self.kv_sizing.source, "kv_cache_bytes": self.kv_sizing.bytes,
            "kv_blocks": self.kv_sizing.num_blocks, "kv_tokens": self.kv_sizing.tokens,
            "kv_requests": self.kv_sizing.requests,
            "available_bytes": self.kv_sizing.available,
            "available_source": self.kv_sizing.available_source,
            "hybrid_kv_cache": config.hybrid_kv_cache}})
        num_blocks = self.kv_sizing.num_blocks
        # Decode steps replay CUDA graphs (engine/cuda_graphs.py) where every position
        # is in the rotary table (a graph cannot check); their padded rows write the
        # pool's scratch block.
        # Not yet over a per-head pool: the graphs' static tables are one row a sequence.
        graphs = (self.device.type == "cuda" and not config.enforce_eager
                  and config.kv_layout == "layer"
                  and self.max_model_len <= self.model.rotary.cos_table.shape[0])
        # The runner owns the KV tensors; the pool (metadata) hands out the ids that index them.
        self.storage = KVStorage(num_blocks, config.block_size, heads_per_page(config, mc),
                                 mc.head_dim, dtype=kv_dtype, device=self.device,
                                 scratch=graphs)
        self.pool = BlockPool(num_blocks, config.block_size, storage=self.storage)
        self.runner = ModelRunner(self.model, mc, self.storage, select_attention(self.device),
                                  self.device)
        if graphs:
            from engine.cuda_graphs import DecodeGraphs  # imports Triton: CUDA only

            self.runner.graphs = DecodeGraphs(self.runner, config.max_num_seqs,
                                              self.max_model_len)
        if config.preemption_mode not in MODES:
            raise ValueError(f"preemption_mode must be one of {MODES}")
        if not 0 <= config.watermark < 1:
            raise ValueError("watermark must be in [0, 1)")
        if config.min_prefill_chunk < 1:
            raise ValueError("min_prefill_chunk must be >= 1")
        quotas = config.tenant_quotas or {}
        if any(q <= 0 for q in quotas.values()) or sum(quotas.values()) > 1:
            raise ValueError("tenant quotas must be positive fractions summing to at most 1")
        self.swap = None
        cost = None
        if config.preemption_mode != "recompute":
            blocks = max(1, parse_bytes(config.swap_space) // self.storage.block_bytes)
            self.swap = SwapSpace(self.storage, blocks)
        # The tables' lanes: one a layer, or one a (layer, kv head) in a per-head pool;
        # below the engine core, memory counts lanes where it counted layers.
        lanes = num_lanes(config, mc)
        # DuoAttention's head roles, saved beside the model by `kvserve head-roles`
        roles = (load_roles(config.model, mc.num_layers, mc.num_kv_heads)
                 if lanes > mc.num_layers else None)
        if roles is not None:
            logger.info("kv head roles", extra={"fields": {"path": str(roles_path(config.model))}})
        self.kv = KVCacheManager(self.pool, lanes, watermark=config.watermark,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 swap=self.swap, rows=min(config.max_num_seqs, 16),
                                 min_prefill_chunk=config.min_prefill_chunk,
                                 heads=lanes // mc.num_layers, head_roles=roles,
                                 slack_tokens=reserve_slack(config, mc),
                                 windows=windows_of(config, mc))
        if config.preemption_mode == "auto":
            cost = calibrate(self.runner, self.kv)
        self.cost_model = cost
        memory = MemoryConfig(config.preemption_mode, dict(quotas), config.reserve_preempted)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs,
                                   config.max_num_batched_tokens, memory, cost)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._eos = set(mc.eos_token_ids)
        windowed = any(w is not None for w in mc.sliding_windows)
        # the windows its lanes are trimmed to (hybrid memory: StepComplete._trim_windows)
        self._windows = sorted({w for w in self.kv.windows if w is not None})
        # a ring writes over slots that windows and positions are read from
        self.kv.rings = config.streaming_ring and not windowed
        self._prompt_tokens = 0
        self._generation_tokens = 0
        # Requests here whose rows need sampling parameters (a temperature, logprobs):
        # while there are none, a step builds no parameter lists at all.
        self._sampling = 0
        self._shaped = 0  # of them, requests with a logit bias, a penalty or a grammar
        self._grammars: Grammars | None = None  # made on the first structured request
        # What resolving a request needs of this model (scheduler/resolve.py): the
        # default policy parsed and resolved here, once; the longest default max_tokens.
        pool_tokens = self.kv.tokens_within(self.kv.num_blocks, config.max_num_batched_tokens,
                                            self.max_model_len)
        self.limits = ModelLimits.of(
            self.max_model_len, pool_tokens if self.kv.num_blocks else self.max_model_len,
            config.default_kv_policy, per_head=lanes > mc.num_layers, lanes=lanes,
            head_roles=roles is not None, sliding_windows=windowed,
            policy_local_rope=not self._windows and getattr(self.model, "rotary_local", None)
            is not None,
            sampling_defaults=load_sampling_defaults(config.model, config.generation_config))
        self.policies = PolicyRunner(self.kv, lanes, self._rotate,
                                     config.batch_policies, spare=self.scheduler.spare_blocks)
        self._pending: Launch | None = None  # a step in flight (async scheduling)
        self._host_ids = HostIds(config.max_num_seqs)  # its ids' pinned buffers
        self.overlapped_steps = 0  # steps launched while the one before them ran
        if self.device.type == "cpu":  # after the weights and the pool: steps' buffers stay
            keep_freed_memory()

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, kv_policy: KVPolicyConfig | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    tenant: str | None = None) -> None:
        """Queue a request as `scheduler/resolve.py` resolved it: `kv_policy` the config
        `resolve_request` made for this model (None: the engine's default) and
        `params.max_tokens` fitted to the context; neither is parsed or fitted again.
        Raises RequestRejected for what only the engine knows (the vocabulary, the KV
        pool, a grammar), TypeError for a policy that is not a resolved config."""
        if request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request_id!r}", "request_id")
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        if any(t < 0 or t >= self.model_config.vocab_size for t in prompt_ids):
            raise RequestRejected("prompt token id out of the vocabulary range", "prompt")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestRejected("logit_bias token id out of the vocabulary range", "logit_bias")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise RequestRejected("allowed_token_ids out of the vocabulary range",
                                  "allowed_token_ids")
        config = self.limits.default_kv_policy if kv_policy is None else kv_policy
        if not isinstance(config, KVPolicyConfig) or not config.context_resolved:
            raise TypeError(f"kv_policy must be a config resolved for the model by "
                            f"scheduler.resolve.resolve_request, not {kv_policy!r}")
        # A policy acts on the global lanes (kvpool/windows.py); with none, it has nothing
        # to bound and the request runs as full, its windows bounding it.
        policy = build_policy(config) if config.name != "full" and self.kv.policy_lanes else None
        if policy is not None and self.limits.per_head and getattr(
                config, "heads_mode", lambda _: "")(True) == "shared":
            # One set a layer over a per-head pool: the bridge sums the lanes' mass into
            # the layer's (kvpool/head_stats.py), so the kernel must not add a lane's own
            # into its state (it would give each lane of the layer its own head's).
            policy.needs = replace(policy.needs, accumulate=None, ring=None)
        rope_shift = shifts_rope(config)
        # max_tokens 0 (scoring) still holds every prompt token: count it like 1 (the
        # last sampled token is never fed back, so it needs no slot).
        total = len(prompt_ids) + max(params.max_tokens, 1)
        bs = self.kv.block_size
        chunk = self.kv.prefill_chunk(policy, len(prompt_ids), self.config.max_num_batched_tokens)
        if rope_shift and policy is not None:
            chunk = fit_shifted_positions(policy.max_live(total, len(prompt_ids), bs), chunk,
                                          len(prompt_ids), total, self.max_model_len, bs)
        reserve, need = self.kv.reservation(policy, len(prompt_ids), total, chunk)
        usable = self.kv.num_blocks - self.kv.watermark_blocks
        prompt_blocks = self.kv.blocks_for(len(prompt_ids), chunk)
        if prompt_blocks > usable and policy is None:
            raise RequestRejected(
                f"the prompt alone needs {prompt_blocks} KV blocks; "
                f"only {usable} can ever be admitted (pool minus watermark reserve)", "prompt")
        if need > self.kv.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {need} KV blocks but the pool holds only "
                f"{self.kv.num_blocks}; lower max_tokens or start with more KV memory",
                "max_tokens")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        req = Request(request_id, list(prompt_ids), params, seed,
                      arrival_time if arrival_time is not None else time.monotonic(),
                      priority=priority, kv_policy=config, policy_name=config.name,
                      policy=policy, rope_shift=rope_shift, ring=self.kv.ring(policy),
                      tenant=tenant,
                      block_hashes=block_hashes(prompt_ids, bs, cache_salt),
                      reserve_blocks=reserve, peak_blocks=need, max_chunk=chunk,
                      stop_ids=frozenset(params.stop_token_ids).union(
                          () if params.ignore_eos else self._eos))
        if params.detokenize:
            req.detok = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                    params.include_stop_str_in_output)
        if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
            req.history = TokenHistory.of(req.prompt_ids)
        if params.structured is not None:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, vocab)
            try:
                req.matcher = self._grammars.matcher(params.structured)
            except ValueError as e:
                raise RequestRejected(str(e), params.structured.param) from None
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token: nothing predicts it
        self.requests[request_id] = req
        self._sampling += _needs_params(params)
        self._shaped += params.shapes_logits
        self.scheduler.add(req)
        self.policies.admitted(config.name)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._forget(req)
            self.scheduler.remove(req)

    def _forget(self, r: Request) -> None:
        del self.requests[r.request_id]
        self._sampling -= _needs_params(r.params)
        self._shaped -= r.params.shapes_logits

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, compute and advance one step; the outputs of the step it completed.

        Async scheduling (EngineConfig.async_scheduling, vLLM's --async-scheduling): a
        CUDA-graph decode step of plain requests is left in flight, its sampled ids on
        the device, and the next call plans and launches the step after it (whose input
        ids the graph takes from those on the device) before it waits for them, so the
        host's planning, staging and bookkeeping overlap the GPU's forward instead of
        following it. Such a call returns the previous step's outputs (the first one
        none). Only steps whose plan cannot depend on those tokens overlap
        (`_overlaps`): nobody waits or is swapped out, no request can finish on its
        length or wants logprobs, no kv_policy reads the forward's statistics (one that
        decides from sizes and positions alone, the streaming family, acts before the
        next plan, as it would after the tokens), and the pool holds a block per layer
        for everyone. A request that stops on a token of the step in flight had the next
        one computed for nothing, and dropped (as vLLM does)."""
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        if pending is not None:
            if not self._overlaps():
                return self._complete(pending, t0)
            # Its requests' policies act now, on the slot layout its forward saw, as they
            # would after its tokens: they read sizes and positions, not the tokens, and
            # the next plan must see their evictions. (A request about to stop has slots
            # evicted that its release frees anyway.)
            self._trim_windows(pending.plan.chunks)
            self.policies.run(pending.plan.chunks, pending.out.attention)
            t1 = time.perf_counter()
            pending.policy_s, pending.policies_ran = t1 - t0, True
            launch = self._launch(self.scheduler.schedule(), t1, pending)
            assert launch is not None and launch.out.graph, "an overlapped step is a graph's"
            self.overlapped_steps += 1
            outputs = self._complete(pending, time.perf_counter())
            self._pending = launch
            return outputs
        launch = self._launch(self.scheduler.schedule(), t0)
        if launch is None:
            return []
        if launch.host is not None:  # left in flight: the next call completes it
            self._pending = launch
            return []
        return self._complete(launch, time.perf_counter())

    def _overlaps(self) -> bool:
        """Whether the next step can be planned before the step in flight's tokens are
        known: the plan will be every running request's next decode token in a graph,
        with no admission, preemption or finish on length among them."""
        s, graphs = self.scheduler, self.runner.graphs
        running = s.running
        if (s.waiting or s.swapped or not running or graphs is None or self._shaped
                or self.kv.num_free < self.kv.num_layers * len(running)
                or graphs.bucket(len(running)) is None):
            return False
        top = 0
        for r in running:
            if (r.pending_tokens != 1 or r.params.logprobs is not None
                    or len(r.output_ids) + 1 >= r.params.max_tokens
                    or (r.policy is not None and r.policy.needs != NO_NEEDS)):  # type: ignore[attr-defined]
                return False
            top = max(top, r.num_computed)
        return graphs.fits(top + 1)

    def _rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.rotary.rotate(keys, delta, scaled=False)

    # ---- introspection -------------------------------------------------------------
    def stats(self) -> EngineStats:
        running = self.scheduler.running
        live = sum(r.cache.live for r in running if r.cache is not None)
        pool = self.pool
        return EngineStats(
            num_running=len(running), num_waiting=len(self.scheduler.waiting),
            blocks_total=pool.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
            live_slots=live, slot_capacity_used=pool.num_used * pool.block_size,
            kv_cache_dtype=self.storage.dtype_name, block_bytes=self.storage.block_bytes,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_swapped=len(self.scheduler.swapped),
            preemptions_total=dict(self.scheduler.preemptions),
            swap_bytes_total={"out": self.swap.bytes_out if self.swap else 0,
                              "in": self.swap.bytes_in if self.swap else 0},
            blocks_cached_free=pool.num_cached_free,
            prefix_cache_queries_total=self.scheduler.prefix_queries,
            prefix_cache_hits_total=self.scheduler.prefix_hits,
            tenant_blocks=self.scheduler.tenant_blocks(),
            requests_by_policy_total=dict(self.policies.requests),
            evicted_tokens_by_policy_total=_added(self.policies.evicted_tokens,
                                                  self.scheduler.ring_evicted),
            freed_blocks_by_policy_total=dict(self.policies.freed_blocks),
            policy_seconds_total=dict(self.policies.seconds))

    def check_invariants(self) -> None:
        """Pool ref counts equal owners, nothing both free and owned, swap space exact."""
        sched = self.scheduler
        self.kv.check_invariants([r.cache for r in sched.running if r.cache is not None],
                                 [r.cache for r in sched.swapped if r.cache is not None])


def _needs_params(p: SamplingParams) -> bool:
    """Whether a request's sampled rows need a `SamplingBatch` built from parameters (or
    their logits changed first: a greedy step's LM head then may not take the argmax)."""
    return p.temperature != 0.0 or p.logprobs is not None or p.shapes_logits


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two per-policy counters as one (a new dict)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
