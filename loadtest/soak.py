"""Soak: minutes of mixed load on a kvserve server, then a leak check.

    python -m loadtest soak --spawn --model DIR --minutes 10 --concurrency 8
    python -m loadtest soak --base-url http://127.0.0.1:8000 --minutes 10

Workers send, in seeded random order: normal requests (streaming, some not, with a
`kv_policy` mix), streaming requests that hang up after a few chunks, non-streaming
requests abandoned after a short timeout, and malformed requests (bad JSON, bad fields,
unknown model or policy, prompts over the context) that must get a 4xx. At the end the
server is waited on until idle and then must hold no KV blocks
(`kvserve_kv_blocks{state="used"}` = 0) and no live slots. RSS comes from /proc for a
spawned server (or --pid), summed over its child processes (the engine process of
`--engine-layout process`), else from `process_resident_memory_bytes` plus
`kvserve_engine_process_resident_memory_bytes`; the baseline is
taken after the warm-up. Exit status 1 on a leaked block, any 5xx or in-band stream
error, a malformed request accepted, RSS growth over --max-rss-growth, or a server that
does not go idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import httpx

from loadtest import prom
from loadtest.client import ClientConfig, RequestResult, first_model, send
from loadtest.report import environment, write_json
from loadtest.spawn import Spawned, free_port, kvserve_cmd
from loadtest.workloads import (
    LengthDist,
    TextMaker,
    WorkloadConfig,
    iter_requests,
    load_tokenizer,
    parse_policy_mix,
)
from server.memwatch import tree_rss_bytes

# The load's requests' timeouts: long enough for any answer; an "abandon" request keeps
# all but the read, which it cuts short
TIMEOUT = httpx.Timeout(120.0, connect=30.0)
DEFAULT_MIX = ('[[0.6, "full"], [0.2, {"name": "streaming", "sink": 4, "window": 32}], '
               '[0.2, {"name": "snapkv", "budget": 24, "obs_window": 8}]]')


def malformed(rng: random.Random, model: str | None, long_prompt: str) -> tuple[str, bytes]:
    """(endpoint, raw body) of a request a correct server refuses with a 4xx."""
    m = {"model": model} if model else {}
    bodies: list[tuple[str, Any]] = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b""),
        ("/v1/completions", {**m, "max_tokens": 4}),  # no prompt
        ("/v1/completions", {**m, "prompt": "hi", "temperature": 7}),
        ("/v1/completions", {**m, "prompt": "hi", "max_tokens": -3, "stream": True}),
        ("/v1/completions", {**m, "prompt": "hi", "kv_policy": "no-such-policy"}),
        ("/v1/completions", {**m, "prompt": "hi", "kv_policy": {"name": "streaming",
                                                               "windw": 8}}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
        ("/v1/completions", {**m, "prompt": long_prompt, "max_tokens": 8, "stream": True}),
        ("/v1/chat/completions", {**m, "messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/chat/completions", {**m, "messages": "not a list", "stream": True}),
    ]
    ep, body = rng.choice(bodies)
    return ep, body if isinstance(body, bytes) else json.dumps(body).encode()


class Soak:
    def __init__(self, a: argparse.Namespace, url: str, pid: int | None) -> None:
        self.a, self.url, self.pid = a, url, pid
        self.rng = random.Random(f"soak-{a.seed}")
        self.counts: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.unexpected: list[str] = []
        self.rss: list[tuple[float, int]] = []
        self.sent = 0
        self.rss_base: int | None = None
        self.long_prompt = ""

    def rss_now(self) -> int | None:
        if self.pid is not None:
            return tree_rss_bytes(self.pid)
        s = prom.scrape(self.url)
        v = prom.value(s, "process_resident_memory_bytes") if s else None
        if v is None:
            return None
        engine = prom.value(s, "kvserve_engine_process_resident_memory_bytes")
        return int(v + (engine or 0))  # the engine process's, with --engine-layout process

    async def one(self, client: httpx.AsyncClient, ccfg: ClientConfig, spec: Any) -> None:
        a, rng = self.a, self.rng
        x = rng.random()
        if x < a.malformed_fraction:
            ep, raw = malformed(rng, ccfg.model, self.long_prompt)
            try:
                r = await client.post(self.url + ep, content=raw,
                                      headers={"Content-Type": "application/json"})
                status = str(r.status_code)
                if r.status_code < 400 and b'"error"' not in r.content:
                    self.unexpected.append(f"{ep} {raw[:80]!r} -> {status}")
            except httpx.HTTPError as e:
                status = f"error:{type(e).__name__}"
            self.record("malformed", status)
        elif x < a.malformed_fraction + a.disconnect_fraction:
            if rng.random() < 0.7:  # streaming: hang up after a few chunks
                res = await send(client, self.url, spec, ccfg,
                                 disconnect_after=rng.randint(1, max(1, spec.max_tokens // 2)))
                self.record("disconnect", res.status, res)
            else:  # non-streaming: give up before the answer
                body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "ignore_eos": True,
                        **({"model": ccfg.model} if ccfg.model else {})}
                # Given up by httpx's own read timeout, not by cancelling the request
                # (asyncio.wait_for): a request cancelled while its connection is being
                # set up leaves that connection in the client's pool for good (httpcore
                # 1.0.9, encode/httpcore#1093), and once the pool's 16 slots were gone
                # every request waited 120 s for one and failed with PoolTimeout, counted
                # as server errors (the second soak of commit 79d3004, on a Xeon).
                wait = rng.uniform(0.01, 0.3)
                try:
                    await client.post(self.url + "/v1/completions", json=body,
                                      timeout=httpx.Timeout(connect=TIMEOUT.connect, read=wait,
                                                            write=TIMEOUT.write, pool=TIMEOUT.pool))
                    self.record("abandon", "200")
                except httpx.ReadTimeout:
                    self.record("abandon", "disconnected")
                except httpx.HTTPError as e:
                    self.record("abandon", f"error:{type(e).__name__}")
        else:
            res = await send(client, self.url, spec, ccfg)
            self.record("normal", res.status, res)

    def record(self, kind: str, status: str, res: RequestResult | None = None) -> None:
        self.counts[f"{kind}:{status}"] += 1
        if status.startswith("5") or status == "stream_error" or (
                kind == "normal" and status != "200"):
            self.server_errors.append(f"{kind} -> {status}: {res.error if res else ''}"[:300])

    async def load(self) -> None:
        a = self.a
        ccfg = ClientConfig(model=a.model, temperature=0.8, logprobs=None)
        async with httpx.AsyncClient(timeout=10) as c:
            ccfg.model = ccfg.model or await first_model(c, self.url)
        wl = WorkloadConfig(num_requests=a.max_requests, seed=a.seed,
                            prompt=LengthDist(a.prompt_len, 0.8, 2, a.max_model_len // 2),
                            output=LengthDist(a.output_len, 0.8, 1, a.max_model_len // 4),
                            max_model_len=a.max_model_len,
                            policy_mix=parse_policy_mix(a.kv_policy_mix))
        maker = TextMaker(a.seed, load_tokenizer(a.tokenizer), a.chars_per_token)
        specs = iter_requests(wl, maker)
        self.long_prompt = "lorem ipsum " * (a.max_model_len + 8)
        start = time.monotonic()
        end = start + a.minutes * 60
        warm_end = start + a.warmup_fraction * a.minutes * 60
        limits = httpx.Limits(max_connections=a.concurrency + 8)
        async with httpx.AsyncClient(timeout=TIMEOUT,
                                     limits=limits) as client:
            async def worker() -> None:
                for spec in specs:
                    if time.monotonic() > end:
                        return
                    self.sent += 1
                    await self.one(client, ccfg, spec)

            async def sampler() -> None:
                while time.monotonic() < end:
                    await asyncio.sleep(min(a.rss_every, max(0.0, end - time.monotonic())))
                    v = await asyncio.to_thread(self.rss_now)
                    if v is not None:
                        self.rss.append((time.monotonic() - start, v))
                        if self.rss_base is None and time.monotonic() >= warm_end:
                            self.rss_base = v

            # the RSS samples end with the load: at --minutes, or once --max-requests sent
            sampling = asyncio.create_task(sampler())
            await asyncio.gather(*(worker() for _ in range(a.concurrency)))
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling

    def wait_idle(self, timeout: float) -> dict[str, float | None]:
        deadline = time.monotonic() + timeout
        names = ("kvserve_num_requests_running", "kvserve_num_requests_waiting",
                 "kvserve_engine_active_requests")
        while True:
            s = prom.scrape(self.url) or {}
            vals = {n: prom.value(s, n) for n in names}
            if all(v == 0 for v in vals.values()) or time.monotonic() > deadline:
                vals["idle"] = all(v == 0 for v in vals.values())
                vals["kv_blocks_used"] = prom.value(s, "kvserve_kv_blocks", state="used")
                vals["kv_live_slots"] = prom.value(s, "kvserve_kv_live_slots")
                vals["event_loop_tasks"] = prom.value(s, "kvserve_event_loop_tasks")
                return vals
            time.sleep(0.2)


def run(a: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    soak = Soak(a, url, pid)
    before = soak.wait_idle(30)
    t0 = time.monotonic()
    asyncio.run(soak.load())
    elapsed = time.monotonic() - t0
    after = soak.wait_idle(a.idle_timeout)
    final_rss = soak.rss_now()
    base = soak.rss_base or (soak.rss[0][1] if soak.rss else None)
    growth = (final_rss - base) / base * 100 if base and final_rss else None
    leaked = after.get("kv_blocks_used")
    problems = []
    if not after["idle"]:
        problems.append("the server did not go idle")
    if leaked is None:
        problems.append("no kvserve_kv_blocks{state=\"used\"} in /metrics")
    elif leaked > 0 or (after.get("kv_live_slots") or 0) > 0:
        problems.append(f"{leaked:.0f} KV blocks still used when idle")
    if soak.server_errors:
        problems.append(f"{len(soak.server_errors)} server errors (5xx / failed requests)")
    if soak.unexpected:
        problems.append(f"{len(soak.unexpected)} malformed requests were accepted")
    if growth is not None and a.max_rss_growth is not None and growth > a.max_rss_growth:
        problems.append(f"RSS grew {growth:.1f}% (> {a.max_rss_growth}%)")
    return {"benchmark": "soak", "url": url, "minutes": a.minutes, "elapsed_s": elapsed,
            "requests_sent": soak.sent, "counts": dict(sorted(soak.counts.items())),
            "leaked_blocks": leaked, "idle_before": before, "idle_after": after,
            "rss_base_bytes": base, "rss_final_bytes": final_rss, "rss_growth_pct": growth,
            "rss_trace": soak.rss, "server_errors": soak.server_errors[:50],
            "malformed_accepted": soak.unexpected[:50], "problems": problems,
            "ok": not problems, "environment": environment(),
            "config": {k: v for k, v in vars(a).items() if k != "server_args"}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running kvserve (else --spawn)")
    p.add_argument("--spawn", action="store_true", help="start `kvserve serve` on a free port")
    p.add_argument("--model", default=None, help="--spawn: checkpoint dir (default: demo model)")
    p.add_argument("--server-args", default="", help="--spawn: extra `kvserve serve` arguments")
    p.add_argument("--threads", type=int, default=None,
                   help="--spawn: the server's --cpu-threads (default: its own choice)")
    p.add_argument("--pid", type=int, default=None, help="server pid for RSS from /proc")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=200_000, help="count bound")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--malformed-fraction", type=float, default=0.1)
    p.add_argument("--kv-policy-mix", default=DEFAULT_MIX)
    p.add_argument("--prompt-len", type=float, default=48, help="median prompt tokens")
    p.add_argument("--output-len", type=float, default=32, help="median output tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir for exact prompt lengths (--spawn: the model's)")
    p.add_argument("--chars-per-token", type=float, default=4.0, help="without a tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="RSS baseline after this share of the run")
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="percent; exit 1 above")
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--result-json", default=None)
    p.add_argument("--doc", default=None,
                   help="also write the result into this markdown file (soak markers)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    server = None
    if a.spawn:
        from server.cli import DEMO_MODEL

        a.model_dir = a.model or str(DEMO_MODEL)
        a.tokenizer = a.tokenizer or a.model_dir
        port = free_port()
        log = os.path.join(tempfile.gettempdir(), f"kvserve-soak-{port}.log")
        threads = ("--cpu-threads", str(a.threads)) if a.threads else ()
        server = Spawned(kvserve_cmd(a.model_dir, port, *threads, *a.server_args.split()),
                         port, log_path=log, ready_path="/ready").start()
        url, pid, a.model = server.url, server.pid, None
        print(f"spawned kvserve pid {pid} on {url} (log {log})", flush=True)
    elif a.base_url:
        url, pid = a.base_url.rstrip("/"), a.pid
    else:
        raise SystemExit("give --base-url URL or --spawn")
    try:
        report = run(a, url, pid)
    finally:
        code = server.stop() if server else None
    report["server_exit_code"], report["server_pid"] = code, pid
    report["command"] = "python -m loadtest soak " + " ".join(argv)
    if a.result_json:
        write_json(report, a.result_json)
    if a.doc:
        from loadtest.bench_serving_report import update_doc

        update_doc(a.doc, doc_block(report, a.result_json, a.doc), SOAK_BEGIN, SOAK_END)
    print(format_report(report))
    return 0 if report["ok"] else 1


SOAK_BEGIN, SOAK_END = "<!-- soak:begin (generated) -->", "<!-- soak:end -->"


def doc_block(r: dict[str, Any], results: str | None, doc: str) -> str:
    """The soak's lines for docs/benchmarks.md."""
    env, g = r["environment"], r["rss_growth_pct"]
    counts = ", ".join(f"{k} {v}" for k, v in r["counts"].items())
    link = (f" Full result: [{os.path.basename(results)}]"
            f"({os.path.relpath(results, os.path.dirname(os.path.abspath(doc)))}).") if results else ""
    return "\n".join([
        f"**Soak: {r['elapsed_s'] / 60:.1f} minutes, {'PASS' if r['ok'] else 'FAIL'}.** "
        f"{r['requests_sent']} requests at concurrency {r['config']['concurrency']} ({counts}). "
        f"Leaked KV blocks when idle: {r['leaked_blocks']:.0f}; server errors (5xx, failed "
        f"streams): {len(r['server_errors'])}; malformed requests accepted: "
        f"{len(r['malformed_accepted'])}; RSS growth after the warm-up: "
        f"{'n/a' if g is None else f'{g:.2f}%'} (limit {r['config']['max_rss_growth']}%)."
        + ("" if r["ok"] else " Problems: " + "; ".join(r["problems"]) + "."),
        "",
        f"Measured {env['date_utc']} on {env['cpu']} ({env['cpu_count']} cores), commit "
        f"{str(env['git_commit'])[:10]}{' (dirty)' if env.get('git_dirty') else ''}.{link}",
        "", "```bash", r["command"], "```"])


def format_report(r: dict[str, Any]) -> str:
    g = r["rss_growth_pct"]
    lines = ["{s:{c}^{n}}".format(s=" Soak Result ", n=50, c="="),
             f"{'Duration (s):':<40} {r['elapsed_s']:.1f}",
             f"{'Requests sent:':<40} {r['requests_sent']}",
             *(f"  {k:<38} {v}" for k, v in r["counts"].items()),
             f"{'Leaked KV blocks:':<40} "
             f"{'n/a' if r['leaked_blocks'] is None else int(r['leaked_blocks'])}",
             f"{'RSS growth after warm-up (%):':<40} {'n/a' if g is None else f'{g:.2f}'}",
             f"{'Server errors:':<40} {len(r['server_errors'])}",
             f"{'Malformed requests accepted:':<40} {len(r['malformed_accepted'])}",
             f"{'Result:':<40} {'PASS' if r['ok'] else 'FAIL: ' + '; '.join(r['problems'])}",
             "=" * 50]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
