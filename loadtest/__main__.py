"""`python -m loadtest` (or `python -m loadtest serve`): load any OpenAI-compatible server.

    python -m loadtest --base-url http://127.0.0.1:8000 --concurrency 1,8,32 \\
        --num-prompts 64 --goodput ttft:500 tpot:100 --result-json runs/serve.json
    python -m loadtest --request-rate 2,4,8 --arrival gamma --burstiness 0.5
    python -m loadtest soak --spawn --minutes 10          # see loadtest/soak.py

Closed loop with --concurrency (a comma list sweeps), open loop with --request-rate
(req/s, `inf` = all at once; a list sweeps; --max-concurrency caps requests in flight).
Prints vLLM's summary block per level; writes a JSON result (with an environment
fingerprint) and plots. See docs/loadtest.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from datetime import datetime, timezone
from typing import Any

import httpx

from loadtest.client import first_model
from loadtest.metrics import format_summary, parse_goodput
from loadtest.options import (
    add_target_args,
    add_workload_args,
    client_from_args,
    floats,
    workload_from_args,
)
from loadtest.report import environment, plot_run, server_info, write_json
from loadtest.runner import RunConfig, run_sweep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    add_target_args(p)
    add_workload_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", default=None,
                   help="closed loop: requests in flight, a comma list sweeps (default 8)")
    g.add_argument("--request-rate", default=None,
                   help="open loop: requests/s (inf = all at once), a comma list sweeps")
    g.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape (1 = Poisson; < 1 burstier)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: cap on requests in flight")
    g.add_argument("--prompts-per-concurrency", type=int, default=0, metavar="K",
                   help="closed loop: at least K x concurrency requests per level")
    g.add_argument("--duration-limit", type=float, default=600.0,
                   help="seconds per level after which no new request is sent")
    g.add_argument("--warmup", type=int, default=0, help="unmeasured requests before each level")
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--metric-percentiles", default="90,99")
    g.add_argument("--result-json", default=None, help="write the result here")
    g.add_argument("--plots", default=None, metavar="PREFIX",
                   help="write PREFIX_cdf.png, PREFIX_sweep.png, PREFIX_tags.png")
    g.add_argument("--save-detailed", action="store_true",
                   help="keep every request's inter-token latencies in the JSON")
    g.add_argument("--label", default=None, help="a name stored in the result")
    g.add_argument("--no-progress", action="store_true")
    return p


def run_config(a: argparse.Namespace) -> tuple[RunConfig, list[float]]:
    if a.request_rate is not None and a.concurrency is not None:
        raise SystemExit("give --concurrency (closed loop) or --request-rate (open loop)")
    cfg = RunConfig(base_url=a.base_url.rstrip("/"), client=client_from_args(a),
                    request_timeout=a.request_timeout, duration_limit=a.duration_limit,
                    warmup=a.warmup, seed=a.seed, progress=not a.no_progress,
                    slos=parse_goodput(a.goodput),
                    percentiles=tuple(floats(a.metric_percentiles)))
    if a.request_rate is not None:
        cfg.mode, cfg.concurrency = "open", a.max_concurrency
        cfg.arrival, cfg.burstiness = a.arrival, a.burstiness
        return cfg, floats(a.request_rate)
    cfg.mode = "closed"
    return cfg, floats(a.concurrency or "8")


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    cfg, levels = run_config(a)
    if cfg.client.model is None:
        async with httpx.AsyncClient(timeout=10) as c:
            cfg.client.model = await first_model(c, cfg.base_url, cfg.client.headers)
    workload, maker = workload_from_args(a)
    k = a.prompts_per_concurrency

    def per_level(level: float) -> int:
        if cfg.mode == "closed" and k:
            return max(a.num_prompts, int(k * level))
        return a.num_prompts

    def show(level: dict[str, Any]) -> None:
        print(f"\n[{level['summary']['label']}]", flush=True)
        print(format_summary(level["summary"]), flush=True)

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result = {"benchmark": "serve", "label": a.label, "date_utc": started,
              "command": "python -m loadtest " + " ".join(a.argv),
              "server": server_info(cfg.base_url), "environment": environment(),
              "config": {key: v for key, v in vars(a).items() if key != "argv"},
              "levels": await run_sweep(workload, cfg, levels, per_level, maker, show)}
    if not a.save_detailed:
        for lv in result["levels"]:
            lv.pop("itl", None)
    return result


def print_table(result: dict[str, Any]) -> None:
    sums = [lv["summary"] for lv in result["levels"]]
    if len(sums) < 2:
        return
    print(f"\n{'level':<36} {'ok':>5} {'fail':>5} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'E2EL p99':>9}")
    for s in sums:
        print(f"{s['label']:<36} {s['completed']:>5} {s['failed']:>5} "
              f"{s['output_throughput']:>10.1f} {s['ttft_ms']['median']:>9.1f} "
              f"{s['ttft_ms'].get('p99', math.nan):>9.1f} {s['tpot_ms']['median']:>9.1f} "
              f"{s['e2el_ms'].get('p99', math.nan):>9.1f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["soak"]:
        from loadtest.soak import main as soak_main

        return soak_main(argv[1:])
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    a = build_parser().parse_args(argv)
    a.argv = argv
    result = asyncio.run(bench(a))
    print_table(result)
    if a.result_json:
        print(f"wrote {write_json(result, a.result_json)}")
    if a.plots:
        print("wrote " + ", ".join(plot_run(result, a.plots)))
    failed = sum(lv["summary"]["failed"] for lv in result["levels"])
    return 1 if failed and not any(lv["summary"]["completed"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
