"""benchmarks/roofline.py: the schedule it bounds, the bounds' arithmetic, and its command
on a bench_serving report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.roofline import ModelCost, Step, bound, by_kind, main, schedule, serving_rows
from engine import cpu_threads
from loadtest.random_models import MODEL_CONFIGS


def test_schedule_by_hand() -> None:
    # two prompts (3 and 5 tokens) asking 2 and 1 tokens, 4 tokens a step
    steps = list(schedule([3, 5], [2, 1], max_seqs=2, max_tokens=4))
    assert steps == [
        Step(tokens=4, sampled=1, pairs=6 + 1, context=3 + 1),  # prompt 0 whole, 1 of 1
        Step(tokens=4, sampled=1, pairs=4 + 9, context=4 + 4),  # decode 0 first, then 1's chunk
        Step(tokens=1, sampled=1, pairs=5, context=5),  # 1's last prompt token: its only output
    ]


@pytest.mark.parametrize("max_seqs,max_tokens", [(1, 16), (3, 7), (8, 64)])
def test_schedule_conserves_the_work(max_seqs: int, max_tokens: int) -> None:
    prompts, outputs = [5, 17, 1, 30, 9], [3, 1, 8, 2, 5]
    steps = list(schedule(prompts, outputs, max_seqs, max_tokens))
    assert sum(s.tokens for s in steps) == sum(p + o - 1 for p, o in zip(prompts, outputs))
    assert sum(s.sampled for s in steps) == sum(outputs)
    n = [p + o - 1 for p, o in zip(prompts, outputs)]
    assert sum(s.pairs for s in steps) == sum(k * (k + 1) // 2 for k in n)
    assert all(0 < s.tokens <= max_tokens and s.sampled <= max_seqs for s in steps)
    if max_seqs == 1:  # one at a time: a prompt's chunks, then its decodes
        assert len(steps) == sum(math.ceil(p / max_tokens) + o - 1
                                 for p, o in zip(prompts, outputs))


def test_bounds() -> None:
    cost = ModelCost.of(MODEL_CONFIGS["tiny"])
    prompts, outputs = [40, 7, 100], [5, 30, 2]
    steps = list(schedule(prompts, outputs, 2, 64))
    flop = sum(cost.request_flop(p, o) for p, o in zip(prompts, outputs))
    b = bound(cost, steps, gemm_flops=1e9, bandwidth=1e9)
    assert b["steps"] == len(steps) and 0 < b["overlapped_s"] <= b["sequential_s"]
    # memory for free: every step at the GEMM rate, both bounds the workload's FLOPs
    free = bound(cost, steps, gemm_flops=1e9, bandwidth=math.inf)
    assert free["overlapped_s"] == pytest.approx(flop / 1e9)
    assert free["sequential_s"] == pytest.approx(flop / 1e9)
    # arithmetic for free: each step reads every weight once and each context once
    weights = cost.linear_params + cost.head_params  # every step here samples a row
    assert all(s.sampled for s in steps)
    mem = bound(cost, steps, gemm_flops=math.inf, bandwidth=1e9)
    want = sum(weights * cost.element_bytes + s.context * cost.kv_bytes for s in steps) / 1e9
    assert mem["overlapped_s"] == pytest.approx(want) == mem["sequential_s"]
    # bf16 halves the bytes, not the FLOPs
    assert ModelCost.of(MODEL_CONFIGS["tiny"], 2).kv_bytes * 2 == cost.kv_bytes


def test_by_kind() -> None:
    """Two runs of the planned steps, timed: each kind's steps, seconds and bound per run,
    the prompt steps first, then decodes by quarters of max_seqs running; steps of
    another schedule give None."""
    cost = ModelCost.of(MODEL_CONFIGS["tiny"])
    steps = list(schedule([40, 7, 100, 12], [5, 30, 2, 9], 4, 64))
    prompt = [s.tokens if s.tokens > s.sampled else 0 for s in steps]  # steps with prompt tokens
    measured = [(s.tokens, p, 0.5) for s, p in zip(steps, prompt)] * 2
    kinds = by_kind(cost, steps, measured, 1e9, 1e9, max_seqs=4)
    assert kinds is not None and kinds[0]["kind"] == "prompt"
    assert [k["kind"] for k in kinds[1:]] == sorted(
        {f"decode {s.tokens}-{s.tokens}" for s, p in zip(steps, prompt) if not p},
        key=lambda k: int(k.split()[1].split("-")[0]))  # a quarter of 4 rows: 1 each
    assert sum(k["steps"] for k in kinds) == len(steps)  # per run, not over both
    assert sum(k["seconds"] for k in kinds) == pytest.approx(0.5 * len(steps))
    b = bound(cost, steps, 1e9, 1e9)
    assert sum(k["linears_bound_s"] + k["attention_bound_s"] for k in kinds) == \
        pytest.approx(b["sequential_s"])
    assert by_kind(cost, steps, measured[:-1], 1e9, 1e9, 4) is None  # not whole runs
    assert by_kind(cost, steps, [(t + 1, p, x) for t, p, x in measured], 1e9, 1e9, 4) is None


def _serving_report(path: Path) -> Path:
    pairs = [[12, 4], [30, 9], [5, 2], [44, 6]]
    run = {"label": "concurrency 2", "max_concurrency": 2, "token_counts": pairs}
    report = {"settings": {"dtype": "float32", "max_batched_tokens": 32},
              "models": {"tiny": {"model": {"path": str(path / "nowhere")}, "throughput": {
                  "systems": {"kvserve": [{**run, "duration": 2.0}],
                              "vllm": [{**run, "duration": 3.0}]}}}}}
    out = path / "serving.json"
    out.write_text(json.dumps(report))
    return out


def test_serving_rows(tmp_path: Path) -> None:
    report = json.loads(_serving_report(tmp_path).read_text())
    (row,) = serving_rows(report, gemm_flops=1e9, bandwidth=1e9)
    seq = row["sequential_s"]
    assert row["of_bound"] == {"kvserve": pytest.approx(seq / 2.0), "vllm": pytest.approx(seq / 3.0)}
    assert row["vllm_x1.3_needs"] == pytest.approx(1.3 * seq / 3.0)
    # the least over orders: no order it tried is below it
    cost = ModelCost.of(MODEL_CONFIGS["tiny"])
    for order in ([[12, 4], [30, 9], [5, 2], [44, 6]], [[44, 6], [5, 2], [30, 9], [12, 4]]):
        steps = list(schedule([p for p, _ in order], [o for _, o in order], 2, 32))
        assert bound(cost, steps, 1e9, 1e9)["sequential_s"] >= seq - 1e-12


@pytest.mark.timeout(120)
def test_command(tmp_path: Path) -> None:
    # started with the environment `pin_threads` sets for one thread, so the command runs
    # at once instead of re-executing itself (a second start, ~4 s of imports)
    env = {**os.environ, **cpu_threads.environment(cpu_threads.plan(1, None))}
    out = subprocess.run([sys.executable, "-m", "benchmarks.roofline",
                          str(_serving_report(tmp_path)), "--threads", "1"], env=env,
                         capture_output=True, text=True, timeout=110, check=True).stdout
    assert "memory read rate" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| tiny |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "concurrency 2" and cells[6].endswith("%") and cells[8].endswith("%")


def test_an_offline_report_prints_its_own_bound(tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """A bench_offline report (the Xeon's, commit 4586369) with `--offline`: its run's bound
    and kvserve's seconds by kind of step, nothing measured; without it, a clear refusal
    rather than a KeyError on a bench_serving field. In this process (test_command runs
    the command): each start costs seconds of imports."""
    path = Path(__file__).parents[1] / "results/bench_offline_vllm_xeon_s45.json"
    assert main(["--offline", str(path)]) == []
    out = capsys.readouterr().out
    assert "**160m float32**: bound 26.7 s sequential (23.8 overlapped), 259 steps" in out
    assert "1.3x vLLM needs 86%" in out
    assert "| decode 17-32 | 58 | 4.37 | 1.26 | 1.41 | 61% |" in out
    with pytest.raises(SystemExit) as bad:
        main([str(path), "--threads", "1"])
    assert bad.value.code != 0 and "not bench_serving's" in str(bad.value.code)
