"""`bench_offline`'s report: the generated block of docs/benchmarks.md's "Offline
throughput (issue 2)" section (tables of throughput against the issues' targets, step
overheads, the share of the machine and of the roofline bound, environment, command) and
the bar plot; pure functions of the report dict, so `--from-json` redraws them."""

from __future__ import annotations

from benchmarks.bench_common import pyplot, save_figure
from benchmarks.bench_offline_systems import PEERS, SYSTEMS
from benchmarks.roofline import VLLM_TARGET
from loadtest.report import update_doc as _update_doc

DOC_HEADING = "## Offline throughput (issue 2)"
BEGIN, END = "<!-- bench_offline:begin (generated) -->", "<!-- bench_offline:end -->"
TARGETS: dict[str, float | None] = {"hf_static": 3.0, "hf_cb": 2.5, "vllm": VLLM_TARGET,
                                    "kvserve_dense": None}
OVERHEAD_TARGET = 0.10
LABELS = {"kvserve": "kvserve", "hf_static": "HF generate, static batches of 16",
          "hf_cb": "HF continuous batching", "vllm": "vLLM-CPU",
          "kvserve_dense": "kvserve, dense F.linear"}


def _fmt_tps(r: dict) -> str:
    if "tok_s_mean" not in r:
        return "failed" if r.get("error") else "skipped" if r.get("skipped") else "—"
    return f"{r['tok_s_mean']:.1f} ± {r['tok_s_std']:.1f}"


def _fmt_ratio(x: float | None, target: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}×" if target is None else f"{x:.2f}× ({'met' if x >= target else 'MISSED'})"


def _pct(x: float | None, target: float | None = None) -> str:
    if x is None:
        return "—"
    verdict = "" if target is None else f" ({'met' if x < target else 'MISSED'})"
    return f"{100 * x:.1f}%{verdict}"


def _overheads(m: dict, seqs: int) -> tuple[dict, dict, dict]:
    """(steady state from the profile's plain steps, same from the timed run, all steps)."""
    ov = m["kvserve_step_overhead"]
    prof = m.get("kvserve_profile", {}).get("plain_steps", {})
    return prof, ov[f"decode_{seqs}_running"], ov["all_steps"]


def render_table(report: dict) -> str:
    """The generated block of the doc section: tables, errors, environment, command."""
    fp, st = report["fingerprint"], report["settings"]
    seqs = st["max_seqs"]
    lines = [
        "| model | dtype | params | requests × repeats | kvserve tok/s | HF static tok/s | HF CB tok/s "
        "| vLLM tok/s | kvserve dense-linear tok/s | kvserve / HF static (≥ 3×) "
        "| kvserve / HF CB (≥ 2.5×) | kvserve / vLLM (≥ 1.3×) | kvserve / dense-linear "
        f"(prepacking's gain) | outside forward, {seqs} decoding (< 10%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        s, r = m["systems"], m["ratios"]
        prof, timed, _ = _overheads(m, seqs)
        at = prof.get("outside_forward_share", timed.get("outside_forward_share"))
        lines.append(
            f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} | {m['params'] / 1e6:.2f}M "
            f"| {m['workload']['num_requests']} × {len(s['kvserve'].get('wall_s', []))} "
            f"| {' | '.join(_fmt_tps(s.get(k, {})) for k in SYSTEMS)} "
            f"| {' | '.join(_fmt_ratio(r.get(f'kvserve_over_{k}'), TARGETS[k]) for k in PEERS)} "
            f"| {_pct(at, OVERHEAD_TARGET)} |")
    lines += [
        "",
        f"kvserve step time. *Profiled*: {seqs} requests decoding, driven by hand "
        "(`--profile`); *timed run*: steps of the measured runs. CPU / wall is process "
        "CPU time over wall time per system (< 100%: other processes took the CPU); "
        "per CPU-second ratios divide useful tokens by CPU time instead of wall time.",
        "",
        f"| model | step ms, {seqs} decoding (profiled) | outside forward (profiled) "
        f"| steps with {seqs} decoding in timed run | outside forward there "
        "| outside forward, all timed steps | preemptions | CPU / wall: kvserve, static, CB, vLLM, dense "
        "| per CPU-second: kvserve / static, / CB, / vLLM, / dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        prof, timed, allv = _overheads(m, seqs)
        r = m["ratios"]
        cpu = []
        for k in SYSTEMS:
            res = m["systems"].get(k, {})
            cpu.append(_pct(sum(res["cpu_s"]) / sum(res["wall_s"])) if res.get("wall_s") else "—")
        step_ms = f"{prof['mean_step_ms']:.1f}" if "mean_step_ms" in prof else "—"
        lines.append(
            f"| {name} | {step_ms} | {_pct(prof.get('outside_forward_share'))} "
            f"| {timed['steps']} | {_pct(timed.get('outside_forward_share'))} "
            f"| {_pct(allv.get('outside_forward_share'))} | {m['kvserve_preemptions']} "
            f"| {', '.join(cpu)} | "
            + ", ".join(_fmt_ratio(r.get(f"kvserve_over_{k}_cpu_time"), TARGETS[k]) for k in PEERS)
            + " |")
    lines += [
        "",
        "Share of the machine: the forward FLOPs the workload needs (useful work only: no "
        "padding, no tokens past a request's length) over each system's wall time, against "
        "this machine's matmul rate at the model's MLP shape on the same thread count. The "
        "last column is the rate HF CB × 2.5 would take.",
        "",
        "| model | dtype | workload GFLOP | GEMM peak GFLOP/s | kvserve | HF static | HF CB "
        "| vLLM | HF CB × 2.5 needs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        if "gemm_peak_gflops" not in m:  # reports from before this table
            continue
        peak = m["gemm_peak_gflops"]
        cells = []
        for k in SYSTEMS:
            g = m["systems"].get(k, {}).get("gflops")
            cells.append(f"{g:.1f} ({100 * g / peak:.0f}%)" if g else "—")
        cb = m["systems"]["hf_cb"].get("gflops")
        need = f"{2.5 * cb:.1f} ({250 * cb / peak:.0f}%)" if cb else "—"
        lines.append(f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} "
                     f"| {m['workload_gflop']:.0f} | {peak:.1f} | {' | '.join(cells)} | {need} |")
    bounds = [(name, m, m["roofline"]) for name, m in report["models"].items() if "roofline" in m]
    if bounds:
        lines += [
            "",
            "The least wall time any engine could take on this workload here "
            "(benchmarks/roofline.py: the steps continuous batching runs it in; each step's "
            "linears, then its attention, at this machine's GEMM rate or its memory read "
            "rate, whichever is slower; *overlapped*: the whole step at the slower of the "
            "two), and each system's share of it (sequential bound / wall time). The bound "
            "is optimistic: attention at the GEMM rate, no sampling, no host work.",
            "",
            "| model | dtype | memory GB/s | steps | bound s, sequential (overlapped) "
            "| kvserve | vLLM | 1.3× vLLM needs |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for name, m, rf in bounds:
        shares = [_pct(rf["of_bound"].get(k)) for k in ("kvserve", "vllm")]
        lines.append(
            f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} | {m['memory_gbs']:.1f} "
            f"| {rf['steps']} | {rf['sequential_s']:.1f} ({rf['overlapped_s']:.1f}) "
            f"| {' | '.join(shares)} | {_pct(rf['vllm_x1.3_needs'])} |")
    kinds = [(name, m, rf["kvserve_by_kind"]) for name, m, rf in bounds if rf.get("kvserve_by_kind")]
    if kinds:
        lines += [
            "",
            "kvserve's timed steps by kind beside the same steps' sequential bound (per run): "
            "where its seconds over the bound are.",
            "",
            "| model | dtype | steps | count | kvserve s | bound s: linears + attention "
            "| share of the bound | over the bound, s |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for name, m, rows in kinds:
        for k in rows:
            b = k["linears_bound_s"] + k["attention_bound_s"]
            lines.append(
                f"| {name.partition(':')[0]} | {m.get('dtype', 'float32')} | {k['kind']} "
                f"| {k['steps']:.0f} | {k['seconds']:.2f} | {k['linears_bound_s']:.2f} + "
                f"{k['attention_bound_s']:.2f} | {_pct(b / k['seconds'] if k['seconds'] else None)} "
                f"| {k['seconds'] - b:.2f} |")
    for name, m in report["models"].items():
        for sys_name, r in m["systems"].items():
            if r.get("error"):
                lines += ["", f"{name} / {LABELS[sys_name]} failed:", "", "```",
                          r["error"], "```"]
            elif r.get("skipped") and r["skipped"] != "not in --systems":
                lines += ["", f"{name} / {LABELS[sys_name]}: {r['skipped']}"]
            elif not r.get("ok", True):
                lines += ["", f"{name} / {LABELS[sys_name]}: generated lengths differ "
                          "from the requested ones (see JSON)."]
    work = "; ".join(
        f"{name}: {m['workload']['num_requests']} requests, {m['workload']['prompt_tokens']} "
        f"prompt tokens, {m['workload']['output_tokens']} useful output tokens"
        for name, m in report["models"].items())
    dirty = f" + local changes (diff {fp['git_diff_sha256']})" if fp["git_dirty"] else ""
    lines += [
        "",
        f"Workload: prompts {st['prompt_range'][0]}–{st['prompt_range'][1]} tokens, "
        f"outputs {st['output_range'][0]}–{st['output_range'][1]} tokens, seed {st['seed']}, "
        f"greedy, EOS ignored ({work}); max_num_seqs {seqs}, "
        f"max_num_batched_tokens {st['max_batched_tokens']}.",
        "",
        *_thread_lines(st),
        f"Measured {fp['date_utc']} on {fp['cpu']} ({fp['cpu_count']} cores, "
        f"{'/'.join(fp['cpu_simd'])}), {st['threads']} thread(s), torch {fp['torch']}, "
        f"transformers {fp['transformers']}, commit {str(fp['git_commit'])[:10]}{dirty}; "
        f"load average {fp['loadavg_at_start'][0]:.2f} at start, "
        f"{fp['loadavg_at_end'][0]:.2f} at end. "
        "Full results: [../results/bench_offline.json](../results/bench_offline.json).",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        "![offline throughput](img/bench_offline.png)",
    ]
    return "\n".join(lines)


def _thread_lines(st: dict) -> list[str]:
    """How each system got its threads (reports from before issue 22 have no record)."""
    if "thread_settings" not in st:
        return []
    ts = st["thread_settings"]
    vllm = ", ".join(f"`{k}={v}`" for k, v in ts["vllm"].items())
    return [f"Threads: kvserve and HF in this process, {ts['in_process']}; vLLM "
            f"{st.get('vllm_version') or ''} in its own process, {vllm}.", ""]


def update_doc(path: str, block: str) -> None:
    """Replace the generated block of the section, keeping hand-written notes around it."""
    _update_doc(path, block, DOC_HEADING, BEGIN, END)


def plot(report: dict, path: str) -> None:
    """Bars per system, one panel per model (their scales differ by ~50×)."""
    plt = pyplot()
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.4 * len(models), 3.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        s = m["systems"]
        means = [s.get(k, {}).get("tok_s_mean", 0.0) for k in SYSTEMS]
        stds = [s.get(k, {}).get("tok_s_std", 0.0) for k in SYSTEMS]
        bars = ax.bar(["kvserve", "HF static\n(batches of 16)", "HF continuous\nbatching",
                       "vLLM-CPU", "kvserve\ndense linear"], means, yerr=stds, capsize=4,
                      color=["#2a7ab9", "#b0b0b0", "#e08a3c", "#6a9f58", "#9ec5e8"])
        for i, (b, v, sd) in enumerate(zip(bars, means, stds)):
            text = "—" if not v else f"{v:.1f}" if v < 100 else f"{v:.0f}"
            if v and i:
                text += f"\nkvserve {means[0] / v:.2f}×"
            ax.annotate(text, (b.get_x() + b.get_width() / 2, v + sd), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_title(f"{name.partition(':')[0]} {m.get('dtype', 'float32')}: "
                     f"{m['params'] / 1e6:.1f}M params, "
                     f"{m['workload']['num_requests']} requests × {len(s['kvserve']['wall_s'])}",
                     fontsize=9)
        ax.set_ylabel("useful output tokens / s (mean ± std)")
        ax.set_ylim(0, max(x + y for x, y in zip(means, stds)) * 1.3 or 1)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Offline throughput, {report['settings']['threads']} CPU thread(s) "
                 f"(higher is better)", fontsize=10)
    save_figure(fig, path)
