"""Result files, a markdown file's generated blocks, and plots (matplotlib, Agg backend:
no display needed)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import httpx

from loadtest.fingerprint import fingerprint


def server_info(url: str) -> dict[str, Any]:
    """What the server says about itself (kvserve: /version), best effort."""
    info: dict[str, Any] = {"url": url}
    try:
        r = httpx.get(url.rstrip("/") + "/version", timeout=5)
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
            info["version"] = r.json()
    except httpx.HTTPError:
        pass
    return info


def environment() -> dict[str, Any]:
    return {**fingerprint(), "loadavg": os.getloadavg()}


def write_json(obj: dict[str, Any], path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def update_doc(path: str, block: str, heading: str, begin: str, end: str) -> None:
    """Replace one benchmark's generated block in a markdown file, keeping hand-written
    notes around it; a missing block goes under its heading, a missing heading at the end."""
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    gen = f"{begin}\n{block}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + gen + text[text.index(end) + len(end):]
    elif heading in text:
        at = text.index(heading) + len(heading)
        text = text[:at] + "\n\n" + gen + "\n" + text[at:]
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{gen}\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_cdfs(panels: dict[str, dict[str, Sequence[float]]], path: str, title: str = ""
              ) -> str:
    """One panel per metric ({metric label: {series label: values in ms}}), CDFs."""
    import numpy as np
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (metric, series) in zip(axes[0], panels.items()):
        for label, vals in series.items():
            if len(vals):
                x = np.sort(np.asarray(vals, dtype=float))
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_sweep(series: dict[str, list[dict[str, Any]]], xkey: str, path: str,
               xlabel: str, title: str = "") -> str:
    """Output tokens/s and p99 TTFT against the swept value, one line per series."""
    plt = _plt()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    ticks = sorted({s[xkey] for sums in series.values() for s in sums})
    for label, sums in series.items():
        xs = [s[xkey] for s in sums]
        a.plot(xs, [s["output_throughput"] for s in sums], marker="o", label=label)
        b.plot(xs, [s["ttft_ms"].get("p99", 0.0) for s in sums], marker="o", label=label)
    for ax, yl in ((a, "output tokens / s"), (b, "p99 TTFT (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(yl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    b.set_yscale("log")
    b.yaxis.set_major_formatter(ScalarFormatter())
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_bars(groups: dict[str, dict[str, float]], path: str, ylabel: str, title: str = ""
              ) -> str:
    """Grouped bars: {group (e.g. a run): {bar (e.g. a policy): value}}."""
    import numpy as np

    plt = _plt()
    names = sorted({k for g in groups.values() for k in g})
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names) * max(1, len(groups))), 3.6))
    width = 0.8 / max(1, len(groups))
    for j, (gname, g) in enumerate(groups.items()):
        xs = np.arange(len(names)) + j * width
        bars = ax.bar(xs, [g.get(n, 0.0) for n in names], width, label=gname)
        for bar in bars:
            h = bar.get_height()
            ax.annotate(f"{h:.0f}", (bar.get_x() + bar.get_width() / 2, h), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(names)) + width * (len(groups) - 1) / 2)
    ax.set_xticklabels(names, fontsize=8, rotation=15)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, path)


def plot_run(result: dict[str, Any], prefix: str) -> list[str]:
    """The plots of one `python -m loadtest` run: latency CDFs per level; throughput and
    p99 TTFT against concurrency or rate (sweeps); per-tag (per-policy) bars."""
    levels = result["levels"]
    paths = []
    cdf = {m: {lv["summary"]["label"]: [r[k] * 1000 for r in lv["requests"]
                                          if r["status"] == "200" and r[k] is not None]
               for lv in levels} for m, k in (("TTFT", "ttft"), ("E2E latency", "e2el"))}
    paths.append(plot_cdfs(cdf, f"{prefix}_cdf.png", "latency CDFs"))
    sums = [lv["summary"] for lv in levels]
    if len(levels) > 1:
        closed = sums[0]["mode"] == "closed"
        key = "max_concurrency" if closed else "request_rate"
        finite = [s for s in sums if s[key] is not None and s[key] != float("inf")]
        if len(finite) > 1:
            paths.append(plot_sweep({"run": finite}, key, f"{prefix}_sweep.png",
                                    "concurrency" if closed else "request rate (req/s)"))
    tags = {s["label"]: {t: v["output_throughput"] for t, v in s["by_tag"].items()}
            for s in sums}
    if any(len(v) > 1 for v in tags.values()):
        paths.append(plot_bars(tags, f"{prefix}_tags.png", "output tokens / s",
                               "by tag (kv_policy)"))
    return paths
