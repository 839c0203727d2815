"""Closed-loop (fixed concurrency) and open-loop (Poisson / gamma arrivals) runs, and
sweeps over either. Every run is bounded in count (its request list) and in time
(`duration_limit` stops sending; `request_timeout` bounds each request)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from tqdm import tqdm

from loadtest import prom
from loadtest.client import ClientConfig, RequestResult, send
from loadtest.metrics import summarize
from loadtest.workloads import RequestSpec, WorkloadConfig, build_requests


@dataclass
class RunConfig:
    base_url: str
    client: ClientConfig = field(default_factory=ClientConfig)
    mode: str = "closed"  # closed: `concurrency` workers; open: arrivals at `request_rate`
    concurrency: int | None = 8  # open loop: a cap on requests in flight (None: none)
    request_rate: float = math.inf  # open loop, requests/s
    arrival: str = "poisson"  # poisson | gamma
    burstiness: float = 1.0  # gamma shape: < 1 burstier than Poisson, > 1 smoother
    duration_limit: float | None = None  # seconds after which no new request is sent
    request_timeout: float = 600.0
    warmup: int = 0  # requests sent (and dropped) before each level
    seed: int = 0
    progress: bool = True
    slos: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (90, 99)
    scrape_metrics: bool = True  # kvserve counter deltas per level, when /metrics exists


def arrival_times(n: int, rate: float, arrival: str, burstiness: float, seed: int
                  ) -> list[float]:
    """Send offsets in seconds: gaps drawn i.i.d. from Exp(rate) or Gamma(k, 1/(rate k))."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if arrival == "gamma":
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        elif arrival == "poisson":
            t += rng.expovariate(rate)
        else:
            raise ValueError(f"unknown arrival process {arrival!r}")
    return out


def _client(n: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits)


async def _timed(client: httpx.AsyncClient, cfg: RunConfig, spec: RequestSpec,
                 disconnect_after: int | None = None) -> RequestResult:
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(send(client, cfg.base_url, spec, cfg.client,
                                           disconnect_after), cfg.request_timeout)
    except asyncio.TimeoutError:
        r = RequestResult("error:Timeout", spec.tag, spec.policy_name, spec.max_tokens,
                          spec.prompt_len, start=t0)
        r.e2el = time.perf_counter() - t0
        return r


async def run_specs(specs: list[RequestSpec], cfg: RunConfig, desc: str = "requests",
                    disconnect: Callable[[int], int | None] | None = None
                    ) -> tuple[list[RequestResult], float]:
    """Send `specs` closed- or open-loop; returns (results, wall seconds).

    `disconnect(i)` may give a chunk count after which request i hangs up.
    """
    n_conn = cfg.concurrency or len(specs) or 1
    bar = tqdm(total=len(specs), desc=desc, unit="req", disable=not cfg.progress,
               leave=False, dynamic_ncols=True)
    results: list[RequestResult] = []

    def cut(i: int) -> int | None:
        return disconnect(i) if disconnect else None

    async with _client(n_conn, cfg.request_timeout) as client:
        t0 = time.perf_counter()  # after the client's setup (TLS context: tens of ms)
        deadline = math.inf if cfg.duration_limit is None else t0 + cfg.duration_limit
        if cfg.mode == "closed":
            it = iter(enumerate(specs))

            async def worker() -> None:
                for i, spec in it:
                    if time.perf_counter() > deadline:
                        return
                    results.append(await _timed(client, cfg, spec, cut(i)))
                    bar.update(1)

            await asyncio.gather(*(worker() for _ in range(min(n_conn, len(specs)))))
        elif cfg.mode == "open":
            sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
            offsets = arrival_times(len(specs), cfg.request_rate, cfg.arrival,
                                    cfg.burstiness, cfg.seed)

            async def one(i: int, spec: RequestSpec) -> None:
                if sem is None:
                    results.append(await _timed(client, cfg, spec, cut(i)))
                else:
                    async with sem:
                        results.append(await _timed(client, cfg, spec, cut(i)))
                bar.update(1)

            tasks = []
            for i, (spec, off) in enumerate(zip(specs, offsets)):
                delay = t0 + off - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() > deadline:
                    break
                tasks.append(asyncio.create_task(one(i, spec)))
            await asyncio.gather(*tasks)
        else:
            raise ValueError(f"unknown mode {cfg.mode!r}")
    bar.close()
    return results, time.perf_counter() - t0


def level_label(cfg: RunConfig) -> str:
    if cfg.mode == "closed":
        return f"concurrency {cfg.concurrency}"
    cap = f", max {cfg.concurrency} in flight" if cfg.concurrency else ""
    return f"rate {cfg.request_rate:g}/s ({cfg.arrival}){cap}"


async def run_level(workload: WorkloadConfig, cfg: RunConfig, maker: Any = None
                    ) -> dict[str, Any]:
    """Warm up, then one measured run of `workload`; returns summary + per-request rows."""
    if cfg.warmup:
        warm = build_requests(replace(workload, num_requests=cfg.warmup,
                                      seed=workload.seed + 7919), maker)
        await run_specs(warm, replace(cfg, progress=False, duration_limit=None))
    specs = build_requests(workload, maker)
    before = prom.scrape(cfg.base_url) if cfg.scrape_metrics else None
    results, wall = await run_specs(specs, cfg, desc=level_label(cfg))
    after = prom.scrape(cfg.base_url) if before is not None else None
    starts = [r.start for r in results]
    t0 = min(starts, default=0.0)
    duration = max((r.start + (r.e2el or 0.0) for r in results), default=t0) - t0
    info = {"mode": cfg.mode, "label": level_label(cfg), "workload": workload.kind,
            "max_concurrency": cfg.concurrency,
            "request_rate": cfg.request_rate if cfg.mode == "open" else None,
            "arrival": cfg.arrival if cfg.mode == "open" else None,
            "burstiness": cfg.burstiness if cfg.mode == "open" else None}
    summary = summarize(results, duration or wall, cfg.slos, cfg.percentiles, t0, **info)
    summary["server_metrics"] = prom.deltas(before, after)
    return {"summary": summary,
            "requests": [{**r.row(), "start": r.start - t0} for r in results],
            "itl": [r.itl for r in results]}


def level_workload(workload: WorkloadConfig, index: int, n: int | None = None
                   ) -> WorkloadConfig:
    """The workload of a sweep's level `index` (`n` requests; None: the workload's own
    count): its own seed, so anything that must replay a level's exact requests (the
    offline reference of bench_serving) builds them from here, not from a copy of it."""
    return replace(workload, seed=workload.seed + 1000 * index,
                   num_requests=workload.num_requests if n is None else n)


async def run_sweep(workload: WorkloadConfig, cfg: RunConfig, levels: list[float],
                    per_level: Callable[[float], int] | None = None, maker: Any = None,
                    on_level: Callable[[dict[str, Any]], None] | None = None
                    ) -> list[dict[str, Any]]:
    """One level per concurrency (closed) or request rate (open). Each level gets its own
    prompts (seed + level index), so a level never hits the prefix cache a previous one
    filled."""
    out = []
    for i, level in enumerate(levels):
        if cfg.mode == "closed":
            lcfg = replace(cfg, concurrency=int(level))
        else:
            lcfg = replace(cfg, request_rate=float(level))
        lw = level_workload(workload, i, per_level(level) if per_level else None)
        res = await run_level(lw, replace(lcfg, seed=cfg.seed + i), maker)
        if on_level:
            on_level(res)
        out.append(res)
    return out
