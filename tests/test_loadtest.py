"""The load generator (`python -m loadtest`, `python -m loadtest serve`) against a real kvserve
on 127.0.0.1: every arrival mode for a few seconds, with the numbers checked against
each other (usage vs streamed tokens vs the server's own counters, ordered percentiles,
goodput <= throughput), failures counted by status, a short soak with disconnects and
malformed requests, and the Locust file."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from loadtest import prom
from loadtest.client import ClientConfig, sse_lines
from loadtest.metrics import format_summary, parse_goodput, summarize
from loadtest.runner import RunConfig, arrival_times, run_level, run_specs
from loadtest.workloads import (
    LengthDist,
    RequestSpec,
    TextMaker,
    WorkloadConfig,
    build_requests,
    load_tokenizer,
    parse_policy_mix,
)
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from server.app import build_app
from server.settings import ServerSettings
from server.testing import ServerThread
from tests.tiny_models import make_tiny_model

CONTEXT = 256  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=1024))
    app = build_app(engine, ServerSettings(served_model_names=["tiny"], model_path=model_dir))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def maker(model_dir: str) -> TextMaker:
    return TextMaker(0, load_tokenizer(model_dir))


def small(n: int = 12, seed: int = 0, **kw: Any) -> WorkloadConfig:
    return WorkloadConfig(num_requests=n, seed=seed, prompt=LengthDist(24, 0.5, 4, 64),
                          output=LengthDist(10, 0.5, 2, 24), max_model_len=CONTEXT, **kw)


def cfg_for(server: ServerThread, **kw: Any) -> RunConfig:
    client = ClientConfig(model="tiny", logprobs=0)
    return RunConfig(base_url=server.url, client=client, progress=False,
                     percentiles=(50, 90, 99), **kw)


def check_consistent(level: dict[str, Any], concurrency: int | None = None) -> dict[str, Any]:
    s, rows = level["summary"], level["requests"]
    assert s["completed"] == s["num_requests"] == len(rows), s["failures_by_status"]
    # tokens: usage == the tokens streamed in logprobs == max_tokens (EOS ignored)
    assert s["token_count_checked"] == s["completed"] and s["token_count_mismatches"] == 0
    for r in rows:
        assert r["usage_output_tokens"] == r["streamed_tokens"] == r["max_tokens"], r
        assert abs(r["prompt_tokens"] - r["prompt_len"]) <= 2, r  # exact tokenizer lengths
        assert 0 < r["ttft"] <= r["e2el"]
        assert 1 <= r["chunks"] <= r["output_tokens"]
    assert s["total_output_tokens"] == sum(r["max_tokens"] for r in rows)
    assert math.isclose(s["output_throughput"] * s["duration"], s["total_output_tokens"])
    # the server counted the same tokens
    assert s["server_metrics"]["generation_tokens"] == s["total_output_tokens"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = s[key]
        assert 0 < st["p50"] <= st["p90"] <= st["p99"], (key, st)
        assert st["p50"] == st["median"]
    assert s["ttft_ms"]["p99"] <= s["e2el_ms"]["p99"]
    if s["slos_ms"]:
        assert s["request_goodput"] <= s["request_throughput"]
    if concurrency is not None:
        assert 1 <= s["peak_concurrent_requests"] <= concurrency
    assert s["peak_output_throughput"] >= 1
    return s


def test_closed_loop(server: ServerThread, maker: TextMaker) -> None:
    cfg = cfg_for(server, mode="closed", concurrency=4,
                  slos=parse_goodput(["ttft:60000", "tpot:60000", "e2el:60000"]))
    level = asyncio.run(run_level(small(16), cfg, maker))
    s = check_consistent(level, 4)
    assert s["request_goodput"] == s["request_throughput"]  # SLOs nobody misses
    assert s["peak_concurrent_requests"] >= 2
    strict = summarize([], 1.0)
    assert strict["completed"] == 0 and strict["ttft_ms"]["mean"] == 0.0
    text = format_summary(s)
    assert "Request goodput (req/s):" in text and "Maximum request concurrency:" in text
    # bench_serving's lists for a report: in send order (the runner collects requests as
    # they finish), so that a closed loop's first `concurrency` entries are its first wave
    from loadtest.bench_serving import _compact

    compact = _compact(level)
    sent = sorted(level["requests"], key=lambda r: r["start"])
    assert level["requests"] != sent  # 2-24 tokens each: later, shorter ones finish first
    assert compact["start_list_s"] == sorted(compact["start_list_s"])
    assert compact["ttft_list_ms"] == [round(r["ttft"] * 1000, 2) for r in sent]


@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
def test_open_loop(server: ServerThread, maker: TextMaker, arrival: str) -> None:
    cfg = cfg_for(server, mode="open", concurrency=None, request_rate=15.0, arrival=arrival,
                  burstiness=0.5, slos=parse_goodput(["ttft:1", "e2el:5000"]))
    level = asyncio.run(run_level(small(10, seed=3), cfg, maker))
    s = check_consistent(level)
    assert s["request_goodput"] <= s["request_throughput"]
    assert s["good_requests"] <= s["completed"]
    # sends follow the precomputed arrival offsets
    offsets = arrival_times(10, 15.0, arrival, 0.5, cfg.seed)
    starts = sorted(r["start"] for r in level["requests"])
    assert starts[-1] >= offsets[-1] - 0.05
    assert "Request rate configured (RPS):" in format_summary(s)


def test_arrival_processes() -> None:
    for arrival in ("poisson", "gamma"):
        t = arrival_times(4000, 50.0, arrival, 0.5, seed=1)
        assert t == arrival_times(4000, 50.0, arrival, 0.5, seed=1)
        gaps = [b - a for a, b in itertools.pairwise(t)]
        assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.003
    assert arrival_times(3, math.inf, "poisson", 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, "uniform", 1.0, 0)


def test_failures_counted_by_status(server: ServerThread, maker: TextMaker) -> None:
    ok = build_requests(small(3), maker)
    too_long = RequestSpec("x" * (CONTEXT + 10), 8, CONTEXT + 10)  # 400: over the context
    bad_policy = RequestSpec("hello", 4, 5, kv_policy="no-such-policy")  # 400
    specs = [*ok, too_long, bad_policy]
    cfg = cfg_for(server, concurrency=2)
    results, wall = asyncio.run(run_specs(specs, cfg))
    wrong_model = replace(cfg, client=replace(cfg.client, model="nope"))  # 404
    results += asyncio.run(run_specs(ok[:1], wrong_model))[0]
    s = summarize(results, wall)
    assert s["completed"] == 3 and s["failed"] == 3
    assert s["failures_by_status"] == {"400": 2, "404": 1}
    assert "400=2, 404=1" in format_summary(s)
    bad = [r for r in results if not r.ok]
    assert all(r.error and r.ttft is None for r in bad)


def test_workloads_chat_shared_prefix_long_sharegpt(server: ServerThread, maker: TextMaker,
                                                    tmp_path: Any) -> None:
    cfg = cfg_for(server, concurrency=3)
    chat = replace(cfg, client=replace(cfg.client, endpoint="/v1/chat/completions"))
    shared = small(9, kind="shared-prefix", num_system_prompts=2, system_prompt_len=64,
                   chat=True)
    specs = build_requests(shared, maker)
    assert len({s.system for s in specs}) == 2 and all(s.system for s in specs)
    level = asyncio.run(run_level(shared, chat, maker))
    s = level["summary"]
    assert s["completed"] == 9 and s["token_count_mismatches"] == 0
    assert s["prefix_hit_tokens"] > 0  # the system prompts were reused
    long = small(3, kind="long", long_prompt_len=180)
    assert all(160 <= r.prompt_len <= 200 for r in build_requests(long, maker))
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "tell me a story"},
                           {"from": "gpt", "value": "once upon a time there was"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "human", "value": "count"}, {"from": "gpt", "value": "1 2"}]},
    ]))
    sg = small(4, kind="sharegpt", sharegpt_path=str(path))
    assert [r.max_tokens for r in build_requests(sg, maker)] == [24, 3, 24, 3]  # reply lengths, capped
    for wl in (long, sg):
        assert asyncio.run(run_level(wl, cfg, maker))["summary"]["completed"] == wl.num_requests


def test_prompts_are_varied_and_seeded(maker: TextMaker) -> None:
    wl = small(200)
    a, b = build_requests(wl, maker), build_requests(wl, maker)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert [x.prompt for x in a] != [x.prompt for x in build_requests(small(200, seed=1), maker)]
    heads = {str(x.prompt)[:12] for x in a}
    assert len(heads) > 190  # no shared prefixes to flatter a prefix cache
    rng_text = maker.text(100, __import__("random").Random(0))
    assert abs(len(maker.tokenizer.encode(rng_text, add_special_tokens=False)) - 100) <= 2
    ids = build_requests(small(5, token_ids=True, vocab_size=261), maker)
    assert all(isinstance(x.prompt, list) and len(x.prompt) == x.prompt_len for x in ids)


def test_policy_mix_parsing() -> None:
    assert parse_policy_mix("full:0.5,streaming:0.5") == [(0.5, "full"), (0.5, "streaming")]
    mix = parse_policy_mix('[[1, "full"], [3, {"name": "streaming", "window": 8}]]')
    assert mix[1] == (3.0, {"name": "streaming", "window": 8})
    with pytest.raises(ValueError):
        parse_policy_mix("full:0")
    with pytest.raises(ValueError):
        parse_goodput(["ttft=5"])


def test_cli_sweep_policy_mix_json_and_plots(server: ServerThread, model_dir: str,
                                             tmp_path: Any, capsys: Any) -> None:
    from loadtest.__main__ import main as loadtest_main

    out = tmp_path / "r.json"
    mix = '[[0.5, "full"], [0.5, {"name": "streaming", "sink": 2, "window": 8}]]'
    rc = loadtest_main(["serve", "--base-url", server.url, "--concurrency", "1,3",
                        "--num-prompts", "6", "--prompt-len-median", "24",
                        "--output-len-median", "12", "--max-model-len", str(CONTEXT),
                        "--tokenizer", model_dir, "--logprobs", "0", "--kv-policy-mix", mix,
                        "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(out),
                        "--plots", str(tmp_path / "p"), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("============ Serving Benchmark Result ============") == 2
    for label in ("Successful requests:", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P90 E2EL (ms):"):
        assert label.ljust(40) in text
    result = json.loads(out.read_text())
    assert result["environment"]["cpu_count"] and result["environment"]["torch"]
    assert result["server"]["version"]
    assert [lv["summary"]["max_concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        s = lv["summary"]
        assert s["completed"] == 6 and s["request_goodput"] <= s["request_throughput"]
        assert set(s["by_tag"]) == {"full", "streaming(sink=2,window=8)"}
        assert sum(t["completed"] for t in s["by_tag"].values()) == 6
    for name in ("p_cdf.png", "p_sweep.png", "p_tags.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_soak_with_disconnects_and_malformed(server: ServerThread, model_dir: str,
                                             tmp_path: Any) -> None:
    from loadtest.soak import main as soak_main

    out = tmp_path / "soak.json"
    # bounded by a count, not a time: the same requests (seeded) on a fast or slow engine
    rc = soak_main(["--base-url", server.url, "--minutes", "2", "--max-requests", "40",
                    "--concurrency", "4",
                    "--tokenizer", model_dir, "--max-model-len", str(CONTEXT),
                    "--prompt-len", "24", "--output-len", "16", "--disconnect-fraction", "0.3",
                    "--malformed-fraction", "0.15", "--rss-every", "1",
                    "--max-rss-growth", "50", "--result-json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, r["problems"]
    assert r["leaked_blocks"] == 0 and r["idle_after"]["idle"]
    assert not r["server_errors"] and not r["malformed_accepted"]
    counts = r["counts"]
    assert counts.get("disconnect:disconnected", 0) >= 3, counts
    assert sum(v for k, v in counts.items() if k.startswith("malformed:4")) >= 3, counts
    assert counts.get("normal:200", 0) >= 10, counts
    samples = prom.scrape(server.url)
    assert prom.value(samples, "kvserve_kv_blocks", state="used") == 0


def test_soak_spawned_server(model_dir: str, tmp_path: Any) -> None:
    """`--spawn`: kvserve as a child process, RSS from /proc, a clean drain at the end,
    and the result written into a markdown file between the soak markers."""
    from loadtest.soak import SOAK_BEGIN, SOAK_END
    from loadtest.soak import main as soak_main

    doc = tmp_path / "bench.md"
    doc.write_text(f"# B\n\n## Serving benchmarks (issue 8)\n\n{SOAK_BEGIN}\nold\n{SOAK_END}\n\n"
                   "## Later section\n")
    out = tmp_path / "soak.json"
    rc = soak_main(["--spawn", "--model", model_dir, "--minutes", str(5 / 60),
                    "--concurrency", "3", "--max-model-len", str(CONTEXT), "--prompt-len", "16",
                    "--output-len", "8", "--rss-every", "1", "--max-rss-growth", "50",
                    "--result-json", str(out), "--doc", str(doc)])
    r = json.loads(out.read_text())
    assert rc == 0, r["problems"]
    assert r["rss_base_bytes"] > 10 * 2**20 and len(r["rss_trace"]) >= 2
    assert r["leaked_blocks"] == 0 and r["server_exit_code"] == 0
    assert not os.path.exists(f"/proc/{r['server_pid']}")  # stopped, and only once started
    text = doc.read_text()
    assert "old" not in text and "**Soak: " in text and text.endswith("## Later section\n")


def test_locustfile(server: ServerThread, tmp_path: Any) -> None:
    if importlib.util.find_spec("locust") is None:  # never import it here: gevent patches
        pytest.skip("locust is not installed (pip install -e .[dev])")  # the whole process
    env = {**os.environ, "LOADTEST_PROMPT_LEN": "16", "LOADTEST_OUTPUT_LEN": "8",
           "LOADTEST_CHARS_PER_TOKEN": "1", "LOADTEST_KV_POLICY_MIX": "full:1"}
    locustfile = os.path.join(os.path.dirname(__file__), "..", "loadtest", "locustfile.py")
    p = subprocess.run([sys.executable, "-m", "locust", "-f", locustfile, "--headless",
                        # 8 s: in a loaded full-suite run 3 s once ended before any
                        # request completed (an empty stats file)
                        "-u", "2", "-r", "2", "-t", "8s", "--host", server.url,
                        "--only-summary", "--csv", str(tmp_path / "l")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    stats = (tmp_path / "l_stats.csv").read_text()
    for name in ("TTFT", "TPOT", "E2E", "/v1/completions"):
        assert name in stats
    rows = [line.split(",") for line in stats.splitlines()[1:]]
    assert all(row[3] == "0" for row in rows)  # failure count column


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


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 100])
def test_sse_lines_split_only_at_cr_lf(cut: int) -> None:
    """Text a model generated may hold U+2028, U+2029 or U+0085 raw inside a JSON string
    (JSON escapes only controls below U+0020): those, and \\x1c, end no SSE line
    (str.splitlines would cut there); CRLF, CR and LF do,
    wherever the chunks happen to be cut, a CRLF split across two chunks included."""
    text = 'data: {"t": "a\u2028b\u2029c\x85d"}\r\n\r\ndata: [DONE]\rla\x1cst\nx\r'
    chunks = [text[i:i + cut] for i in range(0, len(text), cut)]

    async def gen():
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        return [line async for line in sse_lines(gen())]

    lines = asyncio.run(collect())
    assert lines == ['data: {"t": "a\u2028b\u2029c\x85d"}', "", "data: [DONE]", "la\x1cst", "x"]
    assert json.loads(lines[0][5:])["t"] == "a\u2028b\u2029c\x85d"


@pytest.mark.parametrize("doc", [None, ""])
def test_publish_writes_the_doc_unless_told_not_to(tmp_path, monkeypatch, doc: str | None) -> None:
    """A benchmark driver's outputs: without `--doc` the generated block goes into
    docs/benchmarks.md; `--doc ""` writes the JSON and the plot but no doc (a look at a
    machine, not a result to publish)."""
    import argparse

    from benchmarks import bench_common as bc

    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(doc=doc, results=None, plot=None, out="runs", quick=False)
    bc.default_paths(args, "bench_x")
    drawn: list[str] = []
    report = {"benchmark": "bench_x", "fingerprint": {}}
    bc.publish(report, args, "bench_x", "## X", lambda r: "the table",
               lambda r, path: drawn.append(path))
    assert (tmp_path / "docs/results/bench_x.json").is_file()
    assert drawn == ["docs/img/bench_x.png"]
    written = tmp_path / "docs/benchmarks.md"
    if doc is None:
        assert "the table" in written.read_text(encoding="utf-8")
    else:
        assert not written.exists()
