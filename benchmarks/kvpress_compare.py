"""kvpress rows for the quality part of bench_policies: the same method's reference press
on the same windows, needle prompts and budgets (issue 20).

Why: "policy X is weak on this model" is a claim about the method, which only the
method's reference implementation can back; "ours is worse than kvpress's" is a bug
report. kvpress lives in its own venv (older transformers), so the exchange is a JSON
file both sides read and write, and kvserve's side never imports kvpress:

- `exchange`: what `benchmarks/kvpress_quality.py` needs — the model directory, the
  perplexity windows and prompt length, the budget fractions, the needle prompts and the
  answer length — exactly the inputs `policy_eval.evaluate_quality` gives our policies.
- `run`: that script under the venv's python (thread count pinned, our PYTHONPATH not
  passed), or `{"skipped": why}` when the venv is missing, as the vLLM rows are.
- `rows`: its output as quality rows in our format — perplexity from the summed
  log-likelihoods, needle accuracy scored by replaying the answers through
  `demo_model.evaluate.needle` (`needle_replay.NeedleReplay`), so both sides are scored
  by the same rule.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.needle_replay import NeedleReplay, needle_summary

DEFAULT_PYTHON = ".venv-kvpress/bin/python"
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvpress_quality.py")
# Our methods with a kvpress press (kvpress_quality.PRESSES, which imports torch only)
METHODS: dict[str, str] = {
    "streaming": "StreamingLLMPress", "knorm": "KnormPress", "keydiff": "KeyDiffPress",
    "tova": "TOVAPress", "snapkv": "SnapKVPress", "pyramid": "PyramidKVPress",
    "h2o": "ObservedAttentionPress", "expected_attention": "ExpectedAttentionPress"}
# ... whose press keeps a set per kv head where we keep one per layer: also run ranked by
# the head mean of its score ("<m>@layer", kvpress_quality.head_mean), which isolates
# the cost of that constraint from any other difference
PER_HEAD = ("knorm", "keydiff", "snapkv", "pyramid", "h2o", "expected_attention")
# ... whose press kvpress's AdaKVPress can wrap (kvpress_quality.ADAKV): "<m>@adakv" runs
# beside our "<m>:adaptive" (issue 65) when the run has that row
ADAKV = ("knorm", "keydiff", "tova", "snapkv", "expected_attention")


def missing(python: str) -> str | None:
    """Why the kvpress rows cannot run from `python` (printed in their place), or None."""
    if not os.access(python, os.X_OK):
        return (f"kvpress rows skipped: no kvpress venv at {python} (`make kvpress-venv` "
                "creates .venv-kvpress; --kvpress-python PATH names another)")
    return None


def exchange(model: str, windows: Sequence[Sequence[int]], prompt_len: int,
             budgets: Sequence[float], needle_prompts: Sequence[Sequence[int]],
             max_new_tokens: int = 8) -> dict[str, Any]:
    """The exchange file's content (module docstring); plain lists, so JSON."""
    return {"model": os.path.abspath(model), "windows": [list(w) for w in windows],
            "prompt_len": prompt_len, "budgets": list(budgets),
            "needle_prompts": [list(p) for p in needle_prompts],
            "max_new_tokens": max_new_tokens}


def run(python: str, ex: dict[str, Any], methods: Sequence[str], threads: int = 1
        ) -> dict[str, Any]:
    """kvpress_quality.py on `ex` in its venv; its JSON, or {"skipped": why}."""
    why = missing(python)
    if why is not None:
        return {"skipped": why}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="kvpress-") as tmp:
        src, dst = os.path.join(tmp, "exchange.json"), os.path.join(tmp, "out.json")
        with open(src, "w", encoding="utf-8") as f:
            json.dump(ex, f)
        t = time.perf_counter()
        subprocess.run([python, SCRIPT, "--exchange", src, "--out", dst, "--threads",
                        str(threads), "--methods", ",".join(methods)],
                       env=env, check=True, stdout=sys.stdout, stderr=sys.stderr)
        with open(dst, encoding="utf-8") as f:
            out = json.load(f)
    out["python"], out["wall_s"] = python, time.perf_counter() - t
    return out


def rows(result: dict[str, Any], data, needle_kw: dict[str, Any]) -> list[dict[str, Any]]:
    """kvpress_quality.py's rows as quality rows (`policy` "kvpress <Press>", `method`
    our policy's name, "full" for the no-press row), needle answers scored by the
    harness's own rule."""
    from demo_model.evaluate import needle

    out = []
    for r in result["rows"]:
        replay = NeedleReplay(0)
        replay.answers = [list(a) for a in r["needle_answers"]]
        acc = needle(replay, data, **needle_kw)
        by_depth, mean = needle_summary(acc)
        out.append({
            "policy": "kvpress full" if r["method"] == "full" else f"kvpress {r['press']}",
            "method": r["method"], "budget": r["budget"], "budget_tokens": r["budget_tokens"],
            "kv_policy": {"press": r["press"], "protocol": r["protocol"]},
            "protocol": r["protocol"], "nll": r["nll"], "ppl": math.exp(r["nll"]),
            "max_cache_after_step": r["max_cache_after_step"], "needle": acc,
            "needle_by_depth": by_depth, "needle_mean": mean, "wall_s": r["wall_s"]})
    return out


def quality(args, data, windows: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
            needle_kw: dict[str, Any], policies: Sequence[str]) -> dict[str, Any]:
    """The `kvpress` block of the quality report: the presses of `policies` that have one,
    at args.quality_budgets, with the full-cache row; or {"skipped": why}. AdaKV rows
    (`ADAKV`) for the policies args.policies runs "<m>:adaptive"."""
    methods = [m for m in METHODS if m in policies]
    adaptive = {n.partition(":")[0] for n in getattr(args, "policies", ())
                if n.partition(":")[2] == "adaptive"}
    methods += [f"{m}@layer" for m in methods if m in PER_HEAD]
    methods += [f"{m}@adakv" for m in METHODS if m in ADAKV and m in adaptive]
    if not methods:
        return {"skipped": "kvpress rows skipped: no policy with a kvpress press"}
    ex = exchange(args.demo_model, windows, args.ppl_prompt, args.quality_budgets, prompts)
    res = run(args.kvpress_python, ex, methods, getattr(args, "threads", 1))
    if "skipped" in res:
        print(f"[quality] {res['skipped']}", flush=True)
        return res
    return {"versions": res["versions"], "python": res["python"], "wall_s": res["wall_s"],
            "rows": rows(res, data, needle_kw)}
