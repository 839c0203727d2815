"""The per-head pool's tables in bench_policies' doc block (issue 65): each policy per
layer beside the same policy on a per-head pool of the same bytes (throughput, memory),
and the quality of every policy per layer, shared, uniform and adaptive per head, with
kvpress's per-head press and its AdaKVPress beside them (`kvpress_compare`), in a table
and a figure.

Why apart from bench_policies_report: pure functions of the report dict too, but only
of its rows named "<policy>:<way>" with a per-head way (`policy_eval.HEAD_WAYS`); a
report without them (older runs, runs without `--heads`) renders exactly as before.
"""

from __future__ import annotations

from benchmarks import bench_common as bc
from benchmarks.policy_eval import HEAD_WAYS
from benchmarks.policy_heads import tok_s

FULL_WITHIN = 0.05  # issue 65: full on a per-head pool within 5% of the per-layer pool's
COLUMNS = ("", "shared", "head", "adaptive")  # a policy's ways in table order
WAY_LABEL = {"": "per layer", "shared": "per head, shared", "head": "per head, uniform",
             "adaptive": "per head, adaptive"}
# kvpress's rows beside them: the press as kvpress runs it (a set per kv head), and
# AdaKVPress around it (`kvpress_quality.ADAKV`), by the suffix of their method
KVPRESS = {"": "kvpress, per head", "@adakv": "kvpress AdaKV"}


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
    ways, bases, budgets = _layout(rows)
    kv, kv_full = _kvpress(q)
    press = _press_kinds(kv)
    head = " | ".join([WAY_LABEL[w] for w in ways] + [KVPRESS[x] for x in press])
    lines = [
        "", "**Quality per head** (issue 65): PPL / full cache, then needle accuracy "
        "(mean over depths), of each policy kept per layer and on a per-head pool: "
        "*shared* one set a layer (what the per-layer pool keeps), *uniform* each kv "
        "head its own top tokens at the policy's budget, *adaptive* AdaKV's (the layer's "
        "budget to the best scores of all its heads)"
        + ("; beside them the same method's kvpress press, a set per kv head, and "
           "kvpress's AdaKVPress around it (PPL / full of kvpress's own full cache)."
           if press else "."), "",
        f"| policy | budget | PPL / full: {head} | needle: {head} |",
        "|---|---|" + "---|" * 2 * (len(ways) + len(press))]
    for b in budgets:
        for base in bases:
            got = [(r, rows[0]["ppl"]) for r in
                   (by.get((f"{base}:{w}" if w else base, b)) for w in ways)]
            got += [(kv.get((base + x, b)), kv_full) for x in press]
            ppl = " | ".join("—" if r is None else f"{r['ppl'] / f:.3f}" for r, f in got)
            acc = " | ".join("—" if r is None else f"{r['needle_mean']:.0%}" for r, _ in got)
            lines.append(f"| {base} | {b:.0%} | {ppl} | {acc} |")
    return lines + _same_sets(by, rows)


def _layout(rows: list[dict]) -> tuple[list[str], list[str], list[float]]:
    """A quality block's ways (`COLUMNS` present), policies and budgets, full left out."""
    mine = [r for r in rows if not r["policy"].startswith("full")]
    ways = [w for w in COLUMNS if any(r["policy"].partition(":")[2] == w for r in mine)]
    bases = list(dict.fromkeys(r["policy"].partition(":")[0] for r in mine))
    return ways, bases, sorted({r["budget"] for r in mine})


def _kvpress(q: dict) -> tuple[dict[tuple[str, float], dict], float]:
    """kvpress's rows by (method, budget) and its full cache's PPL ({} without them)."""
    rows = q.get("kvpress", {}).get("rows", [])
    by = {(r["method"], r["budget"]): r for r in rows}
    return by, by.get(("full", 1.0), {"ppl": q["rows"][0]["ppl"]})["ppl"]


def _press_kinds(kv: dict[tuple[str, float], dict]) -> list[str]:
    """Which of `KVPRESS`'s kinds of kvpress row the run has."""
    methods = {m for m, _ in kv if m != "full"}
    return [x for x in KVPRESS if any(m.endswith(x) if x else "@" not in m for m in methods)]


def figure_path(report: dict, plot_path: str) -> str | None:
    """Where `plot` draws: the run's own plot when it has no throughput or overhead part
    (bench_policies' figure would be its quality panels only), else beside it with
    `_heads` before .png; None without per-head quality rows."""
    q = report.get("quality", {})
    if not _per_head(r["policy"] for r in q.get("rows", [])):
        return None
    if not {"throughput", "overhead"} & set(report):
        return plot_path
    stem, dot, ext = plot_path.rpartition(".")
    return f"{stem}_heads.{ext}" if dot else f"{plot_path}_heads"


# (label, our way or kvpress suffix, colour, kvpress's) in bar order
SERIES = (("per layer", "", "#7f7f7f", False), ("per head", "head", "#2a7ab9", False),
          ("adaptive (AdaKV)", "adaptive", "#e08a3c", False),
          ("kvpress, per head", "", "#9cc3e4", True), ("kvpress AdaKVPress", "@adakv", "#f3c79c", True))


PPL_TOP = 1.6  # the figure's PPL / full axis: knorm's ×3-11 would flatten the rest


def plot(report: dict, path: str) -> None:
    """Per budget, PPL / full cache and needle accuracy of every policy per layer, per
    head and adaptive, beside kvpress's per-head press and AdaKVPress."""
    q = report["quality"]
    rows = q["rows"]
    by = {(r["policy"], r["budget"]): r for r in rows}
    _, bases, budgets = _layout(rows)
    kv, kv_full = _kvpress(q)
    series = [s for s in SERIES if not s[3] or s[1] in _press_kinds(kv)]
    plt = bc.pyplot()
    fig, axes = plt.subplots(2, len(budgets), figsize=(6.2 * len(budgets), 7.4),
                             squeeze=False, sharey="row")
    w = 0.84 / len(series)
    for j, b in enumerate(budgets):
        for k, (label, key, color, theirs) in enumerate(series):
            got = [(i, kv.get((base + key, b)) if theirs else
                    by.get((f"{base}:{key}" if key else base, b))) for i, base in enumerate(bases)]
            got = [(i + k * w, r) for i, r in got if r is not None]
            full = kv_full if theirs else rows[0]["ppl"]
            kw = dict(width=w, color=color, label=label, edgecolor="k" if theirs else None,
                      linewidth=0.5, hatch="//" if theirs else None)
            ppl = [r["ppl"] / full for _, r in got]
            axes[0][j].bar([x for x, _ in got], [min(v, PPL_TOP) for v in ppl], **kw)
            for (x, _), v in zip(got, ppl):
                if v > PPL_TOP:  # clipped: its value written on it
                    axes[0][j].text(x, PPL_TOP - 0.01, f"{v:.1f}", rotation=90, ha="center",
                                    va="top", fontsize=6)
            axes[1][j].bar([x for x, _ in got], [r["needle_mean"] for _, r in got], **kw)
        for a in (axes[0][j], axes[1][j]):
            a.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(bases))], bases,
                         rotation=45, ha="right", fontsize=8)
        axes[0][j].set_ylim(0.95, PPL_TOP)
        axes[0][j].axhline(1.0, color="k", lw=1, ls="--")
        axes[0][j].set_title(f"{b:.0%} budget: PPL / full cache (bars over {PPL_TOP} "
                             "clipped, value written)", fontsize=9)
        axes[1][j].axhline(rows[0]["needle_mean"], color="k", lw=1, ls="--",
                           label="full cache")
        axes[1][j].set_ylim(0, 1)
        axes[1][j].set_title(f"{b:.0%} budget: needle accuracy (mean over depths)", fontsize=9)
    axes[1][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bc.save_figure(fig, path)


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
