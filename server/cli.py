"""`kvserve serve` (the OpenAI-compatible server) and `kvserve generate` (offline).

SIGTERM (and a first Ctrl-C) drains instead of stopping: `/ready` turns 503 at once so
a load balancer stops routing, requests in flight finish for up to `--drain-timeout`
seconds, then the process exits 0. A second signal exits at once.

Benchmarks are not a subcommand: they run as `python -m loadtest ...`, a client on top
of the server that this package never imports (docs/loadtest.md).

Exit status: 0 after a drain; 2 for anything wrong on the command line or in the
environment that can be found before the model loads (a bad option value, a bad
`--default-kv-policy`, a missing model directory, a port already taken, bad tenant
quotas), always with one line `kvserve: error: ...` on stderr and before minutes are
spent loading a model; also 2, with the same line, when the KV pool is sized from the
memory left after the weights (no `--kv-cache-memory`, no `--num-blocks`) and that does
not hold one request of the model's context; 1 when the model fails to load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from engine import cpu_threads
from engine.demo import DEMO_MODEL_DIR as DEMO_MODEL
from engine.demo import DEMO_MODEL_NAME
from server.startup_checks import (
    USAGE_ERROR,
    add_generation_config_arg,
    add_tool_call_args,
    agent_settings,
    check_byte_sizes,
    check_generation_config,
    check_kv_cache_dtype,
    check_port_free,
    check_tool_call_args,
    default_kv_policy,
    error_line,
    fail,
    resolve_model,
    usage_error,
)

if TYPE_CHECKING:  # torch loads with it, and must not before cpu_threads.apply
    from scheduler.async_engine import AsyncEngine
    from scheduler.llm import LLM
    from server.memwatch import MemoryWatch

logger = logging.getLogger("kvserve.cli")
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where there is none to show (None, False):
    those options' help says what happens without them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "%(default)" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def _add_engine_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a local Hugging Face checkpoint directory (config.json, "
                   f"*.safetensors, tokenizer files); without it, the demo model {DEMO_MODEL}")
    g.add_argument("--dtype", default="auto",
                   help="weights and activations: auto (the checkpoint's) | float32 | "
                   "bfloat16 | float16")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV pool: auto (the model's dtype) | float32 | bfloat16 | float16 | "
                   "int8 | fp8_e4m3 | int4 (quantized: codes + fp16 scales, dequantized "
                   "inside attention; docs/memory.md)")
    g.add_argument("--kv-layout", default="layer", choices=("layer", "head"),
                   help="what a KV page holds: one layer's every kv head (one kept set a "
                   "layer) or one (layer, kv head), each head keeping and freeing its own "
                   "tokens (kv_policy's `heads`; docs/memory.md). --num-blocks counts pages")
    g.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | "
                   "cuda[:N]")
    g.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="threads of the model's CPU ops; without it, env OMP_NUM_THREADS "
                   "if set, else one per physical core this process may use")
    g.add_argument("--cpu-wait", default=None, choices=cpu_threads.WAITS,
                   help="how an intra-op thread waits between ops: poll (kvserve's "
                   "kernels' threads poll ~1 ms yielding their core, then sleep; torch's "
                   "own sleep at once), passive (all sleep at once) or spin (torch's spin "
                   "~1.5 ms too: faster for bf16 on cores of its own). Without it, env "
                   "OMP_WAIT_POLICY / GOMP_SPINCOUNT if set, else poll for serve and spin "
                   "for generate (no HTTP side)")
    g.add_argument("--cpu-bind", default=None, metavar="LIST|none",
                   help="confine the whole process to these CPUs, e.g. 0-3 (taskset's "
                   "format); the thread default then counts their physical cores. Without "
                   "it (or with none), the process keeps the CPUs it was given")
    g.add_argument("--cpu-kernels", default=None, choices=("measure", "vendor"),
                   help="how each linear layer's CPU kernel (kvserve's panels, oneDNN's "
                   "packed weight, torch's dense GEMM) is chosen: measure (time each at "
                   "start, once per layer shape, within ~5 s; kept per machine under "
                   "~/.cache/kvserve, or KVSERVE_KERNEL_CACHE, so a restart measures "
                   "nothing) or vendor (a table of CPU vendors and instruction sets). "
                   "Without it, env KVSERVE_KERNEL_CHOICE if set, else measure")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block "
                   "(default: 16; with --kv-layout head, pages of 8 KiB of K: 16-64)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool size in blocks (a block holds one layer's K/V for "
                   "--block-size tokens); wins over --kv-cache-memory")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes, e.g. 2GiB; without it (and without "
                   "--num-blocks) sized from the memory left after the weights: half of "
                   "what is available on a CPU (MemAvailable, a cgroup's limit or env "
                   "KVSERVE_MEMORY_LIMIT, the smallest), 90%% of a GPU less what is in use, "
                   "minus the activations' room, and at most --max-num-seqs sequences of "
                   "--max-model-len tokens (logged as 'KV pool: ...'; docs/memory.md)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences in one running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens one engine step computes (prefill chunks + decodes)")
    g.add_argument("--min-prefill-chunk", type=int, default=None,
                   help="shortest prefill chunk of a long prompt whose kv_policy bounds it "
                   "(evicting between chunks; default 256 tokens): longer chunks prefill "
                   "faster and let scoring policies rank more of the prompt at once, for "
                   "more memory per request")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length; without it, the model's max_position_embeddings")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the seeds drawn for requests that send none")
    g.add_argument("--default-kv-policy", default="full", metavar="NAME|JSON",
                   help="kv_policy for requests that name none: a policy name or a JSON "
                   "object, e.g. '{\"name\": \"streaming\", \"window\": 1024}' "
                   "(checked at start-up)")
    g.add_argument("--preemption-mode", choices=("recompute", "swap", "auto"),
                   default="recompute", help="what a preempted request loses: its KV "
                   "(recomputed later) or nothing (swapped to host memory); auto picks per "
                   "request by measured cost")
    g.add_argument("--swap-space", default="1GiB", help="host memory for swapped-out blocks")
    g.add_argument("--no-reserve-preempted", action="store_true",
                   help="a preempted request comes back on what it needs now (vLLM), "
                        "not once its growth to max_tokens fits")
    g.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of blocks kept free when admitting")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share computed prompt blocks between requests")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's whole context in the KV pool, sliding-window "
                   "layers included (vLLM's flag); by default a sliding-window layer keeps "
                   "only its window's pages (docs/memory.md, 'Hybrid memory')")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs "
                   "(as vLLM's flag): slower, for debugging and comparison")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="on CUDA, wait for each decode step's tokens before planning the "
                        "next (by default a graph step of plain requests is planned and "
                        "launched while the one before it runs, as vLLM's "
                        "--async-scheduling)")
    g.add_argument("--no-batch-policies", action="store_true",
                   help="step every request's kv_policy alone (same plans, slower): "
                        "decode steps at the budget are otherwise batched per policy")
    return g


def _engine_kwargs(a: argparse.Namespace) -> dict:
    kw = dict(dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, kv_layout=a.kv_layout,
              device=a.device,
              block_size=a.block_size, num_blocks=a.num_blocks, kv_cache_memory=a.kv_cache_memory,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              max_model_len=a.max_model_len, seed=a.seed,
              default_kv_policy=a.default_kv_policy, preemption_mode=a.preemption_mode,
              swap_space=a.swap_space, watermark=a.watermark,
              reserve_preempted=not a.no_reserve_preempted,
              enable_prefix_caching=not a.no_prefix_caching,
              hybrid_kv_cache=not a.disable_hybrid_kv_cache_manager,
              batch_policies=not a.no_batch_policies, enforce_eager=a.enforce_eager,
              async_scheduling=not a.no_async_scheduling, cpu_kernels=a.cpu_kernels)
    # Given only when set: EngineConfig keeps the default (importing it here would load
    # torch before the arguments are parsed).
    if a.min_prefill_chunk is not None:
        kw["min_prefill_chunk"] = a.min_prefill_chunk
    return kw


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       formatter_class=HelpFormatter)
    add_generation_config_arg(_add_engine_args(s))
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; repeat for several "
                   "keys, each its own tenant (tenant0, tenant1, ... in order). Default: "
                   "env KVSERVE_API_KEY, comma-separated")
    s.add_argument("--tenant-quota", action="append", default=None, metavar="KEY=FRACTION",
                   help="reserve FRACTION (0, 1] of the KV pool for the tenant of API key "
                   "KEY (or its name, tenant0 ...); repeatable, fractions sum to <= 1, the "
                   "rest is a shared burst pool")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the model directory's name)")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting for their first token before new ones get 429")
    s.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="prompt tokens waiting for their first token before new requests "
                   "get 429")
    s.add_argument("--engine-layout", choices=("process", "thread"), default="process",
                   help="where the engine core steps the model: a process of its own "
                   "(vLLM v1's EngineCore process; ids, text deltas and stats cross a "
                   "pipe, and the HTTP side never waits for the engine's GIL) or a worker "
                   "thread of the server's process (one process, less memory). "
                   "docs/benchmarks.md measures both")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight may run after SIGTERM")
    s.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="largest request body; bigger ones get 413")
    s.add_argument("--log-level", default="info", help="debug | info | warning | error")
    s.add_argument("--log-format", choices=("json", "text"), default="json",
                   help="one JSON object per line, or plain text")
    s.add_argument("--access-log", action="store_true", help="uvicorn's per-request log")
    s.add_argument("--no-request-log", action="store_true",
                   help="drop the structured per-request line")
    s.add_argument("--metrics-alias", choices=("vllm",), default=None,
                   help="also export the metrics under vLLM's names (vllm:num_requests_"
                   "waiting, vllm:kv_cache_usage_perc, ...) for routers and autoscalers "
                   "that read them")
    add_tool_call_args(s)
    g = sub.add_parser("generate", help="generate offline (no server)",
                       formatter_class=HelpFormatter)
    _add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--sample-seed", type=int, default=None,
                   help="sampling seed; without it, one is drawn from --seed")
    h = sub.add_parser("head-roles", formatter_class=HelpFormatter,
                       help="measure which kv heads a long context needs, for kv_policy "
                       "duo (writes kv_head_roles.json beside the model)")
    _add_engine_args(h)
    h.add_argument("--prompts", type=int, default=8, help="pass-key prompts")
    h.add_argument("--length", type=int, default=512, help="tokens a prompt")
    h.add_argument("--sink", type=int, default=4, help="sinks a streaming head keeps")
    h.add_argument("--window", type=int, default=64, help="recent tokens it keeps")
    h.add_argument("--out", default=None, help="where to write (default: beside the model)")
    return parser


def _head_roles(a: argparse.Namespace) -> int:
    threads(a, "spin")
    model = resolve_model(a.model)
    from scheduler.measure_roles import measure_and_save

    path = measure_and_save(model, _engine_kwargs(a), a.out, prompts=a.prompts,
                            length=a.length, sink=a.sink, window=a.window)
    print(path)
    return 0


def tenancy(a: argparse.Namespace) -> tuple[list[str], dict[str, float]]:
    """(API keys, {tenant name: quota}) from the arguments and KVSERVE_API_KEY; exits
    with a message naming the bad entry."""
    from server.tenants import make_tenants, parse_api_keys, parse_tenant_quotas

    keys = parse_api_keys(a.api_key, os.environ.get("KVSERVE_API_KEY"))
    try:
        return keys, parse_tenant_quotas(a.tenant_quota, make_tenants(keys))
    except ValueError as e:
        fail(str(e))


def threads(a: argparse.Namespace, default_wait: str = "poll") -> cpu_threads.CpuThreads:
    """`--cpu-threads` / `--cpu-bind` / `--cpu-wait` checked and applied before torch
    loads (exit 2 on a bad value): OpenMP takes its thread count and wait policy from
    the environment once, when it loads (engine/cpu_threads.py says why the default is
    what it is)."""
    try:
        choice = cpu_threads.plan(a.cpu_threads, a.cpu_bind, a.cpu_wait, default_wait)
    except ValueError as e:
        fail(str(e))
    return cpu_threads.apply(choice)


def _serve(a: argparse.Namespace) -> int:
    check_tool_call_args(a)
    keys, quotas = tenancy(a)
    cpu = threads(a)  # before anything loads torch (the policy check does)
    from scheduler.async_engine import AsyncEngine
    from scheduler.engine_core import EngineConfig
    from server.app import build_app
    from server.logs import configure_logging
    from server.settings import ServerSettings

    a.default_kv_policy = default_kv_policy(a.default_kv_policy, a.kv_layout)
    check_kv_cache_dtype(a.kv_cache_dtype)
    check_byte_sizes(a)
    model = resolve_model(a.model)
    check_generation_config(a.generation_config, model)
    check_port_free(a.host, a.port)
    configure_logging(a.log_level, a.log_format)
    logger.info("cpu threads", extra={"fields": {**cpu.fields(),
                                                 "engine_layout": a.engine_layout}})
    names = a.served_model_name or [
        DEMO_MODEL_NAME if a.model is None else Path(model).resolve().name]
    engine = AsyncEngine.from_config(EngineConfig(model=model, tenant_quotas=quotas or None,
                                                  generation_config=a.generation_config,
                                                  **_engine_kwargs(a)),
                                     engine_process=a.engine_layout == "process",
                                     process_setup=partial(engine_process_setup,
                                                           a.log_level, a.log_format),
                                     max_queued_requests=a.max_queued_requests,
                                     max_queued_tokens=a.max_queued_tokens)
    exit_code = 0
    server: DrainingServer | None = None

    def fatal(e: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        if usage_error(e):  # too little memory for the pool: the option that fixes it
            error_line(str(e))
            exit_code = USAGE_ERROR
        if server is not None:
            server.should_exit = True

    settings = ServerSettings(served_model_names=names, model_path=model, api_keys=keys,
                              max_body_bytes=a.max_body_bytes, drain_timeout=a.drain_timeout,
                              request_log=not a.no_request_log, on_fatal=fatal,
                              tool_call_parser=a.tool_call_parser,
                              enable_auto_tool_choice=a.enable_auto_tool_choice,
                              **agent_settings(a))
    app = build_app(engine, settings)
    if a.metrics_alias:
        from server.metrics import add_metrics_alias

        add_metrics_alias(app.state.metrics, engine, a.metrics_alias, names[0])
    config = uvicorn.Config(app, host=a.host, port=a.port, log_config=None,
                            access_log=a.access_log, timeout_graceful_shutdown=5,
                            timeout_keep_alive=5)
    server = DrainingServer(config, engine, a.drain_timeout)
    from server.memwatch import MemoryWatch

    watch = MemoryWatch.from_env()  # KVSERVE_MEMDEBUG: periodic memory diagnostics
    if watch is not None:
        watch.start()
    logger.info("serving", extra={"fields": {"host": a.host, "port": a.port,
                                             "model": model, "served_model_names": names,
                                             "tenants": settings.tenant_names,
                                             "tenant_quotas": quotas}})
    server.run()
    return exit_code


def engine_process_setup(log_level: str, log_format: str) -> MemoryWatch | None:
    """What the engine process does first (it starts with nothing set up): the server's
    log format, and `KVSERVE_MEMDEBUG`'s memory lines of its own."""
    from server.logs import configure_logging
    from server.memwatch import MemoryWatch

    configure_logging(log_level, log_format)
    watch = MemoryWatch.from_env()
    return None if watch is None else watch.start()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before exiting."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float
                 ) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            self.force_exit = self._drain_task is not None  # second signal: now
            return super().handle_exit(sig, frame)
        logger.info("draining", extra={"fields": {"signal": signal.Signals(sig).name,
                                                  "timeout_s": self.drain_timeout}})
        self._drain_task = self._loop.create_future()  # placeholder until scheduled
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        clean = await self.engine.drain(self.drain_timeout)
        logger.info("drained", extra={"fields": {"clean": clean}})
        self.should_exit = True


def offline_llm(a: argparse.Namespace) -> tuple[LLM, cpu_threads.CpuThreads]:
    """The `LLM` and thread choice `kvserve generate` runs with, from its parsed
    arguments: one place, so a benchmark's offline reference (loadtest/offline_ref.py)
    measures exactly what a user's `kvserve generate` would, defaults included."""
    cpu = threads(a, "spin")  # before torch loads; no HTTP side for threads to spin against
    a.default_kv_policy = default_kv_policy(a.default_kv_policy, a.kv_layout)
    check_kv_cache_dtype(a.kv_cache_dtype)
    check_byte_sizes(a)
    model = resolve_model(a.model)
    from scheduler.llm import LLM

    try:
        return LLM(model, **_engine_kwargs(a)), cpu
    except ValueError as e:
        if usage_error(e):
            fail(str(e))
        raise


def _generate(a: argparse.Namespace) -> int:
    llm, _ = offline_llm(a)
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.sample_seed)
    for prompt, out in zip(a.prompt, llm.generate(a.prompt, params)):
        text = getattr(out, "text", out)
        if len(a.prompt) > 1:
            print(f"--- {prompt!r} ({getattr(out, 'finish_reason', '')})")
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "head-roles":
        return _head_roles(args)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
