"""The synchronous engine: model + pool + scheduler, advanced one step at a time.

Not thread-safe by design: the async front end calls every method from one worker
thread, between steps; the offline `LLM` calls them from the caller's thread.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from engine.cpu_linear import pack_linears
from engine.cpu_memory import keep_freed_memory
from engine.loader import load_model
from engine.penalties import Penalties, TokenHistory, apply_penalties
from engine.runner import ModelRunner, PromptScoring, SeqInput
from engine.sampler import SamplingBatch, TokenScores, sample, to_host, top_logprobs
from engine.sampling import SamplingParams
from engine.structured import Grammars
from kvpool.attention_select import select_attention
from kvpool.manager import MIN_PREFILL_CHUNK, KVCacheManager
from kvpool.pool import BlockPool, parse_bytes
from kvpool.quant import FORMATS
from kvpool.swap import SwapSpace
from policies.base import Needs
from policies.catalog import build_policy
from policies.config import KVPolicyConfig
from scheduler.detokenizer import Detokenizer
from scheduler.inflight import HostIds, Launch
from scheduler.limits import fit_shifted_positions, shifts_rope
from scheduler.outputs import (
    EngineStats,
    KVUsage,
    RequestOutput,
    RequestRejected,
    StepStats,
    TokenLogprob,
)
from scheduler.policy_runner import PolicyRunner
from scheduler.preemption import MODES, calibrate
from scheduler.prefix import block_hashes
from scheduler.request import Request, Status
from scheduler.resolve import ModelLimits
from scheduler.scheduler import Chunk, MemoryConfig, Plan, Scheduler

_NO_NEEDS = Needs()  # a request without a policy asks the runner for nothing
_ALL_GREEDY = SamplingBatch.greedy()  # read only
_PLACEHOLDER = [0]  # a decode input whose id is on the device (read only)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
KV_CACHE_DTYPES = ("auto", *_DTYPES, *FORMATS)  # what --kv-cache-dtype accepts


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto = the checkpoint's dtype
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; narrower halves K/V bytes
    device: str = "auto"  # auto = cuda when available
    block_size: int = 16
    num_blocks: int | None = None  # wins over kv_cache_memory
    kv_cache_memory: str | int | None = None  # bytes for the pool, e.g. "2GiB"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Shortest prefill chunk of a prompt whose policy bounds it (kvpool/manager.py
    # `prefill_chunk`): longer chunks prefill faster and let scoring policies rank more
    # of the prompt at once, for more memory per request.
    min_prefill_chunk: int = MIN_PREFILL_CHUNK
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0  # seeds drawn for requests that give none
    default_kv_policy: str = "full"  # for requests that name none
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests
    preemption_mode: str = "recompute"  # swap | recompute | auto
    # A preempted request comes back only once its growth to max_tokens fits, so it is
    # preempted at most once (False: vLLM's behaviour, back on what it needs now).
    reserve_preempted: bool = True
    swap_space: str | int = "1GiB"  # host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    tenant_quotas: dict[str, float] | None = None  # tenant -> fraction of the pool
    # A step's requests of equal policies run as one group (scheduler/policy_rows.py);
    # False: every request a group of one (the same plans).
    batch_policies: bool = True
    # StreamingLLM at its window writes each decode token over its oldest past the sinks
    # (kvpool/tables.py's ring): exactly its window's blocks, the paper's cache; False
    # appends and evicts after the step (a block more a layer while it runs).
    streaming_ring: bool = True
    # On a CPU, linear layers run on oneDNN-prepacked weights (engine/cpu_linear.py);
    # False keeps torch's dense F.linear (for comparison).
    cpu_prepack: bool = True
    # On CUDA, decode steps replay CUDA graphs (engine/cuda_graphs.py); True runs them
    # eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # With CUDA graphs, plan and launch a decode step while the one before it runs on the
    # GPU (`EngineCore.step`; vLLM's --async-scheduling); False waits for every step's
    # tokens before planning the next.
    async_scheduling: bool = True

    DEFAULT_KV_MEMORY = "512MiB"


class EngineCore:
    def __init__(self, config: EngineConfig,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.config = config
        self.on_step = on_step
        dev = config.device
        self.device = torch.device("cuda" if dev == "auto" and torch.cuda.is_available()
                                   else ("cpu" if dev == "auto" else dev))
        for name, known in (("dtype", _DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES[1:])):
            value = getattr(config, name)
            if value != "auto" and value not in known:
                raise ValueError(f"unknown {name} {value!r}; use auto or one of {sorted(known)}")
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.model, self.model_config = load_model(config.model, dtype=dtype, device=str(self.device))
        if self.device.type == "cpu" and config.cpu_prepack:
            pack_linears(self.model)  # oneDNN's layout for every weight: faster GEMMs
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # The pool may be narrower than the model (vLLM's --kv-cache-dtype): K/V are
        # rounded once when written and widened to fp32 inside attention, so decode reads
        # half the bytes of an fp32 pool. A quantized format (int8, fp8_e4m3, int4) is
        # passed by name: codes plus scales, dequantized inside attention (kvpool/quant.py).
        kv_dtype: torch.dtype | str = (
            next(self.model.parameters()).dtype if config.kv_cache_dtype == "auto"
            else _DTYPES.get(config.kv_cache_dtype, config.kv_cache_dtype))
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            per_block = BlockPool.bytes_per_block(config.block_size, mc.num_kv_heads,
                                                  mc.head_dim, kv_dtype)
            mem = parse_bytes(config.kv_cache_memory or EngineConfig.DEFAULT_KV_MEMORY)
            num_blocks = mem // per_block
        # Decode steps replay CUDA graphs (engine/cuda_graphs.py) where every position
        # is in the rotary table (a graph cannot check); their padded rows write the
        # pool's scratch block.
        graphs = (self.device.type == "cuda" and not config.enforce_eager
                  and self.max_model_len <= self.model.rotary.cos_table.shape[0])
        self.pool = BlockPool(num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                              dtype=kv_dtype, device=self.device, scratch=graphs)
        self.runner = ModelRunner(self.model, mc, self.pool, select_attention(self.device),
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
            blocks = max(1, parse_bytes(config.swap_space) // self.pool.block_bytes)
            self.swap = SwapSpace(self.pool, blocks)
            if config.preemption_mode == "auto":
                cost = calibrate(self.runner, self.pool, self.swap, mc.num_layers)
        self.cost_model = cost
        self.kv = KVCacheManager(self.pool, mc.num_layers, watermark=config.watermark,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 swap=self.swap, rows=min(config.max_num_seqs, 16),
                                 min_prefill_chunk=config.min_prefill_chunk)
        memory = MemoryConfig(config.preemption_mode, dict(quotas), config.reserve_preempted)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs,
                                   config.max_num_batched_tokens, memory, cost)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._eos = set(mc.eos_token_ids)
        windows = [w for w in mc.sliding_windows if w is not None]
        self._min_window = min(windows) if windows else 2**62  # effectively never trims
        self.kv.rings = config.streaming_ring and not windows
        self._prompt_tokens = 0
        self._generation_tokens = 0
        # Requests here whose rows need sampling parameters (a temperature, logprobs):
        # while there are none, a step builds no parameter lists at all.
        self._sampling = 0
        self._shaped = 0  # of them, requests with a logit bias, a penalty or a grammar
        self._grammars: Grammars | None = None  # made on the first structured request
        # What resolving a request needs of this model (scheduler/resolve.py): the
        # default policy parsed and resolved here, once; the longest default max_tokens.
        pool_tokens = self.pool.num_blocks // mc.num_layers * config.block_size
        self.limits = ModelLimits.of(
            self.max_model_len,
            min(self.max_model_len, pool_tokens) if self.pool.num_blocks else self.max_model_len,
            config.default_kv_policy)
        self.policies = PolicyRunner(mc.num_layers, self._rotate, config.batch_policies,
                                     spare=self.scheduler.spare_blocks)
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
        policy = build_policy(config) if config.name != "full" else None
        rope_shift = shifts_rope(config)
        # max_tokens 0 (scoring) still holds every prompt token: count it like 1 (the
        # last sampled token is never fed back, so it needs no slot).
        total = len(prompt_ids) + max(params.max_tokens, 1)
        bs = self.pool.block_size
        chunk = self.kv.prefill_chunk(policy, len(prompt_ids), self.config.max_num_batched_tokens)
        if rope_shift and policy is not None:
            chunk = fit_shifted_positions(policy.max_live(total, len(prompt_ids), bs), chunk,
                                          len(prompt_ids), total, self.max_model_len, bs)
        reserve, need = self.kv.reservation(policy, len(prompt_ids), total, chunk)
        usable = self.pool.num_blocks - self.kv.watermark_blocks
        prompt_blocks = self.kv.blocks_for(len(prompt_ids))
        if prompt_blocks > usable and policy is None:
            raise RequestRejected(
                f"the prompt alone needs {prompt_blocks} KV blocks; "
                f"only {usable} can ever be admitted (pool minus watermark reserve)", "prompt")
        if need > self.pool.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {need} KV blocks but the pool holds only "
                f"{self.pool.num_blocks}; lower max_tokens or start with more KV memory",
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
                or self.pool.num_free < self.model_config.num_layers * len(running)
                or graphs.bucket(len(running)) is None):
            return False
        top = 0
        for r in running:
            if (r.pending_tokens != 1 or r.params.logprobs is not None
                    or len(r.output_ids) + 1 >= r.params.max_tokens
                    or (r.policy is not None and r.policy.needs != _NO_NEEDS)):  # type: ignore[attr-defined]
                return False
            top = max(top, r.num_computed)
        return graphs.fits(top + 1)

    def _launch(self, plan: Plan, t0: float, after: Launch | None = None) -> Launch | None:
        """Build the plan's inputs, run the forward and sample, on the device. `after`:
        the step in flight whose sampled ids are this step's input ids (every chunk is
        then one of its requests' decode token)."""
        if not plan.chunks:
            return None
        now = time.monotonic()
        inputs: list[SeqInput] = []
        done: list[Chunk] = []  # chunks that reach the end of their known tokens: sampled
        scored: list[Request] = []  # ... of scoring requests (max_tokens 0): finish now
        params: list[SamplingParams] = []
        seeds: list[int] = []
        steps: list[int] = []
        n_dec = n_pre = 0
        # every request may leave its tokens in flight (none shapes its logits from its
        # output so far, which must then be known)
        plain = self.config.async_scheduling and not self._shaped
        sampling = self._sampling
        # One pass, its fields read once: at 64 decoding every per-request pass shows
        for c in plan.chunks:
            r, n, start = c.request, c.num_tokens, c.start
            if n == 1:
                n_dec += 1
            else:
                n_pre += n
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            cache = r.cache  # its peak sizes are kept as its slots are taken (SeqCache.peak)
            assert cache is not None
            p, completes = r.params, c.completes
            sampled = completes and p.max_tokens > 0
            if sampled:
                done.append(c)
                if sampling:
                    params.append(p)
                    seeds.append(r.seed)
                    steps.append(len(r.output_ids) + r.pending_tokens)
            elif completes:
                scored.append(r)
            # a token still in flight stands as a placeholder: the graph reads its id
            # from the device (`after`)
            tokens = _PLACEHOLDER if after is not None else r.token_slice(start, start + n)
            if r.policy is None and r.prompt_logprobs is None:  # asks for nothing more
                inputs.append(SeqInput(tokens, start - r.pos_offset, c.slots, cache, sampled))
                plain = plain and p.logprobs is None
            else:
                needs = r.policy.needs if r.policy is not None else _NO_NEEDS
                # a policy that decides from sizes and positions alone may act before
                # the next plan without waiting for this step's tokens
                plain = (plain and needs == _NO_NEEDS and r.prompt_logprobs is None
                         and p.logprobs is None)
                inputs.append(SeqInput(
                    tokens, start - r.pos_offset, c.slots, cache, sampled, needs.attention,
                    _prompt_scoring(r, c) if r.prompt_logprobs is not None else None,
                    needs.key_diversity and self.policies.acts(r, c), needs.attention_heads,
                    needs.new_key_norm or needs.new_value_norm, needs.accumulate,
                    # a decode token (the window holds every query after the prompt)
                    None if needs.ring is None or not r.prefill_done else (*needs.ring, start)))
            # Counted as computed now (nothing before the advance reads it): a step that
            # fails fails every request in it, so no later step sees the count early.
            r.num_computed += n
        t1 = time.perf_counter()
        ids_from = None
        if after is not None:  # each row's token: its request's row in the step in flight
            ids_from = (after.ids, [c.request.pending_row for c in plan.chunks])
        # every request greedy, none asking for logprobs: the LM head may take the argmax
        out = self.runner.execute(inputs, plan.decode, ids_from, greedy=not sampling)
        t2 = time.perf_counter()
        for i, scores in out.scores.items():
            _add_prompt_logprobs(plan.chunks[i].request, scores)
        lp = None
        if out.ids is not None:  # the argmax from the LM head, no logits written
            ids = out.ids
        else:
            assert out.logits is not None
            batch = SamplingBatch.build(params, seeds, steps, out.logits.device) \
                if sampling else _ALL_GREEDY
            logits = out.logits
            if self._shaped:  # the raw logits stay for the logprobs (vLLM's default)
                logits = self._shape(logits, params, done, copy=batch.max_logprobs is not None)
            ids = sample(logits, batch)  # on the model's device
            if batch.max_logprobs is not None:
                lp = top_logprobs(out.logits, ids, batch.max_logprobs)
        launch = Launch(plan, done, scored, ids, lp, out, n_pre, n_dec, t1 - t0, t2 - t1)
        if plain and out.graph and not scored and len(done) == len(plan.chunks):
            # left in flight: the ids start for the host now, read by the next call
            launch.host, launch.event = self._host_ids.start(ids)
            for row, c in enumerate(done):
                c.request.pending_tokens += 1
                c.request.pending_row = row
        launch.sample_s = time.perf_counter() - t2
        return launch

    def _shape(self, logits: torch.Tensor, params: list[SamplingParams], done: list[Chunk],
               copy: bool) -> torch.Tensor:
        """The sampled rows' logits after their penalties and bias (engine/penalties.py)
        and their grammars' masks (engine/structured.py); a copy if `copy`."""
        histories: list[TokenHistory | None] = []
        banned: list[frozenset[int] | None] = []  # EOS and stop ids before min_tokens
        rows = []  # those under a grammar
        for i, c in enumerate(done):  # one pass over the sampled rows' requests
            r = c.request
            if r.history is not None:
                r.history.take(r.output_ids)  # its new tokens only
            histories.append(r.history)
            least = r.params.min_tokens
            banned.append(r.stop_ids if least and len(r.output_ids) < least else None)
            if r.matcher is not None:
                rows.append(i)
        pen = Penalties.build(params, histories, banned, logits.device)
        if pen is None and not rows:
            return logits
        if copy:
            logits = logits.clone()
        if pen is not None:
            apply_penalties(logits, pen)
        if rows:
            assert self._grammars is not None
            self._grammars.mask(logits, rows, [done[i].request.matcher for i in rows])
        return logits

    def _complete(self, launch: Launch, t: float) -> list[RequestOutput]:
        """Wait for a launched step's tokens and advance its requests: stop conditions,
        outputs, then their policies on the slot layout its forward saw."""
        if launch.host is not None:
            if launch.event is not None:
                launch.event.synchronize()
            tokens, lp = launch.host.tolist(), None
        else:
            tokens, lp = to_host(launch.ids, launch.lp)  # the step's one device-to-host copy
        t3 = time.perf_counter()
        plan = launch.plan
        self.scheduler.publish(plan.chunks)  # before anything is evicted or trimmed
        outputs = self._advance(launch.done, tokens, lp) + self._finish_scored(launch.scored)
        t4 = time.perf_counter()
        if not launch.policies_ran:
            self.policies.run(plan.chunks, launch.out.attention)  # the layout the forward saw
        t5 = time.perf_counter()
        if self._min_window < 2**62:  # a model with sliding-window layers
            for c in plan.chunks:
                self._trim_windows(c.request)
        if (self.cost_model is not None and len(plan.chunks) == 1
                and plan.chunks[0].num_tokens > 1):
            self.cost_model.observe_prefill(plan.chunks[0].num_tokens, launch.forward_s)
        if self.on_step is not None:
            self.on_step(StepStats(
                len(plan.chunks), launch.n_pre, launch.n_dec, launch.schedule_s + t4 - t3,
                launch.forward_s, launch.sample_s + t3 - t, launch.policy_s + t5 - t4,
                launch.schedule_s + launch.forward_s + launch.sample_s + launch.policy_s
                + t5 - t))
        return outputs

    def _advance(self, done: list[Chunk], tokens: list[int],
                 lp: tuple[list[float], list[list[int]], list[list[float]]] | None
                 ) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        finished = Status.FINISHED
        for row, (c, tok) in enumerate(zip(done, tokens)):
            r = c.request
            if r.status is finished:  # stopped, or aborted, while this step ran
                continue
            if r.pending_tokens:
                r.pending_tokens -= 1
            if r.first_token_time is None:
                r.first_token_time = now
                self._prompt_tokens += len(r.prompt_ids)
            r.output_ids.append(tok)
            if r.matcher is not None:  # its grammar follows every token it drew
                r.matcher.accept_token(tok)  # type: ignore[attr-defined]
            logprobs = None
            if (k := r.params.logprobs) is not None:
                logprobs = []
                if lp is not None:
                    top = list(zip(lp[1][row][:k], lp[2][row][:k]))
                    logprobs.append(TokenLogprob(tok, lp[0][row], top))
            text, finish = self._check_stop(r, tok)
            if finish is not None:
                r.finish_reason = finish
                r.pending_tokens = 0  # a token of the step after this one is dropped
                if r.detok is not None:
                    text += r.detok.flush()
                self.scheduler.remove(r)
                self._forget(r)
            outputs.append(self._output(r, [tok], text, logprobs))
        self._generation_tokens += len(outputs)  # a token each
        return outputs

    def _finish_scored(self, reqs: list[Request]) -> list[RequestOutput]:
        """Scoring requests (max_tokens 0) whose prefill is done: finished with "length"
        and no token sampled; their output carries the prompt logprobs."""
        outputs = []
        for r in reqs:
            self._prompt_tokens += len(r.prompt_ids)
            r.finish_reason = "length"
            self.scheduler.remove(r)
            self._forget(r)
            outputs.append(self._output(r, [], "", [] if r.params.logprobs is not None else None))
        return outputs

    def _rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.rotary.rotate(keys, delta, scaled=False)

    def _check_stop(self, r: Request, tok: int) -> tuple[str, str | None]:
        n, least = len(r.output_ids), r.params.min_tokens
        if tok in r.stop_ids and n > least:  # banned before (engine/penalties.py)
            # its text only if asked (an EOS, a special token, has none unless asked too)
            kept = r.detok is not None and r.params.include_stop_str_in_output
            return (r.detok.add([tok], stops=False)[0] if kept else ""), "stop"  # type: ignore[union-attr]
        text = ""
        if r.detok is not None:
            text, hit = r.detok.add([tok], stops=n >= least)  # vLLM's count for strings
            if hit:
                return text, "stop"
        if r.matcher is not None and r.matcher.is_terminated():  # type: ignore[attr-defined]
            return text, "stop"  # its grammar took its end (EOS, even with ignore_eos)
        # max_tokens is within the context unless the request shifts RoPE positions
        # (`scheduler/resolve.py` fitted it: the one context rule), so it is the one bound.
        if len(r.output_ids) >= r.params.max_tokens:
            return text, "length"
        return text, None

    def _trim_windows(self, r: Request) -> None:
        """Free blocks that fell out of every future query's sliding window."""
        min_pos = r.num_computed - self._min_window + 1
        if r.cache is None or min_pos - r.window_trimmed < self.pool.block_size:
            return
        for layer, w in enumerate(self.model_config.sliding_windows):
            if w is not None:
                r.cache.drop_before(layer, r.num_computed - w + 1)
        r.window_trimmed = min_pos

    def _output(self, r: Request, ids: list[int], text: str,
                logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """The step's delta of one request: every running request reports every step, so
        the new ids (and logprobs) are the step's own, never a backlog."""
        prompt_lps = None
        if r.prompt_logprobs is not None and not r.prompt_logprobs_sent:
            assert not r.scoring_prompt, "a request's first output follows its prefill"
            prompt_lps, r.prompt_logprobs_sent = r.prompt_logprobs, True
        finished = r.finish_reason is not None
        # Positional, in RequestOutput's field order: a keyword call costs 2.5x as much,
        # and this runs for every request every step.
        return RequestOutput(
            r.request_id, ids, text, logprobs,
            finished, r.finish_reason, len(r.prompt_ids), len(r.output_ids),
            self._final_kv(r) if finished else None,  # kv
            r.arrival_time, r.first_scheduled_time, r.first_token_time, r.num_preemptions,
            prompt_lps)

    def _final_kv(self, r: Request) -> KVUsage:
        r.kv.peak_bytes = r.kv.peak_blocks * self.pool.block_bytes
        return r.kv

    # ---- introspection -------------------------------------------------------------
    def stats(self) -> EngineStats:
        running = self.scheduler.running
        live = sum(r.cache.live for r in running if r.cache is not None)
        pool = self.pool
        return EngineStats(
            num_running=len(running), num_waiting=len(self.scheduler.waiting),
            blocks_total=pool.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
            live_slots=live, slot_capacity_used=pool.num_used * pool.block_size,
            kv_cache_dtype=pool.dtype_name, block_bytes=pool.block_bytes,
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


def _prompt_scoring(r: Request, c: Chunk) -> PromptScoring | None:
    """The rows of this chunk whose prompt logprobs are still owed: row j (token index
    j) predicts prompt token j + 1. Rows scored before a recompute are not scored again,
    and the last prompt token's row predicts the first output (sampling's, not ours)."""
    if not r.scoring_prompt:
        return None
    assert r.prompt_logprobs is not None and r.params.prompt_logprobs is not None
    lo = max(c.start, len(r.prompt_logprobs) - 1)
    hi = min(c.start + c.num_tokens, len(r.prompt_ids) - 1)
    if lo >= hi:
        return None
    return PromptScoring(lo - c.start, r.prompt_ids[lo + 1 : hi + 1], r.params.prompt_logprobs)


def _add_prompt_logprobs(r: Request, s: TokenScores) -> None:
    """Append one chunk's scored rows, in prompt order, to the request's list."""
    assert r.prompt_logprobs is not None
    first = len(r.prompt_logprobs)
    for k in range(len(s)):
        r.prompt_logprobs.append(TokenLogprob(
            r.prompt_ids[first + k], s.logprob[k], list(zip(s.top_ids[k], s.top_logprobs[k])),
            s.rank[k]))


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two per-policy counters as one (a new dict)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
