"""The policies benchmark end to end in --quick mode: it runs, and what it writes adds up.

Speed is never asserted (a test cannot know the machine); the real numbers come from
`python -m benchmarks.bench_policies` and live in docs/benchmarks.md. In this process
(tests/bench_quick.py: the thread settings it pins are put back after it).
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest

from tests.bench_quick import run_quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("bench"))
    return out, run_quick("benchmarks.bench_policies", out, "--no-progress")


@pytest.mark.timeout(150)
def test_throughput_and_overhead_add_up(quick_run: tuple[str, dict]) -> None:
    out, report = quick_run
    with open(os.path.join(out, "bench_policies.json"), encoding="utf-8") as f:
        assert json.load(f) == report  # the committed copy is the run's JSON
    fp, st = report["fingerprint"], report["settings"]
    for key in ("cpu", "cpu_count", "torch", "git_commit", "date_utc", "loadavg_at_end"):
        assert key in fp, key
    assert fp["torch_threads"] == 1 and fp["omp_num_threads_env"] == "1"

    t = report["throughput"]
    ctx = st["prompt"] + st["gen"]
    assert t["context"] == ctx and t["budget_tokens"] == round(st["budget"] * ctx)
    assert t["num_blocks"] == st["fit"] * 2 * math.ceil(ctx / 16)  # tiny: 2 layers
    assert list(t["policies"]) == ["full", "full:vllm", "full:fit", *st["policies"]]
    assert len(st["policies"]) == 11
    for name, r in t["policies"].items():
        assert r["all_lengths_ok"], name
        assert r["output_tokens"] == st["requests"] * st["gen"]
        assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert 0 < r["mean_running"] <= r["max_running"] <= st["requests"]
        assert r["tok_s_vs_full"] == pytest.approx(r["tok_s"] / t["policies"]["full"]["tok_s"])
        assert 0 < r["p50_e2e_s"] <= r["p99_e2e_s"]
        assert 0 <= r["policy_share"] < 1
        a = r["anatomy"]  # every step counted once, by kind
        assert sum(k["steps"] for k in a.values()) == r["steps"]
        assert a["prefill"]["steps"] > 0 and a["wide"]["steps"] > 0
        assert all(k["forward_s"] + k["policy_s"] <= k["s"] for k in a.values())
    full = t["policies"]["full"]
    assert full["max_peak_live_tokens"] == ctx - 1  # a full cache keeps every token
    assert full["preemptions"] > 0  # the pool really is too small for a full cache
    # a preempted request comes back only once it can finish: recomputed at most once
    assert full["preemptions"] <= st["requests"]
    assert t["policies"]["full:vllm"]["preemptions"] >= full["preemptions"]
    fit = t["policies"]["full:fit"]
    assert fit["max_running"] <= st["fit"] and fit["preemptions"] == 0
    fastest = max(r["tok_s"] for n, r in t["policies"].items() if n.startswith("full"))
    for r in t["policies"].values():
        assert r["tok_s_vs_best_full"] == pytest.approx(r["tok_s"] / fastest)
    assert t["policies"]["streaming"]["max_peak_live_tokens"] < ctx - 1  # it evicts
    c = t["ceiling"]  # the pool packed with budget-sized requests: more than full can hold
    assert c["requests"] == t["num_blocks"] // (2 * math.ceil(t["budget_tokens"] / 16)) > st["fit"]
    assert c["tok_s_vs_full"] == pytest.approx(c["tok_s"] / full["tok_s"])
    assert c["tok_s_vs_best_full"] == pytest.approx(c["tok_s"] / fastest)
    assert c["kv_share_of_step"] == pytest.approx(1 - c["tok_s"] / c["tok_s_no_kv"])
    # measured before the first run and after each; each run read against its two
    runs = list(t["policies"].values())
    assert c["measurements"] == len(runs) + 1
    assert c["tok_s_first"] == runs[0]["ceiling_around"][0]
    assert c["tok_s_last"] == runs[-1]["ceiling_around"][1]
    for a, b in itertools.pairwise(runs):
        assert a["ceiling_around"][1] == b["ceiling_around"][0]
    for r in runs:
        assert r["of_ceiling"] == pytest.approx(2 * r["tok_s"] / sum(r["ceiling_around"]))
        assert len(r["rounds"]) == 1 and r["of_ceiling_median"] == r["of_ceiling"]
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert f"after each, {len(runs) + 1} times" in doc
    # beside each median, the same steps' mean
    assert len(c["tok_s_mean_steps"]) == c["measurements"]
    assert c["tok_s_mean_step"] == pytest.approx(sum(c["tok_s_mean_steps"]) / c["measurements"])
    assert "from the ceiling steps' mean rather than their median" in doc
    assert "Each run against the ceiling measured right before and right after it" in doc
    # the waves the pool forces: requests holding budget + 1 tokens, as many as fit
    fit = t["num_blocks"] // (2 * math.ceil((t["budget_tokens"] + 1) / 16))
    assert sum(c["waves"]) == st["requests"] and max(c["waves"]) == fit
    assert c["tok_s_waves_vs_full"] == pytest.approx(c["tok_s_waves"] / full["tok_s"])

    o = report["overhead"]
    for name, r in o["policies"].items():
        assert r["steps"] > 0, name
        assert 0 <= r["policy_share"] < 1 and r["mean_policy_ms"] <= r["mean_step_ms"]
        assert (r["policy_seconds_total"] > 0) == (name != "full")


@pytest.mark.timeout(150)
def test_quality_rows_are_consistent(quick_run: tuple[str, dict]) -> None:
    _, report = quick_run
    q, st = report["quality"], report["settings"]
    if "skipped" in q:  # no demo model in this checkout: the reason is recorded
        assert "demo model" in q["skipped"]
        return
    rows = q["rows"]
    assert (rows[0]["policy"], rows[0]["budget"]) == ("full", 1.0)
    assert len(rows) == 1 + len(st["quality_budgets"]) * len(st["policies"])
    # kvserve's full cache, teacher-forced step by step, equals one transformers forward
    assert q["full_matches_reference"]
    assert rows[0]["ppl"] == pytest.approx(q["reference_ppl_transformers"], rel=1e-3)
    for r in rows:
        assert r["ppl"] == pytest.approx(math.exp(r["nll"]))
        by_depth = r["needle_by_depth"]
        assert len(by_depth) == 5 and all(0 <= v <= 1 for v in by_depth.values())
        assert r["needle_mean"] == pytest.approx(sum(by_depth.values()) / len(by_depth))
    kv = q["kvpress"]  # kvpress's presses beside ours, or why not (no .venv-kvpress)
    if "skipped" in kv:
        assert "kvpress" in kv["skipped"]
        return
    # the exchange carried the same windows and prompts: its full cache is ours
    full = next(r for r in kv["rows"] if r["method"] == "full")
    assert full["ppl"] == pytest.approx(rows[0]["ppl"], rel=1e-3)
    assert full["needle_mean"] == rows[0]["needle_mean"]


def test_quick_writes_doc_and_plot_under_out(quick_run: tuple[str, dict]) -> None:
    out, _ = quick_run
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert "## KV eviction policies under memory pressure (issue 5)" in doc
    assert "| streaming |" in doc and "python -m benchmarks.bench_policies --quick" in doc
    assert "**Ceiling on this machine.**" in doc
    assert "**In the waves this pool allows a policy that evicts after" in doc
    assert "Where each run's time went" in doc
    with open(os.path.join(out, "bench_policies.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_gen_lengths_spread_is_seeded_and_bounded() -> None:
    from benchmarks.bench_policies import gen_lengths

    assert gen_lengths(5, 100, 0.0, 0) == [100] * 5  # the lockstep workload
    a = gen_lengths(200, 1000, 0.5, 3)
    assert a == gen_lengths(200, 1000, 0.5, 3)  # every policy gets the same lengths
    assert min(a) >= 500 and max(a) <= 1500 and len(set(a)) > 100
    assert abs(sum(a) / len(a) - 1000) < 60


@pytest.mark.timeout(150)
def test_variants_spread_lengths_and_no_baselines(tmp_path) -> None:
    """One run for the options and variants beside the defaults (each quick run costs a
    process, a model and its ceiling measurements):

    - `--gen-spread` gives every request its own seeded length, all generated exactly;
      `--baselines ''` runs `full` the default way only; `--dtype` sets the weights'.
    - `<policy>:unbatched` runs the same policy with every request stepped alone
      (`batch_policies=False`) in the same run; the batched step keeps the same tokens,
      so both rows generate the same output and hold the same live tokens.
    - `streaming:noring` runs StreamingLLM appending and evicting after the step
      (`streaming_ring=False`) beside its ring in the same run, both to their lengths,
      the ring at least as many at once (a block less a layer each); the overhead part
      runs it that way too (its own row: the evictions the ring does in place are
      policy steps)."""
    from benchmarks.bench_policies import gen_lengths

    names = ["h2o", "h2o:unbatched", "streaming", "streaming:noring"]
    report = run_quick("benchmarks.bench_policies", str(tmp_path), "--no-progress", "--parts",
                       "throughput,overhead", "--policies", ",".join(names), "--baselines", "",
                       "--gen-spread", "0.3", "--dtype", "bfloat16", "--rounds", "2")
    st, t = report["settings"], report["throughput"]
    doc = (tmp_path / "benchmarks.md").read_text()
    assert st["baselines"] == [] and st["gen_spread"] == 0.3 and st["dtype"] == "bfloat16"
    assert "weights in bfloat16" in doc
    rows = t["policies"]
    assert list(rows) == ["full", *names]
    want = sum(gen_lengths(st["requests"], st["gen"], 0.3, st["seed"]))
    for r in rows.values():
        assert r["all_lengths_ok"] and r["output_tokens"] == want
    assert rows["streaming"]["max_running"] > st["fit"]

    a, b = rows["h2o"], rows["h2o:unbatched"]
    assert a["kv_policy"] == b["kv_policy"]
    assert a["max_peak_live_tokens"] == b["max_peak_live_tokens"]
    assert a["preemptions"] == b["preemptions"]  # same kept tokens: same scheduling
    assert "h2o:unbatched | budget" in doc and "`batch_policies=False`" in doc

    over = report["overhead"]["policies"]
    assert list(over) == ["full", *names]
    assert over["streaming:noring"]["mean_policy_ms"] > over["streaming"]["mean_policy_ms"]
    for r in over.values():  # the overhead part's rounds too (full's included): medians
        assert len(r["share_by_round"]) == 2
        assert r["policy_share"] == pytest.approx(sum(r["share_by_round"]) / 2)
    a, b = rows["streaming"], rows["streaming:noring"]
    assert a["kv_policy"] == b["kv_policy"]
    assert a["max_running"] >= b["max_running"]
    # two rounds of each policy (full once), the second in reverse order: the ceiling
    # measured between any two runs is the one after the first and before the second
    # (noring last in the first round, so first in the second)
    assert [len(r["rounds"]) for r in rows.values()] == [1, 2, 2, 2, 2]
    assert b["rounds"][0]["ceiling_around"][1] == b["rounds"][1]["ceiling_around"][0]
    assert t["ceiling"]["measurements"] == 2 + 2 * len(names)
    assert "streaming:noring | " in doc and "`streaming_ring=False`" in doc
    assert "| run 1 | run 2 | median share |" in doc
    assert "Medians of 2 rounds" in doc and "| share by round |" in doc


def test_unknown_policy_variant_is_refused() -> None:
    from benchmarks.bench_policies import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--policies", "h2o:fast"])
    with pytest.raises(SystemExit):
        parse_args(["--policies", "nope"])
    assert parse_args(["--policies", "tova,tova:unbatched"]).policies == ["tova", "tova:unbatched"]


def test_quality_variant_sets_parameters_per_budget() -> None:
    """'<policy>/<key>=<value>': a value with '.' is a fraction of the budget, so one
    variant means the same at 25% and 50%."""
    from benchmarks.bench_policies import parse_args
    from benchmarks.policy_eval import policy_config

    assert policy_config("paged_eviction/window=0.5", 192) == {
        "name": "paged_eviction", "budget": 192, "window": 96}
    assert policy_config("knorm/window=8", 64) == {"name": "knorm", "budget": 64, "window": 8}
    args = parse_args(["--quality-variants", "knorm/window=0.5;keydiff/window=4"])
    assert args.quality_variants == ["knorm/window=0.5", "keydiff/window=4"]
    with pytest.raises(SystemExit):
        parse_args(["--quality-variants", "nope/window=1"])


def test_a_throughput_only_plot_shows_where_the_time_went(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path) -> None:
    """Without the overhead part the second panel stacks each run's seconds by kind of
    step (`step_anatomy`) instead of staying empty: one bar segment per run and kind."""
    from benchmarks import bench_common as bc
    from benchmarks import bench_policies_report

    figures = []
    monkeypatch.setattr(bc, "save_figure", lambda fig, path: figures.append(fig))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "results", "bench_policies_issue18_throughput_s25.json"),
              encoding="utf-8") as f:
        report = json.load(f)
    bench_policies_report.plot(report, str(tmp_path / "p.png"))
    runs = report["throughput"]["policies"]
    panel = figures[0].axes[1]
    assert len(panel.patches) == 4 * len(runs)  # prefill, wide, wide's policy, narrow
    heights = [p.get_height() for p in panel.patches]
    pyramid = list(runs).index("pyramid")
    assert heights[2 * len(runs) + pyramid] == pytest.approx(
        runs["pyramid"]["anatomy"]["wide"]["policy_s"])
