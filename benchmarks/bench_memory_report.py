"""The docs/benchmarks.md block and the figure of `benchmarks.bench_memory`.

Pure functions of the report dict (results/bench_memory.json), kept apart from the
driver. The paper's tables (003_12df107fdefa535c.txt) are printed next to ours so the
comparison needs no second document.
"""

from __future__ import annotations

from benchmarks import bench_common as bc

PREFIX_TARGET = 5.0  # issue 4: ≥ 5× lower TTFT on prefix-cache hits
# 003 "Watermark Tuning Impact (Llama 3 70B)": usable % -> (max batch, tok/s, preempt/min, p99 ms)
PAPER_WATERMARK = {0.30: (42, 580, 0, 120), 0.15: (54, 720, 0.2, 135), 0.10: (58, 760, 1.5, 180),
                   0.05: (61, 780, 8.0, 450), 0.02: (63, 790, 25.0, 1200)}


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1e3 * x:.1f}"


def _prefix(p: dict, model: str) -> list[str]:
    ok = p["mean_ratio"] >= PREFIX_TARGET
    return [
        f"**Prefix caching** ({model}): {p['requests_each']} requests each, one at a time, "
        f"{p['prefix_tokens']}-token shared prefix + distinct {p['suffix_tokens']}-token suffix "
        "after one warm-up request; misses are the same prompts with a per-request "
        f"`cache_salt`. Hit tokens served from the cache: {p['prefix_cache_hits_tokens']}.", "",
        "| | mean TTFT (ms) | p50 TTFT (ms) | prefix tokens reused per request |",
        "|---|---|---|---|",
        f"| hit | {_ms(p['hit']['mean_ttft_s'])} | {_ms(p['hit']['p50_ttft_s'])} "
        f"| {min(p['hit']['prefix_hit_tokens'])}–{max(p['hit']['prefix_hit_tokens'])} |",
        f"| miss | {_ms(p['miss']['mean_ttft_s'])} | {_ms(p['miss']['p50_ttft_s'])} "
        f"| {min(p['miss']['prefix_hit_tokens'])}–{max(p['miss']['prefix_hit_tokens'])} |",
        f"| miss / hit | {p['mean_ratio']:.1f}× ({'met' if ok else 'MISSED'}: ≥ "
        f"{PREFIX_TARGET:.0f}×) | {p['p50_ratio']:.1f}× | |"]


def _row(name: str, r: dict) -> str:
    pre = ", ".join(f"{k} {v}" for k, v in r["preemptions"].items() if v) or "0"
    return (f"| {name} | {r['tok_s']:.1f} | {r['mean_e2e_s']:.2f} | {r['p50_e2e_s']:.2f} "
            f"| {r['p99_e2e_s']:.2f} | {pre} | {r['preemptions_per_min']:.1f} "
            f"| {r['swap_bytes'].get('out', 0) / 2**20:.1f} | {r['max_running']} "
            f"| {r['mean_running']:.1f} |")


HEAD = ("| tok/s | mean e2e (s) | p50 e2e (s) | p99 e2e (s) | preemptions | per min "
        "| swapped out (MiB) | max concurrent | mean concurrent |")


def _pressure(pr: dict, model: str, st: dict) -> list[str]:
    w = pr["workload"]
    lines = [
        "", f"**Memory pressure** ({model}): {w['requests']} requests submitted at once, prompts "
        f"{st['prompt_range'][0]}–{st['prompt_range'][1]} tokens, outputs "
        f"{st['output_range'][0]}–{st['output_range'][1]} ({w['output_tokens']} in all, EOS "
        f"ignored); pool {pr['num_blocks']} blocks = {pr['pool_fraction']:.0%} of the "
        f"{pr['peak_blocks']} the workload would need at once."]
    if "modes" in pr:
        lines += ["", "| preemption mode " + HEAD, "|---" * 10 + "|"]
        lines += [_row(m, r) for m, r in pr["modes"].items()]
    if "auto" in pr:
        a = pr["auto"]
        x, x0 = a["crossover_tokens"], a["crossover_tokens_at_start"]
        chose = ", ".join(f"{k} {v} times" for k, v in sorted(a["choices"].items()))
        lines += [
            "", f"`auto` chose {chose or 'nothing (no preemption)'}. Its cost model on this "
            "machine after the run (start-up calibration refined by real swaps and prefills): "
            f"copy {a['copy_bytes_per_s'] / 1e9:.1f} GB/s, fixed swap latency "
            f"{1e6 * a['swap_latency_s']:.0f} µs, prefill {1e6 * a['prefill_s_per_token']:.1f} µs "
            f"per token, {a['bytes_per_token'] / 1024:.1f} KiB of K/V per token: swap is cheaper "
            + (f"from {x:.0f} tokens of context up" if x is not None else "at no length")
            + (f" ({x0:.0f} with the start-up calibration alone)" if x0 is not None else "")
            + ". 003's table (Llama 3 70B, PCIe Gen4) next to ours (this model, this machine) "
            "at the same lengths — the paper: swap wins at every length:", "",
            "| prompt tokens | 003 swap ms | 003 recompute ms | 003 winner | swap ms here "
            "| recompute ms here | winner here |", "|---|---|---|---|---|---|---|"]
        for t in a["table"]:
            win = "swap" if t["swap_ms"] < t["recompute_ms"] else "recompute"
            lines.append(f"| {t['tokens']} | {t['paper_swap_ms']} | {t['paper_recompute_ms']} "
                         f"| swap | {t['swap_ms']:.2f} | {t['recompute_ms']:.1f} | {win} |")
    if "watermark" in pr:
        lines += ["", f"Watermark sweep (`--preemption-mode {st['watermark_mode']}`), with 003's "
                  "table (Llama 3 70B) in the last columns:", "",
                  "| `--watermark` (usable) " + HEAD
                  + " 003 max batch | 003 tok/s | 003 preempt/min | 003 p99 |", "|---" * 14 + "|"]
        for k, r in pr["watermark"].items():
            paper = PAPER_WATERMARK.get(round(float(k), 2))
            tail = (" {} | {} | {} | {} ms |".format(*paper) if paper else " — | — | — | — |")
            lines.append(_row(f"{k} ({1 - float(k):.0%})", r) + tail)
    return lines


def render(report: dict) -> str:
    st, lines = report["settings"], []
    params = {m: f"{m}, {n / 1e6:.1f}M params" for m, n in report["params"].items()}
    if "prefix" in report:
        lines += _prefix(report["prefix"], params[st["prefix_model"]])
    if "pressure" in report:
        lines += _pressure(report["pressure"], params[st["pressure_model"]], st)
    lines += ["", "Latency: end to end per request (submission → final output seen); all "
              "requests arrive at once, so it includes queueing. Random-weight models, greedy.",
              "", bc.environment_line(report, bc.links(report, "bench_memory")[0]), "",
              "```bash", report["command"], "```", "",
              f"![memory management]({bc.links(report, 'bench_memory')[1]})"]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """TTFT hit vs miss; tok/s and p99 per preemption mode; the watermark sweep."""
    plt = bc.pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    if "prefix" in report:
        p = report["prefix"]
        vals = [1e3 * p[k][s] for k in ("hit", "miss") for s in ("mean_ttft_s", "p50_ttft_s")]
        bars = ax[0].bar(["hit mean", "hit p50", "miss mean", "miss p50"], vals,
                         color=["#2a7ab9", "#2a7ab9", "#b0b0b0", "#b0b0b0"])
        for b, v in zip(bars, vals):
            ax[0].annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center",
                           va="bottom", fontsize=8)
        ax[0].set_title(f"TTFT (ms), {p['prefix_tokens']}-token prefix: {p['mean_ratio']:.1f}× "
                        "lower on hits", fontsize=9)
    else:
        ax[0].axis("off")
    pr = report.get("pressure", {})
    for a, key, xlab in ((ax[1], "modes", "preemption mode"), (ax[2], "watermark", "--watermark")):
        runs = pr.get(key)
        if not runs:
            a.axis("off")
            continue
        names = list(runs)
        a.bar(names, [r["tok_s"] for r in runs.values()], color="#2a7ab9")
        a.set_ylabel("output tok/s", color="#2a7ab9")
        a.set_xlabel(xlab)
        b = a.twinx()
        b.plot(names, [r["p99_e2e_s"] for r in runs.values()], "o-", color="#c0392b")
        b.set_ylabel("p99 e2e latency (s)", color="#c0392b")
        b.set_ylim(bottom=0, top=1.25 * max(r["p99_e2e_s"] for r in runs.values()))
        a.set_ylim(0, 1.25 * max(r["tok_s"] for r in runs.values()))
        for i, r in enumerate(runs.values()):
            a.annotate(f"{sum(r['preemptions'].values())} pre.\n{r['max_running']} max",
                       (i, r["tok_s"]), ha="center", va="bottom", fontsize=7)
        a.set_title(f"{'preemption modes' if key == 'modes' else 'watermark sweep'} "
                    "(label: preemptions, max concurrent)", fontsize=9)
    bc.save_figure(fig, path)
