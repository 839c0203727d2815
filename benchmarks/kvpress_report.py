"""The kvpress rows in bench_policies' quality block: table rows, the ours-vs-kvpress
comparison and its figure (issue 20).

Why apart from bench_policies_report: those are pure functions of the report dict too,
but only of its `quality.kvpress` block (`benchmarks/kvpress_compare.py`); a report
without it (older runs, no kvpress venv) renders exactly as before.
"""

from __future__ import annotations

from benchmarks import bench_common as bc
from benchmarks.kvpress_compare import PER_HEAD

TOLERANCE = 0.02  # issue 20: each policy within 2 points of the same method's press


def kv_rows(q: dict) -> list[dict]:
    """The kvpress rows of a quality block ([] when skipped or absent)."""
    return q.get("kvpress", {}).get("rows", [])


def _method(row: dict) -> str:
    """A kvpress row's method without its "@layer" (the head-mean ranking)."""
    return row["method"].partition("@")[0]


def _beside(row: dict, ours: set[str]) -> str:
    """Which of our rows a kvpress row goes after: its method's, or where the run has
    the method per head (`<m>:head`, issue 65) and the press keeps a set per kv head
    (`kvpress_compare.PER_HEAD`), that one (its head-mean ranking stays with ours); an
    AdaKVPress row ("<m>@adakv") after our `<m>:adaptive`."""
    m = _method(row)
    if row["method"].endswith("@adakv"):
        return f"{m}:adaptive" if f"{m}:adaptive" in ours else m
    head = f"{m}:head"
    return head if head in ours and m in PER_HEAD and "@" not in row["method"] else m


def interleave(q: dict) -> list[tuple[dict, float]]:
    """(row, its own full-cache PPL) in table order: each of our rows followed by the
    kvpress rows of the same method and budget (the press, then its head-mean
    ranking; a per-head press after our per-head row, `_beside`); a kvpress row's PPL /
    full divides by kvpress's own full-cache row (transformers as its venv has it)."""
    ours, theirs = q["rows"], kv_rows(q)
    names = {r["policy"] for r in ours}
    by: dict[tuple[str, float], list[dict]] = {}
    for r in theirs:
        by.setdefault((_beside(r, names), r["budget"]), []).append(r)
    full = ours[0]["ppl"]
    kv_full = by.get(("full", 1.0), [ours[0]])[0]["ppl"]
    out: list[tuple[dict, float]] = []
    for r in ours:
        out.append((r, full))
        out += [(k, kv_full) for k in by.get((r["policy"], r["budget"]), [])]
    return out


def pairs(q: dict) -> list[tuple[dict, dict, float, float]]:
    """(ours, kvpress, ours' PPL / full, kvpress's PPL / its full) per shared method,
    budget and kvpress variant, the full-cache row excluded."""
    out, mine = [], None
    for r, base in interleave(q):
        if "method" not in r:
            mine = (r, base) if r["policy"] != "full" else None
        elif mine is not None:
            out.append((mine[0], r, mine[0]["ppl"] / mine[1], r["ppl"] / base))
    return out


def comparison(q: dict) -> list[str]:
    """The ours-vs-kvpress table, or the line saying why there are no kvpress rows."""
    kv = q.get("kvpress")
    if kv is None:
        return []
    if "skipped" in kv:
        return ["", f"**kvpress**: {kv['skipped']}."]
    v = kv["versions"]
    lines = [
        "", f"**Ours beside kvpress** (kvpress {v['kvpress']}, transformers "
        f"{v['transformers']}, its own venv; `benchmarks/kvpress_quality.py`): the same "
        "windows, needle prompts and budgets; each press at compression ratio 1 − B/n. "
        "Protocol *prefill+decode*: the prompt compressed to B, then kvpress's "
        "`DecodingPress` (compression_interval 1, target_size B) keeps the cache at B "
        "after every token, as ours does; *prefill*: the press compresses the prompt "
        "only and the cache grows while decoding (SnapKV/PyramidKV score with a window "
        "of queries a decoding press never holds). *, head mean*: the same press ranking "
        "by the mean of its score over the kv heads — one kept set per layer, as our pool "
        "keeps — so it isolates that constraint's cost from any other difference. The "
        "kept indices stay in position order (`ordered_topk`: kvpress's topk order broke "
        "StreamingLLMPress under repeated compression). Δ in points: 100 × (ours − kvpress) "
        f"of PPL / full, and of needle accuracy; ✓ within {100 * TOLERANCE:.0f} points "
        "(PPL).", "",
        "| method | budget | kvpress press (protocol) | PPL / full, ours | kvpress | Δ "
        "| needle, ours | kvpress | Δ |",
        "|---|---|---|---|---|---|---|---|---|"]
    for a, b, ra, rb in pairs(q):
        ok = "✓" if abs(ra - rb) <= TOLERANCE else "✗"
        lines.append(
            f"| {a['policy']} | {a['budget']:.0%} | {b['kv_policy']['press']} "
            f"({b['protocol']}) | {ra:.3f} | {rb:.3f} | {100 * (ra - rb):+.1f} {ok} "
            f"| {a['needle_mean']:.0%} | {b['needle_mean']:.0%} "
            f"| {100 * (a['needle_mean'] - b['needle_mean']):+.0f} |")
    return lines


def figure_path(plot_path: str) -> str:
    """Where the comparison figure goes: beside the main one, `_kvpress` before .png."""
    stem, dot, ext = plot_path.rpartition(".")
    return f"{stem}_kvpress.{ext}" if dot else f"{plot_path}_kvpress"


def plot(report: dict, path: str) -> None:
    """PPL / full (log scale) and needle mean per shared method, ours beside kvpress at
    every budget; nothing when the report has no kvpress rows."""
    q = report.get("quality", {})
    ps = pairs(q) if kv_rows(q) else []
    if not ps:
        return
    plt = bc.pyplot()
    ps = [p for p in ps if "@" not in p[1]["method"]]  # the presses as kvpress runs them
    methods = list(dict.fromkeys(a["policy"] for a, _, _, _ in ps))
    budgets = sorted({a["budget"] for a, _, _, _ in ps})
    series = [(b, who) for b in budgets for who in ("ours", "kvpress")]
    colors = {("ours", 0): "#2a7ab9", ("kvpress", 0): "#9cc3e4",
              ("ours", 1): "#e08a3c", ("kvpress", 1): "#f3c79c"}
    by = {(a["policy"], a["budget"]): (a, b, ra, rb) for a, b, ra, rb in ps}
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.2))
    w = 0.8 / len(series)
    for k, (b, who) in enumerate(series):
        xs = [i + k * w for i, m in enumerate(methods) if (m, b) in by]
        got = [by[(m, b)] for m in methods if (m, b) in by]
        ppl = [ra if who == "ours" else rb for _, _, ra, rb in got]
        acc = [(a if who == "ours" else c)["needle_mean"] for a, c, _, _ in got]
        kw = dict(width=w, color=colors[(who, budgets.index(b) % 2)], label=f"{who} {b:.0%}",
                  edgecolor="k" if who == "kvpress" else None, linewidth=0.5)
        ax[0].bar(xs, ppl, **kw)
        ax[1].bar(xs, acc, **kw)
    for a in ax:
        a.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(methods))], methods)
        a.legend(fontsize=7)
    ax[0].set_yscale("log")
    ax[0].axhline(1.0, color="k", lw=1, ls="--")
    ax[0].axhline(1.3, color="r", lw=1, ls=":", label="×1.3 target")
    ax[0].set_title("PPL / full cache (log scale), ours vs kvpress", fontsize=9)
    ax[1].set_ylim(0, 1)
    ax[1].set_title("needle accuracy (mean over depths), ours vs kvpress", fontsize=9)
    bc.save_figure(fig, path)
