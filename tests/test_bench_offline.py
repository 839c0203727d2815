"""The offline benchmark end to end in --quick mode: it runs, and what it writes adds up.

Speed is not asserted (a test cannot know the machine); the real numbers come from
`python -m benchmarks.bench_offline` and live in docs/benchmarks.md. The run with HF
continuous batching is a subprocess: the script sets the OpenMP thread count in its
environment before torch loads, which is what reaches HF's own threads.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.bench_quick import run_quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("bench"))
    # vLLM's venv named missing: its rows are skipped with a note (what CI sees)
    return out, run_quick("benchmarks.bench_offline", out, "--profile", "--threads", "1",
                          "--vllm-python", os.path.join(out, "no-vllm", "python"), wait="spin",
                          process=True)


@pytest.mark.timeout(150)
def test_quick_json_is_complete_and_consistent(quick_run: tuple[str, dict]) -> None:
    out, report = quick_run
    with open(os.path.join(out, "bench_offline.json"), encoding="utf-8") as f:
        assert json.load(f) == report  # the committed copy is the run's JSON
    fp = report["fingerprint"]
    for key in ("cpu", "cpu_count", "torch", "transformers", "torch_threads", "git_commit",
                "date_utc"):
        assert key in fp, key
    assert fp["torch_threads"] == 1 and fp["omp_num_threads_env"] == "1"

    m = report["models"]["tiny"]
    w = m["workload"]
    assert w["num_requests"] == 8
    assert w["prompt_min"] >= 4 and w["prompt_max"] <= 24
    assert w["output_min"] >= 2 and w["output_max"] <= 12
    assert "make vllm-venv" in m["systems"]["vllm"]["skipped"]
    assert not m["systems"]["vllm"]["wall_s"] and m["ratios"]["kvserve_over_vllm"] is None
    assert report["settings"]["thread_settings"]["vllm"]["VLLM_CPU_OMP_THREADS_BIND"]
    # as `kvserve generate` runs by default: the bounded spin
    assert fp["omp_wait_policy_env"] is None and fp["gomp_spincount_env"] == "30000"
    assert m["systems"]["kvserve_dense"]["skipped"] == "not in --systems"  # opt-in
    for name, r in m["systems"].items():
        if name in ("vllm", "kvserve_dense"):
            continue
        assert "error" not in r, (name, r.get("error"))
        assert r["ok"], f"{name} generated other lengths than requested"
        assert len(r["wall_s"]) == len(r["cpu_s"]) == len(r["tok_s"]) == 1
        # useful tokens/s is the requested output total over the wall time, nothing else
        assert r["tok_s"][0] == pytest.approx(w["output_tokens"] / r["wall_s"][0])
        assert r["tok_s_mean"] > 0
    sys_ = m["systems"]
    for other in ("hf_static", "hf_cb"):
        for metric, tag in (("tok_s_mean", ""), ("tok_per_cpu_s_mean", "_cpu_time")):
            expect = sys_["kvserve"][metric] / sys_[other][metric]
            assert m["ratios"][f"kvserve_over_{other}{tag}"] == pytest.approx(expect)

    # Useful work over wall time, against the machine's matmul rate.
    assert m["workload_gflop"] > 0 and m["gemm_peak_gflops"] > 0
    for r in (r for r in sys_.values() if r["wall_s"]):
        mean_wall = sum(r["wall_s"]) / len(r["wall_s"])
        assert r["gflops"] == pytest.approx(m["workload_gflop"] / mean_wall)
    # ... and against the least wall time any engine could take here (benchmarks/roofline.py)
    rf = m["roofline"]
    assert m["memory_gbs"] > 0 and 0 < rf["overlapped_s"] <= rf["sequential_s"]
    assert rf["steps"] >= w["output_max"]  # a decode step per output token, at least
    for name, r in sys_.items():
        if r["wall_s"]:
            share = rf["sequential_s"] / (sum(r["wall_s"]) / len(r["wall_s"]))
            assert rf["of_bound"][name] == pytest.approx(share)
    assert rf["vllm_x1.3_needs"] is None  # no vLLM here
    # kvserve's timed steps follow the bound's schedule: by kind, they add up to them
    kinds = rf["kvserve_by_kind"]
    assert kinds and kinds[0]["kind"] == "prompt"
    assert sum(k["steps"] for k in kinds) == rf["steps"]
    assert sum(k["linears_bound_s"] + k["attention_bound_s"] for k in kinds) == \
        pytest.approx(rf["sequential_s"])

    # the linear layers' kernels as the engine chose them (engine/linear_choice.py), one
    # entry per layer shape
    linear = m["kvserve_linear"]
    assert linear and all(c["layout"] in ("panels", "onednn", "dense") for c in linear)
    assert {c["source"] for c in linear} <= {"measured", "cached", "vendor", "only"}
    assert sum(c["layers"] for c in linear) == 2 * 4 + 1  # tiny: 2 layers of 4, and the head
    steps = m["kvserve_step_overhead"]["all_steps"]
    assert steps["steps"] > 0 and 0 <= steps["outside_forward_share"] < 1
    prof = m["kvserve_profile"]
    assert prof["plain_steps"]["steps"] == prof["plain_steps_each"]  # every plain step at 8 running
    assert prof["cprofile_points"] and prof["torch_ops_top_self_cpu"]


def test_quick_writes_doc_and_plot_under_out(quick_run: tuple[str, dict]) -> None:
    out, _ = quick_run
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert "## Offline throughput (issue 2)" in doc
    assert "| tiny |" in doc and "python -m benchmarks.bench_offline --quick" in doc
    assert "tiny / vLLM-CPU: vLLM skipped: no vLLM venv at" in doc
    assert "| model | dtype | memory GB/s | steps | bound s, sequential (overlapped)" in doc
    assert "| tiny | float32 | prompt |" in doc  # the steps by kind beside their bound
    with open(os.path.join(out, "bench_offline.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_update_doc_replaces_only_the_generated_block(tmp_path) -> None:
    from benchmarks.bench_offline_report import BEGIN, DOC_HEADING, END, update_doc

    path = str(tmp_path / "benchmarks.md")
    update_doc(path, "table v1")  # a fresh file gets the heading and the block
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert DOC_HEADING in text and "table v1" in text
    notes = "\nHand-written method notes.\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(END, END + notes) + "\n## Later section\n\nkept\n")
    update_doc(path, "table v2")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert "table v2" in text and "table v1" not in text
    assert notes in text and "## Later section\n\nkept" in text
    assert text.count(BEGIN) == text.count(DOC_HEADING) == 1


def test_from_json_redraws_without_measuring(quick_run: tuple[str, dict], tmp_path) -> None:
    from benchmarks.bench_offline import main

    out, report = quick_run
    src = glob.glob(os.path.join(out, "bench_offline-*.json"))[0]
    doc, res, png = (str(tmp_path / n) for n in ("b.md", "r.json", "p.png"))
    again = main(["--from-json", src, "--doc", doc, "--results", res, "--plot", png])
    assert again == report
    with open(doc, encoding="utf-8") as f:
        assert "| tiny |" in f.read()
    assert os.path.getsize(png) > 0 and os.path.exists(res)


def test_workload_gflop_counts_linears_head_and_attention() -> None:
    """One request, prompt 3 + 2 outputs, on a 1-layer model: 4 tokens through the
    layer, 2 through the head, attention over 1 + 2 + 3 + 4 cached tokens."""
    from benchmarks.bench_offline import workload_gflop
    from benchmarks.bench_offline_systems import Workload

    cfg = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=16, vocab_size=10)
    linear = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16  # q+o, k+v (one kv head of dim 4), MLP
    want = 2 * linear * 4 + 2 * 8 * 10 * 2 + 4 * 8 * 1 * (1 + 2 + 3 + 4)
    assert workload_gflop(cfg, Workload([[7, 8, 9]], [2])) * 1e9 == pytest.approx(want)


@pytest.mark.timeout(150)
def test_quick_runs_the_moe_and_gemma3_shapes_beside_a_broken_vllm(tmp_path) -> None:
    """Issue 66's shapes (`--models moe,gemma3`) at their --quick size: a Qwen3-MoE and a
    Gemma 3 built from configs, served by kvserve and HF `generate` alike, every request
    at its length, the ratio of the two in the report. In the same run a broken vLLM venv
    (its python exits at once) fails vLLM's row with the reason, and the other rows are
    still measured and the run completes (one run: each costs a process and its models).
    The --out folder need not exist (vLLM's log is the first file written there)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)
    out = tmp_path / "new"
    report = run_quick("benchmarks.bench_offline", str(out), "--threads", "1",
                       "--models", "tiny_moe,tiny_gemma3", "--systems", "kvserve,hf_static,vllm",
                       "--vllm-python", str(fake), wait="spin")
    assert list(report["models"]) == ["tiny_moe", "tiny_gemma3"]
    for name, kind in (("tiny_moe", "qwen3_moe"), ("tiny_gemma3", "gemma3_text")):
        m = report["models"][name]
        assert m["config"]["model_type"] == kind
        for s in ("kvserve", "hf_static"):
            r = m["systems"][s]
            assert "error" not in r and r["ok"] and r["tok_s_mean"] > 0, (name, s, r)
        assert m["ratios"]["kvserve_over_hf_static"] == pytest.approx(
            m["systems"]["kvserve"]["tok_s_mean"] / m["systems"]["hf_static"]["tok_s_mean"])
        assert "vLLM exited with 3" in m["systems"]["vllm"]["error"]
        assert m["systems"]["hf_cb"]["skipped"]
    doc = (out / "benchmarks.md").read_text()
    assert "tiny_moe / vLLM-CPU failed:" in doc and "tiny_gemma3 / vLLM-CPU failed:" in doc


def test_workload_gflop_of_a_moe_counts_the_experts_a_token_takes() -> None:
    """A mixture of experts costs a token its router and its k experts' MLPs, not all E
    (nor the dense intermediate_size its config also carries); head_dim as given."""
    from benchmarks.roofline import ModelCost

    cfg = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, head_dim=3,
               num_key_value_heads=1, intermediate_size=999, vocab_size=10, num_experts=5,
               num_experts_per_tok=2, moe_intermediate_size=4)
    linear = 2 * 8 * 2 * 3 + 2 * 8 * 3 + 8 * 5 + 2 * 3 * 8 * 4  # q+o, k+v, router, 2 experts
    cost = ModelCost.of(cfg)
    assert cost.linear_params == linear and cost.attn_flop == 4 * 2 * 3
