"""The per-head pool's tables in bench_policies' doc block (issue 65): each policy per
layer beside the same policy on a per-head pool of the same bytes (throughput, memory),
and the quality of every policy per layer, shared, uniform and adaptive per head.

Why apart from bench_policies_report: pure functions of the report dict too, but only
of its rows named "<policy>:<way>" with a per-head way (`policy_eval.HEAD_WAYS`); a
report without them (older runs, runs without `--heads`) renders exactly as before.
"""

from __future__ import annotations

from benchmarks.policy_eval import HEAD_WAYS
from benchmarks.policy_heads import tok_s

FULL_WITHIN = 0.05  # issue 65: full on a per-head pool within 5% of the per-layer pool's
COLUMNS = ("", "shared", "head", "adaptive")  # a policy's ways in table order
WAY_LABEL = {"": "per layer", "shared": "per head, shared", "head": "per head, uniform",
             "adaptive": "per head, adaptive"}


def _per_head(names: object) -> bool:
    return any(str(n).partition(":")[2] in HEAD_WAYS for n in names)  # type: ignore[attr-defined]


def _bytes(x: float | None) -> str:
    if x is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def _grouped(names: list[str]) -> list[str]:
    """`names` with each policy's per-head ways right after its per-layer row."""
    bases = list(dict.fromkeys(n.partition(":")[0] for n in names))
    return [f"{b}:{w}" if w else b for b in bases for w in COLUMNS
            if (f"{b}:{w}" if w else b) in names]


def _verdict(name: str, ratio: float | None) -> str:
    if ratio is None:
        return "—"
    if name.startswith("full:"):
        ok = ratio >= 1 - FULL_WITHIN
        return f"{ratio:.2f}× ({'met' if ok else 'MISSED'}: ≥ {1 - FULL_WITHIN:.2f}×)"
    return f"{ratio:.2f}× ({'met' if ratio >= 1 else 'MISSED'}: ≥ 1×)"


def throughput(t: dict) -> list[str]:
    """Per policy: its per-layer row, then its rows on a per-head pool, with their tok/s
    over the per-layer row's and the memory each held and gave back; [] without any."""
    runs = t["policies"]
    if not _per_head(runs):
        return []
    lines = [
        "", "**Pages per head** (issue 65): each policy on a per-head pool (`--kv-layout "
        "head`: a page one (layer, kv head)'s K/V, each head keeping and freeing its own "
        "tokens) of the same bytes as the per-layer run's, beside its per-layer row. "
        "Output tok/s: the median of the row's rounds; × layer: over the per-layer row's "
        f"(the issue: ≥ 1× for a policy, within {FULL_WITHIN:.0%} for `full`); × layer, "
        "drift out: the same with each run read as its share of the ceiling measured "
        "right before and after it (`full` runs once, the policies `--rounds` times, "
        "each one's ways right after it). Peak KV: a request's pages at its peak × the page's "
        "bytes (mean over requests); freed: pages the policy's evictions gave back to the "
        "pool over the run, in bytes; evicted: tokens a request, its slots over its lanes; "
        "heads' live tokens: the fewest and the most a request's (layer, kv head) lanes "
        "held at its end (means over requests).",
        "", "| policy | pool | output tok/s | × layer | × layer, drift out "
        "| max / mean concurrent | peak KV a request | page bytes | freed by eviction "
        "| evicted tokens a request | heads' live tokens | preemptions | policy share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bases = {n.partition(":")[0] for n in runs if n.partition(":")[2] in HEAD_WAYS}
    for name in _grouped([n for n in runs if n.partition(":")[0] in bases]):
        r = runs[name]
        way = name.partition(":")[2]
        pool = "per head" if name == "full:head" else WAY_LABEL[way]
        lines.append(
            f"| {name} | {pool} | {tok_s(r):.1f} "
            f"| {_verdict(name, r.get('tok_s_vs_layer'))} "
            f"| {_f2(r.get('of_ceiling_vs_layer'))} "
            f"| {r['max_running']} / {r['mean_running']:.1f} "
            f"| {_bytes(r.get('mean_peak_bytes'))} | {_bytes(r.get('page_bytes'))} "
            f"| {_bytes(r.get('freed_bytes'))} | {_f0(r.get('mean_evicted_tokens'))} "
            f"| {_spread(r)} | {r['preemptions']} | {100 * r['policy_share']:.1f}% |")
    return lines


def _f0(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def _f2(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _spread(r: dict) -> str:
    lo, hi = r.get("mean_head_live_min"), r.get("mean_head_live_max")
    return "—" if r.get("kv_layout") != "head" or not hi else f"{lo:.0f}–{hi:.0f}"


def quality(q: dict) -> list[str]:
    """PPL / full and needle mean per policy and budget, its ways side by side (per
    layer, per head shared, uniform, adaptive); whether shared and `full:head` keep what
    the per-layer pool keeps; [] without per-head rows."""
    rows = q.get("rows", [])
    if not _per_head(r["policy"] for r in rows):
        return []
    by = {(r["policy"], r["budget"]): r for r in rows}
    full = rows[0]["ppl"]
    ways = [w for w in COLUMNS if any(r["policy"].partition(":")[2] == w for r in rows
                                      if not r["policy"].startswith("full"))]
    bases = list(dict.fromkeys(r["policy"].partition(":")[0] for r in rows
                               if not r["policy"].startswith("full")))
    budgets = sorted({r["budget"] for r in rows if not r["policy"].startswith("full")})
    head = " | ".join(WAY_LABEL[w] for w in ways)
    lines = [
        "", "**Quality per head** (issue 65): PPL / full cache, then needle accuracy "
        "(mean over depths), of each policy kept per layer and on a per-head pool: "
        "*shared* one set a layer (what the per-layer pool keeps), *uniform* each kv "
        "head its own top tokens at the policy's budget, *adaptive* AdaKV's (the layer's "
        "budget to the best scores of all its heads).", "",
        f"| policy | budget | PPL / full: {head} | needle: {head} |",
        "|---|---|" + "---|" * 2 * len(ways)]
    for b in budgets:
        for base in bases:
            got = [by.get((f"{base}:{w}" if w else base, b)) for w in ways]
            ppl = " | ".join("—" if r is None else f"{r['ppl'] / full:.3f}" for r in got)
            acc = " | ".join("—" if r is None else f"{r['needle_mean']:.0%}" for r in got)
            lines.append(f"| {base} | {b:.0%} | {ppl} | {acc} |")
    return lines + _same_sets(by, rows)


def _same_sets(by: dict, rows: list[dict]) -> list[str]:
    """Shared rows and `full:head` against the per-layer rows they should equal."""
    pairs = [(r, by.get((r["policy"].partition(":")[0], r["budget"]))) for r in rows
             if r["policy"].partition(":")[2] == "shared" or r["policy"] == "full:head"]
    pairs = [(a, b) for a, b in pairs if b is not None]
    if not pairs:
        return []
    same = [a for a, b in pairs if abs(a["ppl"] / b["ppl"] - 1) < 1e-3
            and a["needle_mean"] == b["needle_mean"]]
    off = [f"{a['policy']} {a['budget']:.0%} (PPL {a['ppl']:.3f} vs {b['ppl']:.3f}, needle "
           f"{a['needle_mean']:.0%} vs {b['needle_mean']:.0%})"
           for a, b in pairs if a not in same]
    return ["", f"Per-head pool keeping a layer's set (shared, and `full:head`) against the "
            f"per-layer pool: {len(same)} of {len(pairs)} rows the same (PPL within 0.1%, "
            "same needle accuracy)" + (f"; apart: {'; '.join(off)}." if off else ".")]
