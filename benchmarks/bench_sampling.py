"""What the per-request sampling features cost a decode step: penalties, a logit bias,
a grammar (structured outputs), temperature sampling, each against greedy.

    python -m benchmarks.bench_sampling --requests 16,64

Why: greedy rows take their argmax from the LM head's own op (no logits written); any of
these features makes a step write the logits and change them on the host side
(engine/penalties.py: the rows' seen (row, token) pairs; engine/structured.py: a matcher
per row and a bitmask). One engine per batch size runs every variant in turn, in reverse
order every other round (`--rounds`), the same prompts and lengths; a variant's figure
is the median over rounds of its mean decode step (steps with every request decoding).
Then the top-k / top-p step alone, its C++ op against the torch form's sort. Writes JSON
with the environment fingerprint, tables into docs/benchmarks.md and a plot.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

from benchmarks import bench_common as bc
from benchmarks.bench_sampling_report import plot, render
from engine.sampling import SamplingParams, StructuredOutput
from loadtest.random_models import FIRST_TOKEN_ID, MODEL_CONFIGS, build_model
from scheduler.engine_core import EngineConfig, EngineCore

NAME = "bench_sampling"
FIRST = FIRST_TOKEN_ID
DOC_HEADING = "## Sampling features: the step they cost"
# name -> (what it is, SamplingParams fields beside max_tokens / ignore_eos)
VARIANTS: dict[str, tuple[str, dict]] = {
    "greedy": ("greedy", {"temperature": 0.0}),
    "sampled": ("temperature 0.8, top-p 0.95", {"temperature": 0.8, "top_p": 0.95}),
    "logit_bias": ("greedy, a bias on 2 ids", {"temperature": 0.0,
                                               "logit_bias": {FIRST: -2.0, FIRST + 1: 1.0}}),
    "penalties": ("greedy, repetition 1.1, frequency 0.3, presence 0.2",
                  {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.3,
                   "presence_penalty": 0.2}),
    "grammar": ("greedy, regex [a-z]+ (xgrammar)",
                {"temperature": 0.0, "structured": StructuredOutput("regex", "[a-z]+")}),
}


def _has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _run(eng: EngineCore, fields: dict, n: int, args: argparse.Namespace, vocab: int,
         tag: str) -> dict:
    rng = random.Random(args.seed)
    for i in range(n):
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.prompt)]
        eng.add_request(f"{tag}-{i}", prompt, SamplingParams(
            max_tokens=args.gen, ignore_eos=True, detokenize=False, seed=i, **fields))
    d = bc.drive(eng, tag, progress=not args.no_progress)
    sel = [s for s in d.steps if s.num_seqs == n and s.num_prefill_tokens == 0]
    total = sum(s.total_s for s in sel)
    return {"steps": len(sel), "mean_step_s": total / max(1, len(sel)),
            "sample_s": sum(s.sample_s for s in sel) / max(1, len(sel)),
            "tok_per_s": d.output_tokens / d.wall_s}


def measure(path: str, args: argparse.Namespace, vocab: int) -> list[dict]:
    names = args.variants
    rows = []
    for n in args.requests:
        blocks = n * int(MODEL_CONFIGS[args.model]["num_hidden_layers"]) * (
            -(-(args.prompt + args.gen) // 16) + 2)
        eng = EngineCore(EngineConfig(model=path, num_blocks=blocks, max_num_seqs=n,
                                      enable_prefix_caching=False))
        runs: dict[str, list[dict]] = {}
        for k in range(args.rounds):
            for name in names[::-1] if k % 2 else names:
                runs.setdefault(name, []).append(
                    _run(eng, VARIANTS[name][1], n, args, vocab, f"{name} n={n} r{k}"))
        base = statistics.median(r["mean_step_s"] for r in runs["greedy"])
        for name in names:
            rs = runs[name]
            step = statistics.median(r["mean_step_s"] for r in rs)
            rows.append({"variant": name, "what": VARIANTS[name][0], "requests": n,
                         "mean_step_s": step,
                         "vs_greedy": step / base,
                         "sample_s": statistics.median(r["sample_s"] for r in rs),
                         "tok_per_s": statistics.median(r["tok_per_s"] for r in rs),
                         "steps": rs[0]["steps"], "by_round": [r["mean_step_s"] for r in rs]})
    return rows


def measure_truncate(args: argparse.Namespace) -> list[dict]:
    """The top-k / top-p step alone (engine/sampler.py `truncate`): its C++ op against
    the torch form's whole-row sort, on the same [rows, vocab] probabilities, alternated
    call by call; flat rows (a random-weight model's: the nucleus is most of the
    vocabulary) and peaked ones (a trained model's: a few dozen tokens)."""
    import torch

    from engine import sampler

    if not sampler.load_sampling_ops():
        return []
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for vocab in args.truncate_vocabs:
        for shape, scale in (("flat", 0.01), ("peaked", 20.0)):
            probs = torch.softmax(torch.randn(args.truncate_rows, vocab, generator=g) * scale, -1)
            top_k = torch.zeros(args.truncate_rows, dtype=torch.int64)
            top_p = torch.full((args.truncate_rows,), 0.95)
            times: dict[str, list[float]] = {"op": [], "torch": []}
            for _ in range(args.truncate_calls):
                for form in ("op", "torch"):
                    t0 = time.perf_counter()
                    sampler.truncate(probs, top_k, top_p, native=form == "op")
                    times[form].append(time.perf_counter() - t0)
            op, ref = statistics.median(times["op"]), statistics.median(times["torch"])
            out.append({"vocab": vocab, "rows": args.truncate_rows, "shape": shape,
                        "op_s": op, "torch_s": ref, "speedup": ref / op})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="3m")
    p.add_argument("--requests", default="16,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="a comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--truncate-vocabs", default="4096,32000")
    p.add_argument("--truncate-rows", type=int, default=64)
    p.add_argument("--truncate-calls", type=int, default=5)
    bc.add_run_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.requests, a.prompt, a.gen, a.rounds = "tiny", "2,4", 8, 8, 1
        a.truncate_vocabs, a.truncate_rows, a.truncate_calls = "300", 4, 1
    a.truncate_vocabs = [int(x) for x in a.truncate_vocabs.split(",")]
    a.command = f"python -m benchmarks.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    a.requests = [int(x) for x in a.requests.split(",")]
    a.variants = ["greedy", *(v for v in a.variants.split(",") if v != "greedy")]
    if unknown := [v for v in a.variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    bc.default_paths(a, NAME)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = bc.new_report(NAME, args, ("model", "requests", "prompt", "gen", "rounds",
                                        "variants", "truncate_vocabs", "truncate_rows",
                                        "truncate_calls", "seed", "threads"))
    if not _has_xgrammar():
        args.variants = [v for v in args.variants if "structured" not in VARIANTS[v][1]]
        report["skipped"] = "The grammar variant needs xgrammar (pip install 'kvserve[structured]')."
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sampling-") as tmp:
        path = os.path.join(tmp, args.model)
        report["params"] = build_model(args.model, path)
        report["rows"] = measure(path, args, int(MODEL_CONFIGS[args.model]["vocab_size"]))
    report["truncate"] = measure_truncate(args)
    report["bench_wall_s"] = time.perf_counter() - t0
    bc.publish(report, args, NAME, DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
