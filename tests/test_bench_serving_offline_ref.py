"""bench_serving's offline reference (issue 22: HTTP at concurrency 32 reaches ≥ 85% of
kvserve's own offline tok/s on the same requests): end to end on the tiny model, then
the report's verdicts on hand-made results.

End to end, what must hold is that the offline run replayed the HTTP level's requests
and nothing else: the server's usage (prompt and output tokens of every request) and
the offline completions agree request for request, and the report divides the two
tok/s. Speed is not asserted (a test cannot know the machine).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.bench_quick import run_quick


@pytest.mark.timeout(150)
def test_offline_reference_replays_the_http_level(tmp_path: Any) -> None:
    out = str(tmp_path)
    report = run_quick("loadtest.bench_serving", out, "--no-progress", "--systems", "kvserve",
                       "--parts", "throughput", "--offline-ref", "4",
                       "--offline-batch", "server,level", wait=None)
    part = report["models"]["tiny"]["throughput"]
    http = next(lv for lv in part["systems"]["kvserve"] if lv["max_concurrency"] == 4)
    ref, capped = part["offline_ref"]
    assert "error" not in ref, ref.get("error")
    # the second reference runs at most the level's concurrency at once, the same requests
    assert (ref["batch"], capped["batch"]) == ("server", "level")
    assert capped["max_num_seqs"] == 4 < ref["max_num_seqs"]
    assert "--max-num-seqs 4 " in capped["command"] and capped["token_counts"] == http["token_counts"]
    assert ref["concurrency"] == 4 and http["failed"] == 0
    # the same requests: every (prompt tokens, output tokens) pair, as each side counted
    assert ref["num_requests"] == http["completed"] == 6
    assert ref["token_counts"] == http["token_counts"]
    assert ref["prompt_tokens"] == http["total_input_tokens"]
    assert ref["output_tokens"] == http["total_output_tokens"]
    assert ref["finish_reasons"] == {"length": 6}  # EOS ignored, as the client asks
    with open(ref["requests_file"], encoding="utf-8") as f:
        sent = json.load(f)
    assert sorted(sent["max_tokens"]) == sorted(o for _, o in http["token_counts"])
    assert sent["temperature"] == 0.0 and sent["ignore_eos"] is True
    # kvserve generate's engine, with the throughput server's engine options and threads
    # no --cpu-threads: generate's own choice (spin: a thread per physical core)
    threads = report["settings"]["threads"]
    assert ref["command"].endswith("--dtype float32 --kv-cache-memory 64MiB")
    assert ref["threads"]["wait"] == "spin" and ref["threads"]["threads"] == threads
    assert ref["threads"]["applied_before_torch"]
    h = ref["http"]["kvserve"]
    assert h["same_requests"]
    assert h["ratio"] == pytest.approx(http["output_throughput"] / ref["output_throughput"])
    assert ref["output_throughput"] == pytest.approx(ref["output_tokens"] / ref["wall_s"])
    with open(os.path.join(out, "benchmarks.md"), encoding="utf-8") as f:
        doc = f.read()
    assert (f"| tiny | kvserve | 4 | {http['output_throughput']:.1f} | "
            f"{ref['output_throughput']:.1f} ({ref['wall_s']:.1f} s, batch ≤ "
            f"{ref['max_num_seqs']}) | {h['ratio']:.1%} | "
            f"yes (6 requests, {ref['output_tokens']:,} output tokens) |  |") in doc
    assert "| tiny | kvserve offline (generate, batch ≤ 4) | 4's requests | 6/0 |" in doc


def _ref(c: int, offline_tps: float, http_tps: float, same: bool = True) -> dict[str, Any]:
    return {"concurrency": c, "batch": "server", "max_num_seqs": 64,
            "command": "kvserve generate --model m --cpu-threads 2",
            "num_requests": 64, "output_tokens": 4096, "wall_s": 4096 / offline_tps,
            "output_throughput": offline_tps, "threads": {"threads": 2, "wait": "spin"},
            "http": {"kvserve": {"output_throughput": http_tps, "ratio": http_tps / offline_tps,
                                 "same_requests": same, "completed": 64 if same else 60,
                                 "failed": 0 if same else 4, "output_tokens": 4096}}}


@pytest.mark.parametrize(("c", "http_tps", "same", "verdict"), [
    (32, 90.0, True, "met"), (32, 80.0, True, "MISSED"), (8, 50.0, True, ""),
    (32, 95.0, False, "not like for like")])
def test_report_gives_the_ratio_and_its_verdict(c: int, http_tps: float, same: bool,
                                                verdict: str, tmp_path: Any) -> None:
    """The target holds at concurrency 32 only, and only for requests that were the same
    on both sides; the offline row sits beside the HTTP rows."""
    from loadtest.bench_serving_report import render

    env = {"date_utc": "now", "cpu": "cpu", "cpu_count": 2, "torch": "t", "transformers": "x",
           "git_commit": "abc", "loadavg_at_start": [1.0], "loadavg_at_end": [1.0]}
    wl = {"prompt": {"median": 100, "sigma": 1.0, "hi": 512},
          "output": {"median": 64, "sigma": 0.6, "hi": 192}}
    part = {"workload": wl, "systems": {}, "offline_ref": [_ref(c, 100.0, http_tps, same)]}
    report = {"command": "python -m loadtest.bench_serving", "environment": env,
              "settings": {"num_prompts": 32, "waves": 2, "seed": 0, "threads": 2},
              "models": {"m": {"throughput": part}}}
    block = render(report, str(tmp_path / "r.json"), [], str(tmp_path / "b.md"))
    assert (f"| m | kvserve | {c} | {http_tps:.1f} | 100.0 (41.0 s, batch ≤ 64) | "
            f"{http_tps:.1f}% |") in block
    assert block.split(f"| m | kvserve | {c} |")[1].split("\n")[0].endswith(f"| {verdict} |")
    assert ("yes (64 requests, 4,096 output tokens)" if same
            else "NO: HTTP 60 ok/4 failed") in block
    assert f"| m | kvserve offline (generate, batch ≤ 64) | {c}'s requests | 64/0 | 100.0 |" in block
    assert "`kvserve generate --model m --cpu-threads 2`; 2 thread(s), wait spin" in block


def test_offline_ref_needs_a_measured_level(tmp_path: Any) -> None:
    from loadtest.bench_serving import parse_args

    a = parse_args(["--systems", "kvserve", "--concurrency", "1,32", "--offline-ref", "32",
                    "--out", str(tmp_path)])
    assert a.offline_ref == [32]
    for bad in (["--concurrency", "1,8", "--offline-ref", "32"],
                ["--parts", "prefix", "--offline-ref", "32"],
                ["--systems", "transformers", "--offline-ref", "32"],
                ["--concurrency", "32", "--offline-ref", "32", "--offline-batch", "all"]):
        with pytest.raises(SystemExit):
            parse_args([*bad, "--out", str(tmp_path)])


def test_a_failed_child_is_a_result_not_a_crash(tmp_path: Any) -> None:
    """A reference that cannot run (here: no such model) gives a result naming its log,
    so the HTTP levels measured before it are still written."""
    from loadtest.client import ClientConfig
    from loadtest.offline_ref import measure
    from loadtest.workloads import RequestSpec

    r = measure([RequestSpec("hello", 4, 1)], [], ClientConfig(), str(tmp_path / "none"),
                ["--cpu-threads", "1"], {}, str(tmp_path / "ref"), 60)
    assert "CalledProcessError" in r["error"] and str(tmp_path / "ref-log.txt") in r["error"]
    assert "kvserve: error: --model" in (tmp_path / "ref-log.txt").read_text()


def test_sampled_runs_send_temperature_and_top_p(tmp_path: Any) -> None:
    """`--temperature` / `--top-p` reach every OpenAI-backend request (top-p as OpenAI's
    field; `transformers serve`'s backend sends none) and the report says how it sampled."""
    from loadtest.bench_serving import Bench, parse_args
    from loadtest.bench_serving_report import _sampling

    a = parse_args(["--systems", "kvserve", "--temperature", "0.8", "--top-p", "0.95",
                    "--out", str(tmp_path)])
    bench = Bench(a)
    cfg = bench.run_cfg("http://x", "vllm").client
    assert (cfg.temperature, cfg.extra_body) == (0.8, {"top_p": 0.95})
    assert bench.run_cfg("http://x", "transformers").client.extra_body == {}
    assert _sampling(vars(a)) == "sampled (temperature 0.8, top-p 0.95)"
    assert _sampling({}) == "greedy"
