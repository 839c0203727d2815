"""The load generator (`python -m loadtest`, `python -m loadtest serve`) against a real kvserve
on 127.0.0.1: every arrival mode for a few seconds, with the numbers checked against
each other (usage vs streamed tokens vs the server's own counters, ordered percentiles,
goodput <= throughput), failures counted by status, and the Locust file. The soak is in
test_loadtest_soak.py, the serving benchmark's report in test_bench_serving.py."""

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
