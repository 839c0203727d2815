"""A small reader of the Prometheus text format (what `/metrics` serves)."""

from __future__ import annotations

import re

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = frozenset(_LABEL.findall(m.group(3) or ""))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample `name{labels}`, or the sum over all label sets when none are given
    and the metric has several; None if absent."""
    want = frozenset(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    return sum(hits) if hits else None


def scrape(url: str, timeout: float = 10.0) -> Samples | None:
    """`url`/metrics parsed, or None if the server has no Prometheus endpoint."""
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse(r.text)


# kvserve counters worth a before/after delta around a benchmark level
DELTAS = {
    "preemptions": "kvserve_num_preemptions_total",
    "prefix_cache_queries": "kvserve_prefix_cache_queries_total",
    "prefix_cache_hits": "kvserve_prefix_cache_hits_total",
    "generation_tokens": "kvserve_generation_tokens_total",
    "prompt_tokens": "kvserve_prompt_tokens_total",
    "policy_evicted_tokens": "kvserve_policy_evicted_tokens_total",
}


def deltas(before: Samples | None, after: Samples | None) -> dict[str, float]:
    """Counter increases between two scrapes of a kvserve server (empty otherwise)."""
    if not before or not after:
        return {}
    out = {}
    for key, name in DELTAS.items():
        a, b = value(after, name), value(before, name)
        if a is not None and b is not None:
            out[key] = a - b
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"]
    return out
