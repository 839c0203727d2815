"""Turn request results into the numbers of vLLM's `bench serve`, printed in its layout.

TTFT, TPOT (excluding the first token), ITL and E2EL in milliseconds: mean, median and
the chosen percentiles (numpy's linear interpolation, so they are ordered). Goodput
counts the successful requests that meet every given SLO (`ttft:MS tpot:MS e2el:MS`);
a request with one output token has no TPOT and meets a TPOT SLO. Intentional client
disconnects are reported apart from failures.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from loadtest.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")
SECTIONS = (("ttft", "TTFT", "Time to First Token"),
            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"),
            ("e2el", "E2EL", "End-to-end Latency"))


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"goodput SLO {item!r}: expected one of {SLO_KEYS} as KEY:MS")
        if float(value) <= 0:
            raise ValueError(f"goodput SLO {item!r}: the threshold must be > 0 ms")
        slos[key] = float(value)
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.ok:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(values[k] is None or values[k] * 1000 <= ms for k, ms in slos.items())


def stats_ms(values: list[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean, median, std and p<N> of seconds, in ms (zeros when there are none)."""
    pcts = list(percentiles)
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{_pkey(p): 0.0 for p in pcts}}
    a = np.asarray(values, dtype=float) * 1000
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({_pkey(p): float(v) for p, v in zip(pcts, np.percentile(a, pcts))})
    return out


def _pkey(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def _peaks(results: list[RequestResult], t0: float) -> tuple[float, int]:
    """(most content chunks in one wall-clock second, most requests in flight at once)."""
    per_second: Counter[int] = Counter()
    events: list[tuple[float, int]] = []
    for r in results:
        if r.e2el is not None:
            events += [(r.start, 1), (r.start + r.e2el, -1)]
        if r.ok and r.ttft is not None:
            t = r.start + r.ttft
            per_second[int(t - t0)] += 1
            for gap in r.itl:
                t += gap
                per_second[int(t - t0)] += 1
    live = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        live += d
        peak = max(peak, live)
    return float(max(per_second.values(), default=0)), peak


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float] | None = None,
              percentiles: Iterable[float] = (90, 99), t0: float | None = None,
              **info: Any) -> dict[str, Any]:
    """The summary of one run (one concurrency or rate level). `info` (concurrency,
    request_rate, ...) is stored as given."""
    pcts = list(percentiles)
    ok = [r for r in results if r.ok]
    statuses = Counter(r.status for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                    for r in ok)
    dur = max(duration, 1e-9)
    t0 = min((r.start for r in results), default=0.0) if t0 is None else t0
    peak_tps, peak_conc = _peaks(results, t0)
    s: dict[str, Any] = {
        **info,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": sum(n for k, n in statuses.items() if k != "disconnected"),
        "disconnected": statuses.get("disconnected", 0),
        "failures_by_status": dict(sorted(statuses.items())),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "peak_output_throughput": peak_tps,
        "peak_concurrent_requests": peak_conc,
        "slos_ms": dict(slos or {}),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        s["good_requests"] = good
        s["request_goodput"] = good / dur
    s["ttft_ms"] = stats_ms([r.ttft for r in ok if r.ttft is not None], pcts)
    s["tpot_ms"] = stats_ms([t for r in ok if (t := r.tpot) is not None], pcts)
    s["itl_ms"] = stats_ms([g for r in ok for g in r.itl], pcts)
    s["e2el_ms"] = stats_ms([r.e2el for r in ok if r.e2el is not None], pcts)
    s["percentiles"] = pcts
    both = [r for r in ok if r.usage_output_tokens is not None and r.streamed_tokens is not None]
    s["token_count_checked"] = len(both)
    s["token_count_mismatches"] = sum(r.usage_output_tokens != r.streamed_tokens for r in both)
    s["by_tag"] = _by_tag(results, dur, pcts)
    kv = [r.kv_cache for r in ok if r.kv_cache]
    if kv:
        s["prefix_hit_tokens"] = sum(k.get("prefix_hit_tokens", 0) for k in kv)
        s["evicted_tokens"] = sum(k.get("evicted_tokens", 0) for k in kv)
    return s


def _by_tag(results: list[RequestResult], dur: float, pcts: list[float]) -> dict[str, Any]:
    tags: dict[str, list[RequestResult]] = {}
    for r in results:
        tags.setdefault(r.tag, []).append(r)
    out = {}
    for tag, rs in sorted(tags.items()):
        ok = [r for r in rs if r.ok]
        peak = [r.kv_cache.get("peak_blocks", 0) for r in ok if r.kv_cache]
        out[tag] = {"requests": len(rs), "completed": len(ok),
                    "output_tokens": sum(r.output_tokens for r in ok),
                    "output_throughput": sum(r.output_tokens for r in ok) / dur,
                    "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None], pcts),
                    "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None], pcts),
                    "e2el_ms": stats_ms([r.e2el for r in ok if r.e2el is not None], pcts),
                    "mean_peak_blocks": float(np.mean(peak)) if peak else None}
    return out


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def format_summary(s: dict[str, Any], sections: Iterable[str] = ("ttft", "tpot", "itl", "e2el")
                   ) -> str:
    """vLLM's `bench serve` result block (same labels, widths and order), followed by
    what only this tool reports (failures by status, per-tag lines)."""
    want = set(sections)
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _line("Successful requests:", s["completed"]),
             _line("Failed requests:", s["failed"])]
    if s.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", s["max_concurrency"]))
    rate = s.get("request_rate")
    if rate is not None and not math.isinf(rate):
        lines.append(_line("Request rate configured (RPS):", float(rate)))
    lines += [_line("Benchmark duration (s):", float(s["duration"])),
              _line("Total input tokens:", s["total_input_tokens"]),
              _line("Total generated tokens:", s["total_output_tokens"]),
              _line("Request throughput (req/s):", s["request_throughput"])]
    if "request_goodput" in s:
        lines.append(_line("Request goodput (req/s):", s["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", s["output_throughput"]),
              _line("Peak output token throughput (tok/s):", s["peak_output_throughput"]),
              _line("Peak concurrent requests:", float(s["peak_concurrent_requests"])),
              _line("Total token throughput (tok/s):", s["total_token_throughput"])]
    for key, short, header in SECTIONS:
        if key not in want:
            continue
        st = s[f"{key}_ms"]
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  _line(f"Mean {short} (ms):", st["mean"]),
                  _line(f"Median {short} (ms):", st["median"])]
        lines += [_line(f"P{_pkey(p)[1:]} {short} (ms):", st[_pkey(p)])
                  for p in s["percentiles"]]
    lines.append("=" * 50)
    extra = []
    if s["failures_by_status"]:
        extra.append("Not successful, by status: " + ", ".join(
            f"{k}={v}" for k, v in s["failures_by_status"].items()))
    if s["token_count_checked"]:
        extra.append(f"Streamed tokens vs usage: {s['token_count_mismatches']} mismatches in "
                     f"{s['token_count_checked']} requests")
    if len(s["by_tag"]) > 1:
        for tag, t in s["by_tag"].items():
            extra.append(f"  {tag:<28} {t['completed']:>5} ok  {t['output_throughput']:8.1f} "
                         f"tok/s  TTFT p50 {t['ttft_ms']['median']:8.1f} ms  "
                         f"E2EL p50 {t['e2el_ms']['median']:9.1f} ms")
    return "\n".join(lines + extra)
