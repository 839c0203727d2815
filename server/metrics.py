"""Prometheus metrics: the vLLM set under `kvserve_`, plus what only kvserve has.

Three sources, each cheap where it runs: an `on_step` listener (worker thread) fills the
step histograms; an output listener (event loop) fills the per-request histograms from
the timestamps every RequestOutput carries; a collector turns the EngineStats snapshot
the worker refreshes after each step into gauges and counters at scrape time, so a
scrape never touches the (non-thread-safe) core. Labels are bounded: finish reasons,
preemption modes, policy names, phases, block states, the configured tenants' names
(`tenant0`, ...); never request ids, never API keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policies.catalog import known_policies
from scheduler.async_engine import AsyncEngine
from scheduler.outputs import RequestOutput, StepStats

P = "kvserve_"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
HEAD_IMBALANCE_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0)
FINISH_REASONS = ("stop", "length", "abort")
PREEMPTION_MODES = ("recompute", "swap")
REJECT_REASONS = ("queue_full", "invalid", "unavailable")


class EngineStatsCollector(Collector):
    def __init__(self, engine: AsyncEngine, tenants: Sequence[str] = ()) -> None:
        self.engine = engine
        self.tenants = list(tenants)  # the only label values the tenant gauges take

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        s = e.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, value=value)

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (in the engine "
                    "or admitted and not yet handed to it).", s.num_waiting + e.num_pending)
        yield gauge("num_requests_swapped", "Requests swapped out to host memory.",
                    s.num_swapped)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
                    s.blocks_used / s.blocks_total if s.blocks_total else 0.0)
        blocks = GaugeMetricFamily(P + "kv_blocks", "KV pool blocks by state (used + cached "
                                   "+ free = capacity).", labels=["state"])
        blocks.add_metric(["used"], s.blocks_used)
        blocks.add_metric(["cached"], s.blocks_cached_free)  # free, but hold a prefix
        blocks.add_metric(["free"], s.blocks_free - s.blocks_cached_free)
        yield blocks
        yield gauge("kv_blocks_capacity", "KV pool capacity in blocks.", s.blocks_total)
        yield gauge("kv_block_bytes", "Bytes of one KV block (K and V of one layer, "
                    "quantization scales included).", s.block_bytes)
        info = GaugeMetricFamily(P + "kv_cache_dtype_info", "The KV pool's element type "
                                 "(--kv-cache-dtype, auto resolved).", labels=["dtype"])
        info.add_metric([s.kv_cache_dtype or "unknown"], 1)
        yield info
        yield gauge("kv_cache_bytes", "Bytes of the KV pool (capacity x bytes per block).",
                    s.blocks_total * s.block_bytes)
        sizing = getattr(e.info, "kv_sizing", None)  # set once loaded, then read-only
        if sizing is not None:
            how = GaugeMetricFamily(P + "kv_cache_sizing_info", "What sized the KV pool: "
                                    "auto (the memory left after the weights), "
                                    "kv_cache_memory or num_blocks; for auto, the limit "
                                    "that bounded the memory seen.",
                                    labels=["source", "available_source"])
            how.add_metric([sizing.source, sizing.available_source], 1)
            yield how
            yield gauge("kv_cache_available_bytes", "Memory seen available when the KV pool "
                        "was sized automatically, after the weights (0 when it was given).",
                        sizing.available)
        used = GaugeMetricFamily(P + "tenant_kv_blocks", "KV blocks held by each tenant's "
                                 "running requests (a tenant is an API key).",
                                 labels=["tenant"])
        quota = GaugeMetricFamily(P + "tenant_kv_blocks_quota", "KV blocks reserved for "
                                  "each tenant by --tenant-quota (0: burst pool only).",
                                  labels=["tenant"])
        for t in self.tenants:
            used.add_metric([t], s.tenant_blocks.get(t, 0))
            quota.add_metric([t], e.tenant_quotas.get(t, 0.0) * s.blocks_total)
        yield used
        yield quota
        yield gauge("kv_live_slots", "Live token slots, summed over layers.", s.live_slots)
        yield gauge("kv_dead_slots", "Slots in used blocks that hold no live token (evicted "
                    "or not yet filled), summed over layers.",
                    max(0, s.slot_capacity_used - s.live_slots))
        yield gauge("engine_ready", "1 when the engine accepts requests.", float(e.ready))
        yield gauge("engine_active_requests", "Engine requests admitted and not finished "
                    "(all choices of all HTTP requests).", e.num_active)
        try:  # scrapes run on the event loop; elsewhere (a test calling collect) skip it
            tasks = len(asyncio.all_tasks())
        except RuntimeError:
            tasks = 0
        yield gauge("event_loop_tasks", "asyncio tasks alive on the server's event loop (a "
                    "steady climb means leaked requests).", tasks)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(P + name, doc, value=value)

        yield counter("prompt_tokens", "Prefilled prompt tokens.", s.prompt_tokens_total)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries_total)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.prefix_cache_hits_total)
        policies = known_policies()
        for name, doc, values, label, known in (
            ("num_preemptions", "Preemptions by mode.", s.preemptions_total, "mode",
             PREEMPTION_MODES),
            ("swap_bytes", "Bytes copied between the KV pool and host swap space.",
             s.swap_bytes_total, "direction", ("in", "out")),
            ("policy_requests", "Requests admitted, by kv_policy.",
             s.requests_by_policy_total, "policy", policies),
            ("policy_evicted_tokens", "Tokens evicted by kv_policy (per-layer slots / "
             "layers).", s.evicted_tokens_by_policy_total, "policy", policies),
            ("policy_freed_blocks", "Blocks freed by eviction, by kv_policy.",
             s.freed_blocks_by_policy_total, "policy", policies),
            ("policy_seconds", "Seconds spent deciding and carrying out evictions, by "
             "kv_policy.", s.policy_seconds_total, "policy", policies),
        ):
            # every known label value from the start, so rate() has a zero to start from
            fam = CounterMetricFamily(P + name, doc, labels=[label])
            for k in sorted(set(known) | {str(k) for k in values}):
                fam.add_metric([k], values.get(k, 0))
            yield fam


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, registry: CollectorRegistry | None = None,
                 tenants: Sequence[str] = ()) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        if engine.layout == "process":  # the model's memory and CPU time are its own
            ProcessCollector(namespace=P + "engine", pid=lambda: str(engine.engine_pid),
                             registry=r)
        PlatformCollector(registry=r)
        r.register(EngineStatsCollector(engine, tenants))

        def hist(name: str, doc: str, buckets: tuple, labels: tuple = ()) -> Histogram:
            return Histogram(P + name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.",
                         LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after "
                         "the first, per request.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive token "
                        "deliveries, per token.", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.",
                               TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per finished "
                            "request.", TOKEN_BUCKETS)
        self.head_imbalance = hist(
            "request_kv_head_imbalance", "Over a per-head pool (--kv-layout head): live "
            "tokens of a finished request's fullest (layer, kv head) over its emptiest.",
            HEAD_IMBALANCE_BUCKETS)
        self.success = Counter(P + "request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        self.step_phase = hist("engine_step_phase_seconds", "Engine step time by phase.",
                               STEP_BUCKETS, ("phase",))
        self.step_total = hist("engine_step_seconds", "Engine step wall time.", STEP_BUCKETS)
        self.step_batch = hist("engine_step_batch_size", "Sequences per engine step.",
                               BATCH_BUCKETS)
        self.step_tokens = hist("engine_step_tokens", "Tokens (prefill + decode) per step.",
                                TOKEN_BUCKETS)
        self.http = Counter(P + "http_requests", "HTTP responses by route and status code.",
                            ["route", "status"], registry=r)
        self.rejected = Counter(P + "requests_rejected", "Requests refused at admission.",
                                ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self._last_token_time: dict[str, float] = {}
        engine.add_step_listener(self.observe_step)
        engine.add_output_listener(self.observe_output)

    def observe_step(self, s: StepStats) -> None:
        for phase in ("schedule", "forward", "policy", "sample"):
            self.step_phase.labels(phase).observe(getattr(s, f"{phase}_s"))
        self.step_total.observe(s.total_s)
        self.step_batch.observe(s.num_seqs)
        self.step_tokens.observe(s.num_prefill_tokens + s.num_decode_tokens)

    def observe_output(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        last = self._last_token_time.get(rid)
        if out.new_token_ids:
            if last is None and out.first_token_time is not None:
                self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
                if out.first_scheduled_time is not None:
                    self.queue.observe(max(0.0, out.first_scheduled_time - out.arrival_time))
            elif last is not None:
                gap = max(0.0, now - last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.itl.observe(gap)
            self._last_token_time[rid] = now
        if not out.finished:
            return
        self._last_token_time.pop(rid, None)
        reason = out.finish_reason if out.finish_reason in FINISH_REASONS else "abort"
        self.success.labels(reason).inc()
        if reason == "abort":
            return
        self.e2e.observe(max(0.0, now - out.arrival_time))
        if out.kv is not None and out.kv.head_live_max:
            self.head_imbalance.observe(out.kv.head_live_max / max(1, out.kv.head_live_min))
        self.prompt_len.observe(out.num_prompt_tokens)
        self.gen_len.observe(out.num_output_tokens)
        if out.first_token_time is not None and out.num_output_tokens > 1:
            self.tpot.observe(max(0.0, now - out.first_token_time)
                              / (out.num_output_tokens - 1))


# ---- --metrics-alias vllm -------------------------------------------------------------
# kvserve family (without the prefix) -> the vLLM names it is also exported under. Both
# the current and the older vLLM spellings, because routers and autoscalers read either
# (the Gateway API Inference Extension's endpoint picker and llm-d read
# num_requests_waiting/running and kv_cache_usage_perc; vLLM production-stack's router
# and older dashboards gpu_cache_usage_perc and gpu_prefix_cache_*).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "num_requests_swapped": ("num_requests_swapped",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_preemptions": ("num_preemptions",),  # vLLM's has no mode label: summed over it
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "time_per_output_token_seconds": ("time_per_output_token_seconds",
                                      "request_time_per_output_token_seconds"),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
}
METRICS_ALIASES = ("vllm",)


class VllmAliasCollector(Collector):
    """The same numbers again under vLLM's `vllm:` names, each with vLLM's `model_name`
    label, plus `vllm:cache_config_info` (block size and pool size in vLLM's units: one
    vLLM block holds `block_size` tokens of every layer, or of one of vLLM's hybrid groups'
    layers where sliding-window layers keep their windows; a kvserve block one layer's).
    Reads the same sources as the `kvserve_` series at scrape time; stores nothing."""

    def __init__(self, engine: AsyncEngine, model_name: str, sources: Sequence[Collector]
                 ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.sources = [EngineStatsCollector(engine), *sources]

    def describe(self) -> Iterable[Metric]:
        return []  # names are derived at scrape time; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        for src in self.sources:
            for fam in src.collect():
                short = fam.name.removeprefix(P)
                for alias in VLLM_ALIASES.get(short, ()) if fam.name.startswith(P) else ():
                    yield self._renamed(fam, "vllm:" + alias)
        info = self.engine.info  # set once loaded, then read-only
        config = getattr(info, "config", None)
        # a vLLM block's lanes: every layer's, or on a hybrid pool vLLM's group's
        lanes = (getattr(getattr(info, "kv_sizing", None), "block_lanes", 0)
                 or getattr(info, "num_lanes", 0))
        if config is not None and lanes:
            info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration "
                                     "(vLLM's units).", labels=["block_size",
                                     "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                                     "model_name"])
            info.add_metric([str(config.block_size),
                             str(self.engine.stats.blocks_total // lanes),
                             str(getattr(config, "kv_cache_dtype", "auto")),
                             str(bool(config.enable_prefix_caching)), self.model_name], 1)
            yield info

    def _renamed(self, fam: Metric, name: str) -> Metric:
        out = Metric(name, fam.documentation, fam.type)
        summed: dict[tuple, float] = {}
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "mode"}
            labels["model_name"] = self.model_name
            key = (name + s.name[len(fam.name):], tuple(sorted(labels.items())))
            prev = summed.get(key)  # _created timestamps: the earliest, not a sum
            summed[key] = (s.value if prev is None else min(prev, s.value)
                           if s.name.endswith("_created") else prev + s.value)
        for (sample_name, labels), value in summed.items():
            out.add_sample(sample_name, dict(labels), value)
        return out


def add_metrics_alias(metrics: ServerMetrics, engine: AsyncEngine, alias: str,
                      model_name: str) -> None:
    """`--metrics-alias vllm`: also export the vLLM names routers and autoscalers read."""
    if alias not in METRICS_ALIASES:
        raise ValueError(f"unknown metrics alias {alias!r}; use one of {METRICS_ALIASES}")
    hists = [metrics.ttft, metrics.tpot, metrics.itl, metrics.e2e, metrics.queue,
             metrics.prompt_len, metrics.gen_len, metrics.success]
    metrics.registry.register(VllmAliasCollector(engine, model_name, hists))
