"""Every `kv_policy` at one KV budget, and a kvserve backend for `demo_model.evaluate`.

Why: a policy's throughput gain means nothing without what it costs in quality, and
both must be measured at the *same* budget, through the engine's own code paths.

- `policy_config(name, budget)`: the parameters that give each policy a cache of about
  `budget` tokens — a token budget where the policy has one (snapkv: of the prompt,
  002 §3.2; pyramid: the mean per layer, 002 eq. 2), sink 4 + window budget − 4 for the
  streaming family (003; 000 Alg. 1 with C = S + W), h2o's recent window at 003's
  ratio (128 of 1024 = 1/8).
- `variant`: a name "<policy>:<way>" where the way changes what is kept, over a per-head
  pool (`EngineConfig.kv_layout="head"`, issue 65): `:head` (kv_policy `heads` uniform:
  each kv head its own top tokens), `:adaptive` (AdaKV: a layer's budget shared among
  its heads by score; the policies that rank by score, `ADAPTIVE_POLICIES`) and
  `:shared` (one set a layer, what the per-layer pool keeps, in per-head pages).
- `KVServeBackend`: the demo harness's `Backend` (`generate`) on an `EngineCore`, every
  request under one policy, so `demo_model.evaluate.needle` runs unchanged; and
  `score_continuations`, the teacher-forced perplexity protocol of
  000_8900623ad98b28fb.txt §4.1 (StreamingLLM-style: tokens fed one at a time through
  the bounded cache, the log-probability of each next token accumulated). The prompt
  half of each window is prefilled in the chunks the scheduler would give it (one chunk,
  or chunks of about the budget for a policy that bounds its prompt, evicting between
  them), so every policy treats the prompt exactly as in serving; then every
  continuation token is forced. Forwards go through `engine.runner.execute` and eviction through
  `EngineCore.policies.run` (scheduler/policy_runner.py, the engine's own eviction
  step): nothing here re-implements a policy or its bookkeeping.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.bench_common import drive
from benchmarks.needle_replay import NeedleReplay, needle_summary
from engine.sampling import SamplingParams
from engine.step import SeqInput
from kvpool.manager import MIN_PREFILL_CHUNK
from policies.catalog import CATALOG, build_policy
from scheduler.request import Request
from scheduler.resolve import resolve_request

# Every policy a per-layer pool runs (duo streams whole heads: a per-head pool and the
# model's head roles only, which the random-weight throughput model has none of)
POLICIES: tuple[str, ...] = tuple(n for n in CATALOG if n not in ("full", "duo"))
SINK = 4
# Ways that put a policy on a per-head pool (`--kv-layout head`), by its kv_policy `heads`
HEAD_WAYS: dict[str, str] = {"head": "uniform", "adaptive": "adaptive", "shared": "shared"}
# Policies whose `heads` may be "adaptive": those that rank tokens by a score
ADAPTIVE_POLICIES: tuple[str, ...] = tuple(
    n for n in POLICIES if getattr(CATALOG[n][0], "ADAPTIVE", False))


@functools.lru_cache(maxsize=2)
def load_data(model_dir: str):
    """`demo_model.evaluate.EvalData` without the training-split unigram counts (which
    tokenise the whole 9 MB training corpus and are only needed for bits-per-byte
    baselines): held-out documents, tokenizer and the needle generator, built exactly as
    `load_eval_data` builds them. Once a process (read-only; bench_kv_quant evaluates
    once per KV dtype)."""
    from collections import Counter

    import numpy as np
    from tokenizers import Tokenizer

    from demo_model.data import RecallGenerator, load_corpus
    from demo_model.evaluate import EvalData
    from demo_model.tokenizer import EOS

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    bos = tok.token_to_id(EOS)
    held = [d for d in load_corpus() if d.heldout]
    enc = tok.encode_batch([d.text for d in held], add_special_tokens=False)
    heldout = [(d.source, d.text, e.ids) for d, e in zip(held, enc)]
    filler = np.array([i for s, _, ids in heldout if s == "code" for i in ids], dtype=np.int32)
    gen = RecallGenerator(lambda s: tok.encode(s, add_special_tokens=False).ids, bos, filler)
    return EvalData(tok, heldout, Counter(), Counter(), bos, gen)


def ppl_windows(data, n: int, length: int) -> list[list[int]]:
    """`n` non-overlapping `length`-token windows of held-out text ([bos] + document),
    taken round-robin over documents (first windows of every document, then second
    ones …) so that topics, code and docstrings all contribute."""
    seqs = [[data.bos_id, *ids] for _, _, ids in data.heldout]
    out: list[list[int]] = []
    k = 0
    while len(out) < n and any(len(s) >= (k + 1) * length for s in seqs):
        out += [s[k * length:(k + 1) * length] for s in seqs if len(s) >= (k + 1) * length]
        k += 1
    return out[:n]


def policy_config(name: str, budget: int) -> dict[str, Any] | str:
    """`name`'s kv_policy with a cache of about `budget` tokens (see the module docstring).

    A variant "<policy>/<key>=<value>,...": the policy with those parameters changed, a
    value with a "." being a fraction of the budget ("knorm/window=0.5": half the budget
    is the protected recent window), so one spec means the same at every budget."""
    if "/" in name:
        base, _, opts = name.partition("/")
        cfg = policy_config(base, budget)
        assert isinstance(cfg, dict), name
        for opt in opts.split(","):
            k, _, v = opt.partition("=")
            cfg[k] = round(float(v) * budget) if "." in v else int(v)
        return cfg
    if name == "full":
        return "full"
    if name in ("streaming", "lazy_streaming"):
        return {"name": name, "sink": SINK, "window": max(1, budget - SINK)}
    cfg: dict[str, Any] = {"name": name, "budget": max(1, budget)}
    if name == "h2o":
        cfg["window"] = max(1, budget // 8)
    return cfg


def variant(name: str, budget: int) -> tuple[str, dict[str, Any] | str]:
    """(kv_layout, kv_policy) of `name`: `policy_config`'s, on a per-layer pool, or for
    "<name>:<way>" of `HEAD_WAYS` on a per-head pool with kv_policy `heads` set ("full:head":
    the full cache in per-head pages). Other ways (`:unbatched`, `:noring`) change how
    the engine runs a policy, not what it keeps: the plain policy's, per layer."""
    base, _, way = name.partition(":")
    cfg = policy_config(base, budget)
    if way not in HEAD_WAYS:
        return "layer", cfg
    if isinstance(cfg, dict):
        cfg["heads"] = HEAD_WAYS[way]
    return "head", cfg


def check_variant(name: str) -> str | None:
    """Why `name` ("<policy>[/<opts>][:<way>]") is no variant `variant` runs, or None."""
    base, _, way = name.partition(":")
    policy = base.partition("/")[0]
    if policy not in (*POLICIES, "full"):
        return f"{name}: no policy {policy!r}"
    if way == "adaptive" and policy not in ADAPTIVE_POLICIES:
        return (f"{name}: adaptive budgets need a policy that ranks by score "
                f"({', '.join(ADAPTIVE_POLICIES)})")
    if policy == "full" and way not in ("", "head"):
        return f"{name}: full runs per layer or per head (full:head) only here"
    return None


class KVServeBackend:
    """`demo_model.evaluate.Backend` over kvserve, every request under `kv_policy`."""

    def __init__(self, engine, kv_policy: Any = "full") -> None:
        self.engine = engine
        self.kv_policy = kv_policy
        self.max_context = engine.max_model_len
        self._n = 0

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        return self.generate_many([prompt_ids], max_new_tokens)[0]

    def score(self, ids: Sequence[int]) -> list[float]:
        """The harness contract (len(ids) - 1 log-probs): a one-token prompt, then every
        token forced through the bounded cache — exactly 000's protocol."""
        return self.score_continuations([ids], 1)[0]

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      policies: Sequence[Any] | None = None, progress: bool = False
                      ) -> list[list[int]]:
        """Greedy continuations (EOS ignored, as the reference backend) under continuous
        batching; `policies` gives each prompt its own kv_policy (default: ours)."""
        eng, ids = self.engine, []
        for i, p in enumerate(prompts):
            rid = f"eval-{self._n}"
            self._n += 1
            ids.append(rid)
            eng.add_request(rid, list(p), SamplingParams(
                max_tokens=max_new_tokens, temperature=0, ignore_eos=True, detokenize=False),
                kv_policy=resolve_request(eng.limits, policies[i] if policies is not None
                                          else self.kv_policy).kv_policy)
        outs: dict[str, list[int]] = {rid: [] for rid in ids}
        drive(eng, "generate", progress=progress, collect=outs)
        return [outs[rid] for rid in ids]

    def _forward(self, chunks: list, logits: bool) -> torch.Tensor | None:
        """One engine step over `chunks`, then the engine's own eviction step
        (`EngineCore.policies.run`); the last position's logits per chunk if asked."""
        eng = self.engine
        out = eng.runner.execute([
            SeqInput(c.request.token_slice(c.start, c.start + c.num_tokens),
                     c.start - c.request.pos_offset, c.slots, c.request.cache, logits,
                     c.request.policy is not None and c.request.policy.needs.attention,
                     query_stats=_query_stats(c.request))
            for c in chunks])
        for c in chunks:
            c.request.num_computed += c.num_tokens
        eng.policies.run(chunks, out.attention)
        return out.logits

    def score_continuations(self, windows: Sequence[Sequence[int]], prompt_len: int
                            ) -> list[list[float]]:
        """Per window, the natural-log probabilities of tokens prompt_len..end given all
        before them, under the policy (module docstring); windows run side by side."""
        eng, sched = self.engine, self.engine.scheduler
        reqs = []
        for i, w in enumerate(windows):
            cfg = resolve_request(eng.limits, self.kv_policy).kv_policy
            r = Request(f"score-{i}", list(w[:prompt_len]), SamplingParams(max_tokens=len(w)),
                        seed=0, arrival_time=0.0, kv_policy=cfg, policy_name=cfg.name,
                        policy=build_policy(cfg) if cfg.name != "full" else None,
                        rope_shift=getattr(cfg, "rope", "original") == "shift")
            r.cache = eng.kv.new_cache(len(w))
            reqs.append(r)
        logps: list[list[float]] = [[] for _ in windows]
        try:
            # The prompt's chunks but the last, in the lengths the engine gives them
            # (`KVCacheManager.prefill_chunk`: a bounded policy evicts between them).
            sizes = [eng.kv.prefill_chunk(r.policy, prompt_len, eng.config.max_num_batched_tokens)
                     for r in reqs]
            while ahead := [(r, n) for r, n in zip(reqs, sizes) if prompt_len - r.num_computed > n]:
                self._forward([sched._chunk(r, n) for r, n in ahead], logits=False)
            for j in range(max(len(w) for w in windows) - prompt_len):
                live = [i for i, w in enumerate(windows) if prompt_len + j < len(w)]
                chunks = []
                for i in live:
                    r = reqs[i]
                    if j:  # the true next token, as if it had been sampled
                        r.output_ids.append(windows[i][prompt_len + j - 1])
                    chunks.append(sched._chunk(r, r.num_tokens - r.num_computed))
                lp = torch.log_softmax(self._forward(chunks, logits=True), dim=-1).cpu()
                for row, i in enumerate(live):
                    logps[i].append(float(lp[row, windows[i][prompt_len + j]]))
        finally:
            for r in reqs:
                r.cache.release()
        return logps


def _query_stats(r: Request) -> tuple[int, int, bool] | None:
    """`SeqInput.query_stats` of r's step, as the engine's step launch sets it."""
    q = r.policy.needs.query_stats if r.policy is not None else None
    return None if q is None else (q[0], len(r.prompt_ids), q[1])


def evaluate_quality(args, progress: bool = True) -> dict:
    """Part 3 of bench_policies: PPL and needle accuracy per policy × budget (module doc)."""
    from tqdm import tqdm

    from demo_model.evaluate import TransformersBackend, needle
    from scheduler.engine_core import EngineConfig, EngineCore

    data = load_data(args.demo_model)
    windows = ppl_windows(data, args.ppl_windows, args.ppl_window)
    prompt_len = args.ppl_prompt
    recorder = NeedleReplay(0)
    needle_kw = dict(trials=args.needle_trials, seed=args.seed, lengths=args.needle_lengths,
                     tasks=args.needle_tasks, progress=False)
    needle(recorder, data, **needle_kw)
    prompts = recorder.prompts
    with open(os.path.join(args.demo_model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    per_seq = cfg["num_hidden_layers"] * (math.ceil(cfg["max_position_embeddings"] / 16) + 2)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])

    def engine(layout: str) -> EngineCore:  # room for every window and needle prompt at once
        return EngineCore(EngineConfig(  # a per-head pool: the same bytes in pages of one head
            model=args.demo_model, max_num_seqs=max(len(prompts), len(windows)),
            num_blocks=(len(prompts) + len(windows)) * per_seq * (heads if layout == "head" else 1),
            kv_layout=layout, enable_prefix_caching=False,
            kv_cache_dtype=getattr(args, "quality_kv_cache_dtype", "auto"),
            batch_policies=getattr(args, "quality_batch_policies", True),
            min_prefill_chunk=getattr(args, "quality_min_prefill_chunk", MIN_PREFILL_CHUNK)))

    eng = engine("layer")
    ref = TransformersBackend(args.demo_model)
    ref_lp = [ref.score(w)[prompt_len - 1:] for w in windows]
    out: dict = {"model": args.demo_model, "windows": len(windows), "window": args.ppl_window,
                 "kv_cache_dtype": eng.pool.storage.dtype_name,
                 "min_prefill_chunk": eng.config.min_prefill_chunk,
                 "prompt": prompt_len, "scored_tokens": sum(map(len, ref_lp)),
                 "needle_prompts": len(prompts), "needle": needle_kw,
                 "reference_ppl_transformers": math.exp(-sum(map(sum, ref_lp)) / sum(map(len, ref_lp))),
                 "rows": []}
    backends = {"layer": KVServeBackend(eng)}  # a per-head pool's once a variant needs it
    names = [*args.policies, *getattr(args, "quality_variants", [])]
    configs = [("full", 1.0)] + [(p, b) for b in args.quality_budgets for p in names]
    if any(n.partition(":")[2] in HEAD_WAYS for n in names):  # the per-head pool's own full
        configs.insert(1, ("full:head", 1.0))
    for name, frac in tqdm(configs, desc="quality", unit="config", disable=not progress):
        t = time.perf_counter()
        layout, kv = variant(name, round(frac * args.ppl_window))
        if layout not in backends:
            backends[layout] = KVServeBackend(engine(layout))
        backend = backends[layout]
        backend.kv_policy = kv
        lps = backend.score_continuations(windows, prompt_len)
        nll = -sum(map(sum, lps)) / sum(map(len, lps))
        per = [variant(name, round(frac * len(p)))[1] for p in prompts]
        replay = NeedleReplay(eng.max_model_len)
        replay.answers = backend.generate_many(prompts, 8, per)
        acc = needle(replay, data, **needle_kw)
        by_depth, mean = needle_summary(acc)
        out["rows"].append({
            "policy": name, "budget": frac, "kv_policy": backend.kv_policy, "kv_layout": layout,
            "budget_tokens": round(frac * args.ppl_window), "nll": nll, "ppl": math.exp(nll),
            "needle": acc, "needle_by_depth": by_depth, "needle_mean": mean,
            "wall_s": time.perf_counter() - t})
    if getattr(args, "kvpress_python", None):  # the same methods' kvpress presses
        from benchmarks import kvpress_compare

        out["kvpress"] = kvpress_compare.quality(args, data, windows, prompts, needle_kw,
                                                 [n.partition(":")[0] for n in args.policies])
    full = out["rows"][0]
    out["full_matches_reference"] = abs(full["ppl"] / out["reference_ppl_transformers"] - 1) < 1e-3
    return out


def _plain(names: list[str]) -> list[str]:
    """Policies without a `:<way>` that changes how the engine runs a policy, not what it
    keeps (`:unbatched`, `:noring`: quality is the plain policy's); the ways of a per-head
    pool (`HEAD_WAYS`) keep other tokens, and stay."""
    return [n for n in names if n.partition(":")[2] in ("", *HEAD_WAYS)]


def run_quality(args: argparse.Namespace) -> dict:
    """`evaluate_quality` for a benchmark driver (bench_policies, bench_kv_quant) on the
    plain policies of args.policies, or {"skipped": why} without the demo model or its
    harness (demo_model/, in a checkout only)."""
    msg = None
    if not os.path.exists(os.path.join(args.demo_model, "model.safetensors")):
        msg = (f"skipped: no demo model at {args.demo_model} (train it with "
               "`python -m demo_model.train`)")
    elif importlib.util.find_spec("demo_model") is None:  # not installed: a checkout's
        msg = ("skipped: the demo model's evaluation harness (demo_model/) is not "
               "installed; run from a kvserve checkout")
    if msg is not None:
        print(f"[quality] {msg}", flush=True)
        return {"skipped": msg}
    return evaluate_quality(argparse.Namespace(**{**vars(args), "policies": _plain(args.policies)}),
                            progress=not args.no_progress)
