"""kvserve offline on the exact requests of one bench_serving throughput level: the
reference of issue 22's "HTTP at concurrency 32 reaches ≥ 85% of kvserve's own offline
tok/s on the same requests".

Same requests: the level's prompt texts and max_tokens are rebuilt from the sweep's own
seeding (`runner.level_workload`), sent greedy with the HTTP client's `ignore_eos`, and
each side's (prompt tokens, output tokens) pairs are compared, so a ratio is only
called like for like when every request was the same on both. Same engine: the child
gets the very engine options the throughput server got, parsed by kvserve's own
`generate` parser and built by `server.cli.offline_llm`, the code `kvserve generate`
runs (its defaults included: spinning OpenMP waits, no HTTP side). A child process,
because OpenMP takes its thread count and wait policy from the environment once, when
torch loads, and this process has loaded torch with its own. The offline run submits
every request at once, as `LLM.generate` does; `--max-num-seqs` bounds its batch.

    python -m loadtest.offline_ref REQUESTS.json RESULT.json generate --model PATH ...

is the child (run by `measure`); REQUESTS.json holds the prompts, RESULT.json gets the
timing and token counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from loadtest.client import ClientConfig
from loadtest.spawn import child_env
from loadtest.workloads import RequestSpec

# generate's --prompt is required; the prompts come from the requests file instead
_PROMPT_PLACEHOLDER = ("--prompt", "(from the requests file)")


def _texts(specs: list[RequestSpec]) -> list[str]:
    """The prompts as the HTTP client sends them to /v1/completions; anything else the
    client would add to a body (a system message, a kv_policy, extra fields) has no
    offline equivalent here, so such a workload is refused rather than half-replayed."""
    bad = [s for s in specs if not isinstance(s.prompt, str) or s.system or s.kv_policy
           or s.extra]
    if bad:
        raise ValueError("the offline reference replays plain text completions only")
    return [str(s.prompt) for s in specs]


def measure(specs: list[RequestSpec], warm: list[RequestSpec], client: ClientConfig,
            model_path: str, engine_opts: list[str], http: dict[str, dict[str, Any]],
            work_prefix: str, timeout: float) -> dict[str, Any]:
    """Run `specs` through `kvserve generate`'s LLM in a child (after `warm`, untimed)
    and compare with `http`, the compacted HTTP levels (by system) of the same requests.
    A child that fails gives a result with `error` (its log named), not an exception:
    one failed reference must not lose an hour of HTTP measurements."""
    req_path, res_path, log_path = (f"{work_prefix}-{x}" for x in
                                    ("requests.json", "result.json", "log.txt"))
    with open(req_path, "w", encoding="utf-8") as f:
        json.dump({"prompts": _texts(specs), "max_tokens": [s.max_tokens for s in specs],
                   "warm_prompts": _texts(warm), "warm_max_tokens": [s.max_tokens for s in warm],
                   "temperature": client.temperature, "ignore_eos": client.ignore_eos}, f)
    cli = ["generate", "--model", model_path, *engine_opts]
    out: dict[str, Any] = {"command": "kvserve " + " ".join(cli), "requests_file": req_path}
    try:
        with open(log_path, "wb") as log:
            subprocess.run([sys.executable, "-m", "loadtest.offline_ref", req_path, res_path,
                            *cli, *_PROMPT_PLACEHOLDER], env=child_env(), stdout=log,
                           stderr=log, stdin=subprocess.DEVNULL, timeout=timeout, check=True)
        with open(res_path, encoding="utf-8") as f:
            out.update(json.load(f))
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        return {**out, "error": f"{type(e).__name__}: {e} (log: {log_path})"}
    out["output_throughput"] = out["output_tokens"] / max(out["wall_s"], 1e-9)
    out["http"] = {system: compare(out, level) for system, level in http.items()}
    return out


def compare(offline: dict[str, Any], level: dict[str, Any]) -> dict[str, Any]:
    """One HTTP level against the offline run: tok/s ratio, and whether every request
    was the same on both sides (the sorted (prompt tokens, output tokens) pairs: the
    HTTP client records requests in completion order, not in the order they were made)."""
    pairs = level.get("token_counts")
    same = (level["completed"] == offline["num_requests"] and level["failed"] == 0
            and pairs == offline["token_counts"])
    return {"output_throughput": level["output_throughput"],
            "ratio": level["output_throughput"] / offline["output_throughput"]
            if offline["output_throughput"] else None,
            "same_requests": same, "completed": level["completed"], "failed": level["failed"],
            "output_tokens": level["total_output_tokens"],
            "prompt_tokens": level["total_input_tokens"]}


def summary_line(r: dict[str, Any]) -> str:
    """The console line of one reference: its tok/s and each HTTP level's share of it."""
    if "error" in r:
        return f"  offline FAILED: {r['error']}"
    return (f"  offline {r['num_requests']} req {r['output_tokens']} tok "
            f"{r['output_throughput']:8.1f} out tok/s; HTTP / offline: " + ", ".join(
                f"{s} {h['ratio']:.1%}{'' if h['same_requests'] else ' (NOT the same requests)'}"
                for s, h in r["http"].items()))


def child(argv: list[str]) -> None:
    """The offline run itself: `kvserve generate`'s LLM, warmed, then one timed generate."""
    req_path, res_path, *cli = argv
    from server.cli import build_parser, offline_llm  # before torch: threads are set first

    llm, cpu = offline_llm(build_parser().parse_args(cli))
    from engine.sampling import SamplingParams

    with open(req_path, encoding="utf-8") as f:
        req = json.load(f)

    def params(lens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=n, temperature=req["temperature"],
                               ignore_eos=req["ignore_eos"]) for n in lens]

    llm.generate(req["warm_prompts"], params(req["warm_max_tokens"]))
    t0, c0 = time.perf_counter(), time.process_time()
    done = llm.generate(req["prompts"], params(req["max_tokens"]))
    wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    counts = sorted([len(c.prompt_ids), len(c.token_ids)] for c in done)
    with open(res_path, "w", encoding="utf-8") as f:
        json.dump({"num_requests": len(done), "wall_s": wall, "cpu_s": cpu_s,
                   "prompt_tokens": sum(p for p, _ in counts),
                   "output_tokens": sum(o for _, o in counts), "token_counts": counts,
                   "finish_reasons": dict(Counter(c.finish_reason for c in done)),
                   "preemptions": sum(c.num_preemptions for c in done),
                   "threads": cpu.fields()}, f)


if __name__ == "__main__":
    child(sys.argv[1:])
