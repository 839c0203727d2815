"""The engine step's host work at N decoding requests, and against another checkout.

    python -m benchmarks.bench_step_host --model 3m --running 64 --rounds 3
    python -m benchmarks.bench_step_host --base /tmp/base-checkout --rounds 3

Issue 18's figure: the share of a decode step spent outside the model forward
(scheduling, the decode append, sampling, advancing requests, policies) with `--running`
requests decoding, the same measure as `bench_offline --profile`'s "outside forward"
column; and the host share, which adds the runner's preparation of the step (its
inputs, slots and attention groups: host work inside the forward's time, timed from
`execute`'s call to the model's, so any checkout is measured alike). Why a benchmark of
its own: a change to that bookkeeping moves a 3M model's step by a few percent, under this machine's drift between two runs, so `--base` runs another
checkout's code (and its own build of the C++ ops) in a subprocess, interleaved with this
one round by round, and the table compares medians.

Each round builds the engine, starts `--running` requests of the same seeded prompts
(greedy, EOS ignored, long enough to outlive the round), steps until all decode, then
times `--steps` steps through `StepStats`. Threads are `kvserve generate`'s defaults
(`--threads`; `--cpu-wait poll` waits as `kvserve serve`'s threads do); `--detokenize`
makes the requests detokenize, as served ones do.
Writes JSON with the environment fingerprint; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from engine.cpu_threads import WAITS  # no torch: threads are set before it loads

NAME = "bench_step_host"
PARTS = ("forward_ms", "prepare_ms", "outside_ms", "schedule_advance_ms", "sample_ms",
         "policy_ms")


def measure(model: str, dtype: str, running: int, steps: int,
            kv_policy: str | None, detokenize: bool = False,
            kv_layout: str = "layer", block_size: int | None = None) -> dict[str, float]:
    """One engine, `running` requests decoding, `steps` steps timed: per-step means.
    `kv_layout`: the pool's pages (`EngineConfig.kv_layout`), its bytes the same;
    `block_size`: the tokens a page holds (None: the engine's default for the layout)."""
    from benchmarks.bench_offline_systems import Workload
    from engine.sampling import SamplingParams
    from loadtest.random_models import MODEL_CONFIGS, build_model
    from scheduler.llm import LLM
    from scheduler.resolve import resolve_request

    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as path:
        build_model(model, path)
        vocab = int(MODEL_CONFIGS[model]["vocab_size"])
        w = Workload.draw(running, (32, 500), (24, 256), vocab, seed=0)
        # the CPU engine's figure (issue 18): on a CUDA machine too (bench_gpu there)
        llm = LLM(path, dtype=dtype, kv_cache_memory="1GiB", max_num_seqs=running,
                  max_num_batched_tokens=2048, enable_prefix_caching=False, device="cpu",
                  kv_layout=kv_layout, block_size=block_size)
        eng, seen = llm.engine, []
        eng.on_step = seen.append
        policy = resolve_request(eng.limits, json.loads(kv_policy) if kv_policy else None
                                 ).kv_policy
        for i, p in enumerate(w.prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=steps + 200, temperature=0,
                                                       ignore_eos=True, detokenize=detokenize),
                            kv_policy=policy)
        while not seen or seen[-1].num_prefill_tokens or seen[-1].num_seqs < running:
            eng.step()
        for _ in range(8):  # past the first decode steps' one-time costs
            eng.step()
        seen.clear()
        prepare = _time_preparation(eng.runner)
        for _ in range(steps):
            eng.step()
        assert all(s.num_decode_tokens == running for s in seen), "a request left early"
        n = len(seen)
        total = sum(s.total_s for s in seen)
        forward = sum(s.forward_s for s in seen)
        prepared = sum(prepare)
        return {"step_ms": 1e3 * total / n, "forward_ms": 1e3 * forward / n,
                "outside_ms": 1e3 * (total - forward) / n,
                "schedule_advance_ms": 1e3 * sum(s.schedule_s for s in seen) / n,
                "sample_ms": 1e3 * sum(s.sample_s for s in seen) / n,
                "policy_ms": 1e3 * sum(s.policy_s for s in seen) / n,
                "outside_share": (total - forward) / total,
                "prepare_ms": 1e3 * prepared / n,
                "host_share": (total - forward + prepared) / total}


def _time_preparation(runner: object) -> list[float]:
    """Per step from now on, the seconds from the runner's `execute` call to its model's
    forward: the step's host preparation, inside StepStats' forward time. Timed from
    outside (a wrapper and a forward pre-hook), so a base checkout is measured alike."""
    got: list[float] = []
    start = [0.0]
    execute = runner.execute  # type: ignore[attr-defined]

    def timed(*args: object, **kwargs: object) -> object:
        start[0] = time.perf_counter()
        return execute(*args, **kwargs)

    runner.execute = timed  # type: ignore[attr-defined]
    runner.model.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda module, args: got.append(time.perf_counter() - start[0]))
    return got


def table(report: dict) -> str:
    rounds = report["rounds"]
    sides = ["this", "base"] if "base" in rounds[0] else ["this"]
    head = "| per decode step | " + " | ".join(
        f"{s} checkout (rounds)" for s in sides) + (" | base / this |" if len(sides) == 2 else " |")
    lines = [head, "|---" * (len(sides) + 1 + (len(sides) == 2)) + "|"]
    for key in ("step_ms", *PARTS, "outside_share", "host_share"):
        cells = []
        med = {}
        for side in sides:
            # a base checkout older than the field reports none
            xs = [r[side][key] for r in rounds if key in r[side]]
            med[side] = statistics.median(xs) if xs else None
            fmt = (lambda x: f"{100 * x:.1f}%") if key.endswith("_share") else (lambda x: f"{x:.3f}")
            cells.append(" / ".join(fmt(x) for x in xs) or "—")
        line = f"| {key.replace('_ms', ' ms').replace('_', ' ')} | " + " | ".join(cells) + " |"
        if len(sides) == 2:
            line += f" {med['base'] / med['this']:.2f}× |" if med["this"] and med["base"] else " — |"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="3m", help="a random_models config (3m, 160m, tiny)")
    p.add_argument("--dtype", default="float32", help="the model's dtype (and the pool's)")
    p.add_argument("--running", type=int, default=64, help="requests decoding")
    p.add_argument("--steps", type=int, default=200, help="steps timed per round")
    p.add_argument("--kv-policy", help="a kv_policy (JSON) for every request; default full")
    p.add_argument("--kv-layout", default="layer", choices=("layer", "head"),
                   help="the pool's pages: one layer's every kv head, or one (layer, kv "
                        "head) (issue 65; bench_kv_layout sets them side by side)")
    p.add_argument("--detokenize", action="store_true",
                   help="requests detokenize their tokens, as a served request does")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: cores)")
    p.add_argument("--cpu-wait", choices=WAITS, default="spin",
                   help="how idle intra-op threads wait: spin (`kvserve generate`'s default), "
                        "poll (`kvserve serve`'s) or passive")
    p.add_argument("--base", help="another checkout to run the same way, interleaved")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each: this, then base)")
    p.add_argument("--out", default="runs/")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # measure once, JSON to this path
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    from benchmarks.bench_common import pin_threads
    from engine import cpu_threads

    threads = a.threads or cpu_threads.plan(None, None).threads
    choice = pin_threads(f"benchmarks.{NAME}", threads, argv, default_wait=a.cpu_wait)
    args = (a.model, a.dtype, a.running, a.steps, a.kv_policy, a.detokenize, a.kv_layout)
    if a.worker:
        with open(a.worker, "w", encoding="utf-8") as f:
            json.dump(measure(*args), f)
        return {}
    from benchmarks.bench_common import ab_rounds
    from loadtest.fingerprint import fingerprint

    shown = sys.argv[1:] if argv is None else argv
    report: dict = {"benchmark": NAME, "command": f"python -m benchmarks.{NAME} " + shlex.join(shown),
                    "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
                    "threads": choice, "settings": vars(a), "rounds": []}
    same = ["--model", a.model, "--dtype", a.dtype, "--running", str(a.running), "--steps", str(a.steps),
            "--threads", str(threads), "--cpu-wait", a.cpu_wait, *(["--kv-policy", a.kv_policy] if a.kv_policy else []),
            *(["--detokenize"] if a.detokenize else []),
            *(["--kv-layout", a.kv_layout] if a.kv_layout != "layer" else [])]
    def say(got: dict) -> str:
        line = f"outside forward {100 * got['this']['outside_share']:.1f}%"
        return line + (f" (base {100 * got['base']['outside_share']:.1f}%)" if "base" in got else "")

    return ab_rounds(NAME, report, a.out, a.rounds, a.base, __file__, same,
                     lambda: measure(*args), table, say)

if __name__ == "__main__":
    main()
