"""The docs/benchmarks.md block and the figure of `benchmarks.bench_policies`.

Kept apart from the driver so the driver reads as the experiment; everything here is
a pure function of the report dict (the JSON in results/bench_policies.json).
"""

from __future__ import annotations

import statistics

from benchmarks import bench_common as bc
from benchmarks import heads_report, kvpress_report

TARGET = 3.0  # issue 5: the best policies serve ≥ 3× full's output tokens/s


def _f(x: float | None, fmt: str = ".1f", unit: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{unit}"


def _params(kv: object) -> str:
    if isinstance(kv, str):
        return kv
    return ", ".join(f"{k} {v}" for k, v in kv.items() if k != "name")  # type: ignore[union-attr]


def _kv_dtype(st: dict) -> str:
    dt = st.get("kv_cache_dtype", "auto")  # reports from before the option: the model's
    kv = "K/V in the model's dtype" if dt == "auto" else f"K/V stored as {dt}"
    weights = st.get("dtype", "auto")  # reports from before the option: the checkpoint's
    return kv if weights == "auto" else f"{kv}, weights in {weights}"


def _gen(st: dict) -> str:
    spread = st.get("gen_spread", 0.0)  # reports from before the option: all equal
    if not spread:
        return f"{st['gen']} generated each"
    lo, hi = round(st["gen"] * (1 - spread)), round(st["gen"] * (1 + spread))
    return f"{lo}–{hi} generated (uniform, mean ≈ {st['gen']})"


_FULL_WAYS = {
    "full": "default engine: a preempted request comes back once it can finish",
    "full:vllm": "vLLM's rule: a preempted request comes back on what it needs now",
    "full:fit": "at most `fit` running: never preempted",
    "full:head": "default engine, a per-head pool of the same bytes (`kv_layout=\"head\"`)",
}


def _throughput(t: dict, st: dict) -> list[str]:
    policies = {n: r for n, r in t["policies"].items() if not n.startswith("full")}
    best = max((r["tok_s_vs_full"] or 0 for r in policies.values()), default=0.0)
    best_of_all = max((r.get("tok_s_vs_best_full", 0) for r in policies.values()), default=0.0)
    fulls = [n for n in t["policies"] if n.startswith("full")]
    against = ("" if len(fulls) == 1 else
               f"; against the fastest way to run `full` ({max(fulls, key=lambda n: t['policies'][n]['tok_s'])}): "
               f"{best_of_all:.2f}×")
    lines = [
        f"**Capacity and throughput.** {st['requests']} requests, prompt {st['prompt']} tokens, "
        f"{_gen(st)} (EOS ignored, greedy); pool of {t['num_blocks']} blocks "
        f"({_kv_dtype(st)}) = "
        f"{t['full_requests_fit']} full-cache requests of {t['context']} tokens; every policy at "
        f"{t['budget_tokens']} tokens ({st['budget']:.0%} of {t['context']}). Best policy / full: "
        f"{best:.2f}× output tokens/s ({'met' if best >= TARGET else 'MISSED'}: ≥ {TARGET:.0f}×)"
        f"{against}.",
        "",
        "| policy | parameters | max concurrent | mean concurrent | output tok/s | × full "
        "| × fastest full | × full per CPU-s | p99 e2e (s) | peak live tokens (mean / max) "
        "| preemptions | policy share of step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in t["policies"].items():
        ok = "" if r["all_lengths_ok"] else " (lengths differ!)"
        params = _FULL_WAYS.get(name, _params(r["kv_policy"]))
        if name.endswith(":unbatched"):
            params += "; each request's policy stepped alone (`batch_policies=False`)"
        if name.endswith(":noring"):
            params += "; appended, evicted after the step (`streaming_ring=False`)"
        lines.append(
            f"| {name}{ok} | {params} | {r['max_running']} "
            f"| {r['mean_running']:.1f} | {r['tok_s']:.1f} | {_f(r['tok_s_vs_full'], '.2f', '×')} "
            f"| {_f(r.get('tok_s_vs_best_full'), '.2f', '×')} "
            f"| {_f(r['tok_per_cpu_s_vs_full'], '.2f', '×')} | {_f(r['p99_e2e_s'])} "
            f"| {r['mean_peak_live_tokens']:.0f} / {r['max_peak_live_tokens']} "
            f"| {r['preemptions']} | {100 * r['policy_share']:.1f}% |")
    return lines + heads_report.throughput(t) + _ceiling(t)


def _ceiling(t: dict) -> list[str]:
    c = t.get("ceiling")
    if c is None:  # reports from before the ceiling was measured
        return []
    name, r = max(((n, r) for n, r in t["policies"].items() if not n.startswith("full")),
                  key=lambda x: x[1]["tok_s"], default=("—", {"tok_s": 0.0}))
    return [
        "", f"**Ceiling on this machine.** A policy that cost nothing, held exactly the budget "
        f"and kept the pool full ({c['requests']} requests of {c['prompt']} tokens, decoding "
        f"with no prefill and no last wave: a `full` engine, same run, the median of "
        f"{c.get('steps', 64)} steps{_measured(c)}) would serve "
        f"{c['tok_s']:.1f} tok/s = **{c['tok_s_vs_full']:.2f}× full** "
        f"({c['tok_s_vs_best_full']:.2f}× the fastest `full`); the best policy, {name}, "
        f"reaches {r['tok_s'] / c['tok_s']:.0%} of it{_around(r)}{_mean_step(c, r)}. The same batch with almost no K/V "
        f"serves {c['tok_s_no_kv']:.1f} tok/s: reading {c['prompt']} tokens of K/V is "
        f"{c['kv_share_of_step']:.0%} of that step, and the rest (weights, per-token compute, "
        "the step's fixed cost) is paid with or without eviction.", *_rounds(t),
        *_waves(c, name, r), *_anatomy(t)]


def _measured(c: dict) -> str:
    if c.get("tok_s_first") is None:  # measured once, after the runs (before commit 1a7ad7d)
        return ""
    return (f"; measured before the first run and after each, {c.get('measurements', 2)} "
            f"times, from {c['tok_s_first']:.1f} to {c['tok_s_last']:.1f} tok/s, their mean "
            "taken")


def _around(r: dict) -> str:
    """A run against the ceiling measured right before and right after it (the machine
    drifts within minutes), the median over its rounds."""
    if "of_ceiling_median" not in r:
        return ""
    k = len(r["rounds"])
    return (f", and {r['of_ceiling_median']:.0%} of the ceiling measured around "
            f"{'its run' if k == 1 else f'each of its {k} runs (the median)'}")


def _mean_step(c: dict, r: dict) -> str:
    """The ceiling from its steps' mean, not their median: a run's tok/s is its steps'
    mean, so this is the like-for-like bound."""
    if "tok_s_mean_step" not in c:  # before commit bd4ff74
        return ""
    return (f" (from the ceiling steps' mean rather than their median, as a run's own "
            f"tok/s counts every step: {c['tok_s_mean_step']:.1f} tok/s, of which it "
            f"reaches {r['tok_s'] / c['tok_s_mean_step']:.0%})")


def _rounds(t: dict) -> list[str]:
    rows = [(n, r) for n, r in t["policies"].items() if "rounds" in r]
    if not rows or "ceiling" not in t:
        return []
    most = max(len(r["rounds"]) for _, r in rows)
    lines = ["", "Each run against the ceiling measured right before and right after it "
             "(tok/s, and its share of their mean; the machine drifts by 10-20% within "
             "minutes):", "",
             "| policy | " + " | ".join(f"run {i + 1}" for i in range(most)) + " | median share |",
             "|---|" + "---|" * (most + 1)]
    for name, r in rows:
        cells = [f"{x['tok_s']:.1f} ({x['of_ceiling']:.0%} of {statistics.mean(x['ceiling_around']):.1f})"
                 for x in r["rounds"]] + ["—"] * (most - len(r["rounds"]))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['of_ceiling_median']:.0%} |")
    return lines


def _anatomy(t: dict) -> list[str]:
    rows = [(n, r["anatomy"]) for n, r in t["policies"].items() if "anatomy" in r]
    if not rows:  # a report from before commit 2406cbd
        return []
    lines = ["", "Where each run's time went (`step_anatomy`: wide = decode steps with at least "
             "half the largest batch, narrow = fewer running, e.g. a last wave):", "",
             "| policy | prefill s (steps) | wide decode s (steps) | ms / wide step "
             "| forward / policy in wide steps | narrow decode s (steps) |",
             "|---|---|---|---|---|---|"]
    for name, a in rows:
        p, w, n = a["prefill"], a["wide"], a["narrow"]
        ms = 1e3 * w["s"] / w["steps"] if w["steps"] else 0.0
        lines.append(
            f"| {name} | {p['s']:.1f} ({p['steps']}) | {w['s']:.1f} ({w['steps']}) | {ms:.2f} "
            f"| {w['forward_s'] / max(w['s'], 1e-9):.0%} / {w['policy_s'] / max(w['s'], 1e-9):.1%} "
            f"| {n['s']:.1f} ({n['steps']}) |")
    return lines


def _waves(c: dict, name: str, r: dict) -> list[str]:
    if "tok_s_waves" not in c:  # unequal lengths, or a report from before commit 16dc1a7
        return []
    w = c["waves"]
    return [
        "", f"**In the waves this pool allows a policy that evicts after the step.** Such a "
        f"request holds budget + 1 tokens during a step, so {w[0]} fit at once and the "
        f"{sum(w)} requests run as {' + '.join(map(str, w))}; free eviction in those waves "
        f"(each wave's step measured at its size) would serve {c['tok_s_waves']:.1f} tok/s = "
        f"{c['tok_s_waves_vs_full']:.2f}× full; {name} reaches "
        f"{r['tok_s'] / c['tok_s_waves']:.0%} of that. (StreamingLLM's ring writes the step's "
        f"token over its oldest: {c['requests']} fit, the ceiling's count.)"]


def _overhead(o: dict) -> list[str]:
    by_round = o.get("rounds", 1) > 1
    lines = [
        "", f"**Per-step overhead** with every policy at the same batch: {o['batch']} requests "
        f"decoding (steps with all {o['batch']} running and no prefill), budget "
        f"{o['budget_tokens']} tokens, prompts of {o.get('prompt', 'the part-1')} tokens "
        "(every step at the budget); `policy_seconds_total` is EngineStats' per-policy "
        "eviction time over the whole run (prefill included)."
        + (f" Medians of {o['rounds']} rounds (policies in reverse order every other "
           "round); the share of each round last." if by_round else ""), "",
        "| policy | steps | step ms | policy ms / step | policy share | µs / request / step "
        "| forward share | policy_seconds_total |" + (" share by round |" if by_round else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if by_round else "")]
    for name, r in o["policies"].items():
        rounds = " / ".join(_f(100 * x if x is not None else None, ".1f", "%")
                            for x in r.get("share_by_round", []))
        lines.append(
            f"| {name} | {r['steps']} | {r['mean_step_ms']:.2f} | {r['mean_policy_ms']:.2f} "
            f"| {_f(100 * r['policy_share'] if r['policy_share'] is not None else None, '.1f', '%')} "
            f"| {r['policy_us_per_request_step']:.0f} | {_f(r['forward_share'], '.0%')} "
            f"| {r['policy_seconds_total']:.3f} |" + (f" {rounds} |" if by_round else ""))
    return lines


def _quality(q: dict) -> list[str]:
    if "skipped" in q:
        return ["", f"**Quality**: {q['skipped']}."]
    rows = q["rows"]
    depths = list(rows[0]["needle_by_depth"])
    nk = q["needle"]
    full = rows[0]
    lines = [
        "", f"**Quality on the demo model** ({q['model']}). Perplexity: {q['windows']} held-out "
        f"windows of {q['window']} tokens; the first {q['prompt']} are the prompt (prefilled "
        "as the engine would: one chunk, or for a policy that bounds its prompt chunks of its "
        f"budget, at least {q.get('min_prefill_chunk', 256)} tokens, evicting between them; "
        f"then the policy acts), the other {q['scored_tokens']} in all are teacher-forced "
        "one at a time through the bounded cache and scored (000 §4.1). Full-cache kvserve "
        f"{full['ppl']:.3f} vs transformers {q['reference_ppl_transformers']:.3f} on the same "
        f"tokens ({'agree' if q['full_matches_reference'] else 'DISAGREE'}). Needle "
        f"(`demo_model.evaluate.needle`): tasks {', '.join(nk['tasks'])}; prompt lengths "
        f"{', '.join(map(str, nk['lengths']))}; {nk['trials']} trial(s) per cell; budget = the "
        "fraction of each prompt; accuracy by depth over tasks and lengths (002 Table 1).", "",
        "| policy | budget | PPL | PPL / full | needle mean | "
        + " | ".join(f"depth {float(d):.0%}" for d in depths) + " |",
        "|---|---|---|---|---|" + "---|" * len(depths)]
    for r, base in kvpress_report.interleave(q):  # each kvpress row after ours
        lines.append(
            f"| {r['policy']} | {r['budget']:.0%} | {r['ppl']:.3f} | {r['ppl'] / base:.3f} "
            f"| {r['needle_mean']:.0%} | "
            + " | ".join(f"{r['needle_by_depth'][d]:.0%}" for d in depths) + " |")
    return lines + heads_report.quality(q) + kvpress_report.comparison(q)


def render(report: dict) -> str:
    st = report["settings"]
    lines: list[str] = []
    if "throughput" in report:
        lines += _throughput(report["throughput"], st)
    if "overhead" in report:
        lines += _overhead(report["overhead"])
    if "quality" in report:
        lines += _quality(report["quality"])
    model = f"{st['model']} ({report['params'] / 1e6:.2f}M params)" if "params" in report else "—"
    if (st["prompt"], st["gen"]) == (512, 3584):
        size = "At the issue's lengths (prompt 512 + gen 3584, pool of 8 × 4,096-token requests)."
    else:
        size = (f"Shortened from the issue (prompt 512 + gen 3584, pool of 8 × 4,096-token "
                f"requests) to prompt {st['prompt']} + gen {st['gen']}, with the pool and budgets "
                f"scaled to prompt + gen (same proportions: {st['fit']} full requests, "
                f"{st['budget']:.0%} budget).")
    results, plot_path = bc.links(report, "bench_policies")
    heads = heads_report.figure_path(report, plot_path)
    lines += [
        "", f"Random-weight model for throughput and overhead: {model}. {size} This run took "
        f"{report['bench_wall_s'] / 60:.1f} min.", "",
        bc.environment_line(report, results), "",
        "```bash", report["command"], "```", "", f"![KV eviction policies]({plot_path})"]
    if heads is not None and heads != plot_path:
        lines += ["", f"![Quality per head]({heads})"]
    if kvpress_report.kv_rows(report.get("quality", {})) and heads != plot_path:
        lines += ["", f"![Ours vs kvpress]({kvpress_report.figure_path(plot_path)})"]
    return "\n".join(lines)


def _anatomy_bars(ax, runs: dict) -> None:
    """Each run's seconds stacked by kind of step (`step_anatomy`): prefill, the wide
    steps without and with their policy time, the narrow steps (ramps, a last wave)."""
    names = [n for n, r in runs.items() if "anatomy" in r]
    a = [runs[n]["anatomy"] for n in names]
    parts = {"prefill": [x["prefill"]["s"] for x in a],
             "wide steps, policy aside": [x["wide"]["s"] - x["wide"]["policy_s"] for x in a],
             "wide steps' policy": [x["wide"]["policy_s"] for x in a],
             "narrow steps": [x["narrow"]["s"] for x in a]}
    bottom = [0.0] * len(names)
    for label, vals in parts.items():
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=60, labelsize=8)
    ax.set_title("part 1: seconds by kind of step", fontsize=9)


def plot(report: dict, path: str) -> None:
    """Throughput bars, overhead bars, PPL per budget and the needle heatmap; with
    per-head quality rows, their figure (`heads_report.plot`: per layer, per head,
    adaptive and kvpress's, per budget), in place of this one in a quality-only run."""
    heads = heads_report.figure_path(report, path)
    if heads is not None:
        heads_report.plot(report, heads)
        if heads == path:
            return
    plt = bc.pyplot()
    q = report.get("quality", {})
    has_q = bool(q.get("rows"))
    fig, axes = plt.subplots(1, 4 if has_q else 2, figsize=(19 if has_q else 10, 4.2),
                             squeeze=False)
    ax = axes[0]
    if "throughput" in report:
        t = report["throughput"]["policies"]
        bars = ax[0].bar(list(t), [r["tok_s"] for r in t.values()], color="#2a7ab9")
        for b, r in zip(bars, t.values()):
            ax[0].annotate(f"{r['tok_s_vs_full']:.1f}×\n{r['mean_running']:.0f}",
                           (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                           va="bottom", fontsize=7)
        top = max(r["tok_s"] for r in t.values())
        if "ceiling" in report["throughput"]:
            ceiling = report["throughput"]["ceiling"]
            c = ceiling["tok_s"]
            ax[0].axhline(c, color="k", lw=1, ls="--", label="ceiling: free eviction, pool full")
            if "tok_s_waves" in ceiling:
                ax[0].axhline(ceiling["tok_s_waves"], color="k", lw=1, ls=":",
                              label="the same in the pool's waves")
            ax[0].legend(fontsize=7, loc="upper left")
            top = max(top, c)
        ax[0].set_ylim(0, 1.25 * top)
        ax[0].set_title("output tok/s (label: × full, mean concurrent)", fontsize=9)
    if "overhead" in report:
        o = report["overhead"]["policies"]
        ax[1].bar(list(o), [100 * (r["policy_share"] or 0) for r in o.values()], color="#e08a3c")
        ax[1].set_title(f"policy share of step time, {report['overhead']['batch']} decoding (%)",
                        fontsize=9)
    elif "throughput" in report:  # where part 1's time went instead (`step_anatomy`)
        _anatomy_bars(ax[1], report["throughput"]["policies"])
    if has_q:
        rows = q["rows"]
        budgets = sorted({r["budget"] for r in rows if not r["policy"].startswith("full")})
        names = list(dict.fromkeys(r["policy"] for r in rows
                                   if not r["policy"].startswith("full")))
        by = {(r["policy"], r["budget"]): r for r in rows}
        w = 0.8 / max(1, len(budgets))
        for k, b in enumerate(budgets):
            ax[2].bar([i + k * w for i in range(len(names))],
                      [by[(n, b)]["ppl"] for n in names], w, label=f"{b:.0%} budget")
        ax[2].axhline(rows[0]["ppl"], color="k", lw=1, ls="--", label="full")
        ax[2].set_xticks([i + w * (len(budgets) - 1) / 2 for i in range(len(names))], names)
        ax[2].legend(fontsize=7)
        ax[2].set_title("held-out perplexity (demo model)", fontsize=9)
        labels = [f"{r['policy']} {r['budget']:.0%}" for r in rows]
        depths = list(rows[0]["needle_by_depth"])
        grid = [[r["needle_by_depth"][d] for d in depths] for r in rows]
        im = ax[3].imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax[3].set_yticks(range(len(labels)), labels, fontsize=6)
        ax[3].set_xticks(range(len(depths)), [f"{float(d):.0%}" for d in depths])
        ax[3].set_xlabel("needle depth")
        ax[3].set_title("needle accuracy", fontsize=9)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax[3].text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=5,
                           color="w" if v < 0.5 else "k")
        fig.colorbar(im, ax=ax[3])
    for a in ax[:3]:
        a.tick_params(axis="x", labelrotation=60, labelsize=7)
    bc.save_figure(fig, path)
    kvpress_report.plot(report, kvpress_report.figure_path(path))
