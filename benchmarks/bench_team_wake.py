"""Small ops on one thread against the whole team, as a decode step streams them.

    python -m benchmarks.bench_team_wake --cpu-wait passive --base /tmp/base-checkout

Why: with sleeping intra-op threads (`--cpu-wait passive`, engine/cpu_threads.py) every
parallel region wakes the team, ~20-40 us here, and a demo-model decode step opened ~21
of them for ops of 40-150 us. native/csrc/team.h (`sleeps()`) keeps small linear layers and
paged-decode calls on the calling thread; this measures each op of the demo (3m) and
160M shapes at decode sizes with one thread and with `--threads`, in this checkout and
(`--base`) in another, interleaved round by round. Operands cycle through 64 MB
(`--cycle-mb`), so each call reads its weight or K/V from DRAM as a step does (a layer
timed alone stays in cache and favoured one thread far more). Writes JSON with the
environment fingerprint; prints a markdown table (medians over rounds, us a call).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from functools import partial

from engine.cpu_threads import WAITS  # no torch: threads are set before it loads

NAME = "bench_team_wake"
# (in, out) of the demo model's layers (qkv, o, gate+up, down, LM head) and some of 160M's
LINEARS = [(256, 384), (256, 256), (256, 1376), (688, 256), (256, 4096), (768, 768),
           (768, 2304)]
# (query heads, kv heads, head dim, model), sequences, tokens each
DECODES = [((8, 2, 32, "3m"), b, n) for b in (1, 4) for n in (128, 512, 1024)] + \
          [((12, 12, 64, "160m"), b, n) for b in (1, 4) for n in (32, 128, 512)]


def _time(calls: list, rounds: int = 4) -> float:
    """Best mean over `rounds` passes through `calls` (each a different operand), us."""
    for f in calls:
        f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for f in calls:
            f()
        best = min(best, (time.perf_counter() - t0) / len(calls))
    return best * 1e6


def measure(threads: int, cycle_mb: int) -> dict[str, dict[str, float]]:
    import torch

    from attention import cpu_attention
    from engine.cpu_linear import PanelLinear, panels_available

    got: dict[str, dict[str, float]] = {}
    cycle = cycle_mb << 20

    def both(name: str, calls: list) -> None:
        got[name] = {}
        for n in (1, threads):
            torch.set_num_threads(n)
            got[name][str(n)] = _time(calls)

    if panels_available():
        for k, n in LINEARS:
            copies = max(2, cycle // (k * n * 4))
            layers = [PanelLinear(torch.nn.Linear(k, n, bias=False)) for _ in range(copies)]
            for m in (1, 4):
                x = torch.randn(m, k)
                both(f"linear {k}x{n}, {m} row{'s' * (m > 1)}", [partial(f, x) for f in layers])
    if cpu_attention.kernel_available():  # builds and loads the op
        op, bs = torch.ops.kvserve.paged_decode, 16
        for (hq, hkv, d, model), b, n in DECODES:
            nb = -(-n // bs)
            copies = max(2, cycle // (2 * b * n * hkv * d * 4))
            caches = [(torch.randn(b * nb, bs, hkv, d), torch.randn(b * nb, bs, hkv, d))
                      for _ in range(copies)]
            table = torch.arange(b * nb).view(b, nb)
            slot_pos = torch.arange(nb * bs).repeat(b, 1)
            q_pos, q = torch.full((b,), n - 1), torch.randn(b, hq, d)
            both(f"paged decode {model}, {b} x {n} tokens",
                 [partial(op, q, k, v, table, slot_pos, q_pos, 0.1, 0, False)
                  for k, v in caches])
    torch.set_num_threads(threads)
    return got


def table(report: dict) -> str:
    rounds, n = report["rounds"], report["threads"]["threads"]
    sides = ["this", "base"] if "base" in rounds[0] else ["this"]
    head = f"| op (us a call) | 1 thread | {n} threads |"
    if len(sides) == 2:
        head += f" {n} threads, base | base / this |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    def med(side: str, case: str, key: str) -> float:
        return statistics.median(r[side][case][key] for r in rounds)

    for case in rounds[0]["this"]:
        one, many = med("this", case, "1"), med("this", case, str(n))
        line = f"| {case} | {one:.1f} | {many:.1f} |"
        if len(sides) == 2:
            base = med("base", case, str(n))
            line += f" {base:.1f} | {base / many:.2f}× |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-wait", choices=WAITS, default="passive",
                   help="how idle intra-op threads wait: passive (`kvserve serve`'s default) "
                        "or spin (`kvserve generate`'s)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: cores)")
    p.add_argument("--cycle-mb", type=int, default=64,
                   help="operands cycled through per op (past the L3: from DRAM, as in a step)")
    p.add_argument("--base", help="another checkout to run the same way, interleaved")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each: this, then base)")
    p.add_argument("--out", default="runs/")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # measure once, JSON to this path
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from benchmarks.bench_common import ab_rounds, pin_threads
    from engine import cpu_threads

    threads = a.threads or cpu_threads.plan(None, None).threads
    choice = pin_threads(f"benchmarks.{NAME}", threads, argv, default_wait=a.cpu_wait)
    if a.worker:
        import json

        with open(a.worker, "w", encoding="utf-8") as f:
            json.dump(measure(threads, a.cycle_mb), f)
        return {}
    from loadtest.fingerprint import fingerprint

    shown = sys.argv[1:] if argv is None else argv
    report: dict = {"benchmark": NAME, "command": f"python -m benchmarks.{NAME} " + shlex.join(shown),
                    "fingerprint": {**fingerprint(), "loadavg_at_start": os.getloadavg()},
                    "threads": choice, "settings": vars(a), "rounds": []}
    same = ["--threads", str(threads), "--cpu-wait", a.cpu_wait, "--cycle-mb", str(a.cycle_mb)]
    return ab_rounds(NAME, report, a.out, a.rounds, a.base, __file__, same,
                     lambda: measure(threads, a.cycle_mb), table)


if __name__ == "__main__":
    main()
