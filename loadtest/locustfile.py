"""Locust load test for any OpenAI-compatible server, with streaming timings.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 \\
        --headless -u 32 -r 8 -t 2m --csv runs/locust

Each user sends streaming /v1/completions requests with seeded, varied prompts (the
same generator as `python -m loadtest`). Besides Locust's own line for the HTTP request
(time to response headers), every request reports, under request type `SSE`:
`TTFT` (first chunk with text), `E2E` (last byte) and `TPOT` (ms per output token after
the first), with the output token count (from `usage`) as the response length; a stream
that ends in an error event or without usage is a failure. Settings, from the
environment: LOADTEST_MODEL (default: the first of /v1/models), LOADTEST_PROMPT_LEN and
LOADTEST_OUTPUT_LEN (log-normal medians in tokens, default 100 and 64),
LOADTEST_KV_POLICY_MIX (e.g. `full:0.5,streaming:0.5`, kvserve only), LOADTEST_SEED,
LOADTEST_CHARS_PER_TOKEN (default 4).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

from locust import HttpUser, between, task

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadtest.workloads import (
    LengthDist,
    TextMaker,
    WorkloadConfig,
    iter_requests,
    parse_policy_mix,
)

_ENV = os.environ.get
_WORKLOAD = WorkloadConfig(
    num_requests=10**7, seed=int(_ENV("LOADTEST_SEED", "0")),
    prompt=LengthDist(float(_ENV("LOADTEST_PROMPT_LEN", "100")), 0.8, 4, 4096),
    output=LengthDist(float(_ENV("LOADTEST_OUTPUT_LEN", "64")), 0.8, 4, 2048),
    policy_mix=parse_policy_mix(_ENV("LOADTEST_KV_POLICY_MIX")))
_SPECS = iter_requests(_WORKLOAD, TextMaker(_WORKLOAD.seed,
                                            chars_per_token=float(_ENV("LOADTEST_CHARS_PER_TOKEN", "4"))))
_COUNTER = itertools.count()
_MODEL: list[str | None] = []


def _fire(user: HttpUser, name: str, ms: float, length: int = 0,
          exc: Exception | None = None) -> None:
    user.environment.events.request.fire(request_type="SSE", name=name, response_time=ms,
                                         response_length=length, exception=exc, context={})


class CompletionsUser(HttpUser):
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        if not _MODEL:
            model = _ENV("LOADTEST_MODEL")
            if model is None:
                r = self.client.get("/v1/models", name="/v1/models")
                data = r.json().get("data") if r.status_code == 200 else None
                model = data[0]["id"] if data else None
            _MODEL.append(model)

    @task
    def completion(self) -> None:
        spec = next(_SPECS)
        body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True,
                "temperature": 0.0, "user": f"locust-{next(_COUNTER)}"}
        if _MODEL and _MODEL[0]:
            body["model"] = _MODEL[0]
        if spec.kv_policy is not None:
            body["kv_policy"] = spec.kv_policy
        t0 = time.perf_counter()
        ttft = None
        tokens = None
        error: Exception | None = None
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="/v1/completions") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    error = RuntimeError(str(obj["error"])[:200])
                    break
                if ttft is None and any(c.get("text") for c in obj.get("choices") or []):
                    ttft = (time.perf_counter() - t0) * 1000
                if obj.get("usage"):
                    tokens = obj["usage"].get("completion_tokens")
            e2e = (time.perf_counter() - t0) * 1000
            if error is None and tokens is None:
                error = RuntimeError("the stream ended without usage")
            if error is not None:
                resp.failure(str(error))
            else:
                resp.success()
        _fire(self, "E2E", e2e, tokens or 0, error)
        if error is None and ttft is not None:
            _fire(self, "TTFT", ttft)
            if tokens and tokens > 1:
                _fire(self, "TPOT", (e2e - ttft) / (tokens - 1), tokens)

