"""Hybrid memory (issue 66): requests a fixed pool holds at once on a Gemma-3-shaped model,
its local layers kept to their window (kvpool/windows.py) against kept whole.

Gemma 3 interleaves 5 sliding-window ("local") layers of 1,024 tokens with 1 global
layer. With hybrid memory a request of 8k tokens holds its global layer's 512 pages and
each local layer's window (65 pages in decode), 837 pages against 3,072, so a pool
should hold ~3.7× the requests at once. The model here has that shape and few hidden
dims (random weights: the count is about memory, not text), so both runs fit a 2-core
CPU in minutes. The same requests (8k contexts: a 7,872-token prompt and 320 generated
tokens each, all submitted at once) run through the offline engine in a pool of
`--pool-contexts` whole contexts, once with `hybrid_kv_cache` on and once off; reported:
the most requests decoding at once (past their prompt, so holding their whole context),
the most running, the mean running over the run's steps, preemptions, peak pages per
request and the wall time.

    python -m benchmarks.bench_hybrid_memory --out runs/
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

import torch

from benchmarks import bench_common as bc
from engine.sampling import SamplingParams
from kvpool.windows import request_blocks
from loadtest.random_models import FIRST_TOKEN_ID, make_word_tokenizer
from scheduler.engine_core import EngineConfig, EngineCore

NAME = "bench_hybrid_memory"
DOC_HEADING = "## Hybrid memory (sliding-window layers)"
MODES = {"windowed": True, "whole": False}  # name -> EngineConfig.hybrid_kv_cache


def build_gemma3(path: str, args: argparse.Namespace) -> dict:
    """A random Gemma 3 text model of the served shape (5 local : 1 global, the window,
    the context) and few hidden dims, with a word tokenizer; returns its config."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  query_pre_attn_scalar=32, sliding_window=args.window,
                  sliding_window_pattern=6, max_position_embeddings=args.context,
                  vocab_size=512, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    torch.manual_seed(args.seed)
    Gemma3ForCausalLM(Gemma3TextConfig(**fields)).save_pretrained(path)
    make_word_tokenizer(int(fields["vocab_size"])).save_pretrained(path)
    return fields


def run(path: str, args: argparse.Namespace, hybrid: bool, num_blocks: int,
        work: list[list[int]]) -> dict:
    eng = EngineCore(EngineConfig(
        model=path, num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=len(work),
        max_num_batched_tokens=args.chunk, max_model_len=args.context,
        enable_prefix_caching=False, hybrid_kv_cache=hybrid, seed=args.seed))
    params = SamplingParams(max_tokens=args.context - args.prompt, temperature=0,
                            ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(work):
        eng.add_request(f"r{i}", prompt, params)
    decoding: list[int] = []
    running: list[int] = []
    peak: dict[str, int] = {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished and o.kv is not None:
                peak[o.request_id] = o.kv.peak_blocks
        held = eng.scheduler.running
        running.append(len(held))
        # past the prompt: holding the whole context computed so far
        decoding.append(sum(r.num_computed >= len(r.prompt_ids) for r in held))
    wall = time.perf_counter() - t0
    st = eng.stats()
    out = {"hybrid_kv_cache": hybrid, "wall_s": wall, "steps": len(running),
           "max_decoding": max(decoding), "max_running": max(running),
           "mean_running": sum(running) / len(running),
           "preemptions": dict(st.preemptions_total), "peak_blocks": max(peak.values()),
           "finished": len(peak), "decoding_per_step": decoding}
    print(f"[{'windowed' if hybrid else 'whole'}] at once: {out['max_decoding']} decoding, "
          f"{out['max_running']} running; preemptions {out['preemptions']}, peak "
          f"{out['peak_blocks']} pages a request, {wall:.0f} s", flush=True)
    return out


def render(report: dict) -> str:
    r = report["runs"]
    w, h = r["windowed"], r["whole"]
    rows = ["| local layers | decoding at once | running at once | mean running | "
            "preemptions | peak pages / request |", "|---|---|---|---|---|---|"]
    for name, x in (("windowed", w), ("whole", h)):
        rows.append(f"| {name} | {x['max_decoding']} | {x['max_running']} | "
                    f"{x['mean_running']:.1f} | {sum(x['preemptions'].values())} | "
                    f"{x['peak_blocks']:,} |")
    link, _ = bc.links(report, NAME)
    return "\n".join(rows) + (f"\n\n**{report['ratio']:.2f}×** the requests at once. "
                              + bc.environment_line(report, link))


def plot(report: dict, path: str) -> None:
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    for name, x in report["runs"].items():
        ax.plot(x["decoding_per_step"], label=f"{name} local layers")
    ax.set_xlabel("engine step")
    ax.set_ylabel("requests decoding")
    ax.legend()
    bc.save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=7872)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--pool-contexts", type=float, default=4.0,
                   help="the pool, in whole contexts of every layer (plus the watermark)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    bc.add_run_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.window, a.context, a.prompt, a.requests, a.chunk = 64, 512, 448, 12, 64
    a.command = f"python -m benchmarks.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    bc.default_paths(a, NAME)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bc.pin_threads(f"benchmarks.{NAME}", args.threads, argv)
    report = bc.new_report(NAME, args, ("window", "context", "prompt", "requests",
                                        "pool_contexts", "block_size", "chunk", "seed",
                                        "threads"))
    rng = random.Random(args.seed)
    work = [[rng.randrange(FIRST_TOKEN_ID, 512) for _ in range(args.prompt)]
            for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as tmp:
        report["model"] = build_gemma3(tmp, args)
        layers = report["model"]["num_hidden_layers"]
        whole = request_blocks(args.context, [None] * layers, args.chunk, args.block_size)
        windows = [args.window] * (layers - 1) + [None]
        num_blocks = round(args.pool_contexts * whole / (1 - 0.01))  # the watermark beside
        report["pool"] = {"num_blocks": num_blocks, "whole_request_blocks": whole,
                          "windowed_request_blocks": request_blocks(
                              args.context, windows, args.chunk, args.block_size),
                          "windowed_decode_blocks": request_blocks(
                              args.context, windows, 1, args.block_size)}
        report["runs"] = {name: run(tmp, args, hybrid, num_blocks, work)
                          for name, hybrid in MODES.items()}
    runs = report["runs"]
    report["ratio"] = runs["windowed"]["max_decoding"] / runs["whole"]["max_decoding"]
    print(f"windowed local layers hold {report['ratio']:.2f}x the requests at once", flush=True)
    bc.publish(report, args, NAME, DOC_HEADING, render, plot)
    return report


if __name__ == "__main__":
    main()
