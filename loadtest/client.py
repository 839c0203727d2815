"""One streaming request to an OpenAI-compatible server, timed.

Time to first token is taken at the first chunk with content (non-empty text, or a
token in its logprobs); inter-token latencies are the gaps between later content
chunks; the output length comes from `usage` (requested with
`stream_options.include_usage`), else from the streamed logprobs, else from the number
of content chunks. With `logprobs` the streamed tokens are counted independently of
`usage`, so the two can be checked against each other.

Backends: `openai` (kvserve, vLLM and most servers: `ignore_eos` in the body) and
`transformers` (`transformers serve`, which refuses unknown fields: a fixed output
length is asked for through its `generation_config` field instead).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.workloads import RequestSpec

BACKENDS = ("openai", "transformers")

_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream, ended only by CRLF, CR or LF (the SSE spec's line
    ends, what the OpenAI SDK splits on). httpx's `aiter_lines` splits like
    `str.splitlines`, also at U+2028, U+2029, U+0085 and a few control characters, which
    JSON leaves raw inside strings unless ASCII-escaped: a generated token that decodes
    to one would cut a `data:` line in two (seen with random-weight models)."""
    buf = ""
    async for chunk in chunks:
        buf += chunk
        held = buf.endswith("\r")  # maybe the first half of a CRLF split across chunks
        *lines, buf = _EOL.split(buf[:-1] if held else buf)
        buf += "\r" if held else ""
        for line in lines:
            yield line
    if buf:
        yield buf.removesuffix("\r")


@dataclass
class ClientConfig:
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    model: str | None = None
    backend: str = "openai"
    temperature: float = 0.0
    ignore_eos: bool = True
    logprobs: int | None = None  # ask for per-token logprobs (counts streamed tokens)
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return "chat" in self.endpoint


@dataclass
class RequestResult:
    status: str  # HTTP status ("200", "400" ...), "disconnected", "stream_error", "error:Exc"
    tag: str
    policy: str
    max_tokens: int
    prompt_len: int  # what the workload asked for
    start: float = 0.0  # perf_counter at send
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks with content
    prompt_tokens: int | None = None  # usage
    usage_output_tokens: int | None = None  # usage
    streamed_tokens: int | None = None  # tokens in streamed logprobs
    finish_reason: str | None = None
    kv_cache: dict[str, Any] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def output_tokens(self) -> int:
        for n in (self.usage_output_tokens, self.streamed_tokens):
            if n is not None:
                return n
        return self.chunks

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if not self.ok or self.ttft is None or self.e2el is None or n < 2:
            return None
        return (self.e2el - self.ttft) / (n - 1)

    def row(self) -> dict[str, Any]:
        return {"status": self.status, "tag": self.tag, "policy": self.policy,
                "start": self.start, "ttft": self.ttft, "e2el": self.e2el, "tpot": self.tpot,
                "prompt_len": self.prompt_len, "prompt_tokens": self.prompt_tokens,
                "max_tokens": self.max_tokens, "output_tokens": self.output_tokens,
                "usage_output_tokens": self.usage_output_tokens,
                "streamed_tokens": self.streamed_tokens, "chunks": self.chunks,
                "finish_reason": self.finish_reason, "kv_cache": self.kv_cache,
                "error": self.error}


def build_body(spec: RequestSpec, cfg: ClientConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"stream": True, "max_tokens": spec.max_tokens,
                            "temperature": cfg.temperature}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.chat:
        msgs = [{"role": "system", "content": spec.system}] if spec.system else []
        prompt = spec.prompt if isinstance(spec.prompt, str) else json.dumps(spec.prompt)
        body["messages"] = [*msgs, {"role": "user", "content": prompt}]
    else:
        body["prompt"] = spec.prompt
    if cfg.backend == "transformers":
        gen = {"do_sample": cfg.temperature > 0, "max_new_tokens": spec.max_tokens}
        if cfg.temperature > 0:
            gen["temperature"] = cfg.temperature
        if cfg.ignore_eos:
            gen["min_new_tokens"] = spec.max_tokens
        body["generation_config"] = json.dumps(gen)
    else:
        body["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.logprobs is not None:
            body["logprobs"] = True if cfg.chat else cfg.logprobs
            if cfg.chat:
                body["top_logprobs"] = cfg.logprobs
    if spec.kv_policy is not None:
        body["kv_policy"] = spec.kv_policy
    body.update(cfg.extra_body)
    body.update(spec.extra)
    return body


def _content(choice: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    """(text, tokens in its logprobs or None) of one streamed choice."""
    lp = choice.get("logprobs")
    if chat:
        text = (choice.get("delta") or {}).get("content") or ""
        n = len(lp.get("content") or []) if isinstance(lp, dict) else None
    else:
        text = choice.get("text") or ""
        n = len(lp.get("tokens") or []) if isinstance(lp, dict) else None
    return text, n


async def send(client: httpx.AsyncClient, url: str, spec: RequestSpec, cfg: ClientConfig,
               disconnect_after: int | None = None) -> RequestResult:
    """Send one streaming request; never raises for server or network errors.

    `disconnect_after=k` closes the connection after k content chunks (status
    "disconnected"), as a client that goes away mid-stream does.
    """
    res = RequestResult("?", spec.tag, spec.policy_name, spec.max_tokens, spec.prompt_len)
    body = build_body(spec, cfg)
    res.start = t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url + cfg.endpoint, json=body,
                                 headers=cfg.headers) as r:
            if r.status_code != 200:
                res.status = str(r.status_code)
                res.error = (await r.aread()).decode(errors="replace")[:300]
                res.e2el = time.perf_counter() - t0
                return res
            async for line in sse_lines(r.aiter_text()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.status, res.error = "stream_error", str(obj["error"])[:300]
                    res.e2el = time.perf_counter() - t0
                    return res
                now = time.perf_counter()
                for choice in obj.get("choices") or []:
                    text, n = _content(choice, cfg.chat)
                    if n is not None:
                        res.streamed_tokens = (res.streamed_tokens or 0) + n
                    if text or n:
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.usage_output_tokens = usage.get("completion_tokens")
                    res.kv_cache = usage.get("kv_cache")
                if disconnect_after is not None and res.chunks >= disconnect_after:
                    res.status = "disconnected"
                    res.e2el = time.perf_counter() - t0
                    return res  # leaving the context manager closes the connection
            res.status = "200"
            res.e2el = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.status, res.error = f"error:{type(e).__name__}", str(e)[:300]
        res.e2el = time.perf_counter() - t0
    return res


async def first_model(client: httpx.AsyncClient, url: str,
                      headers: dict[str, str] | None = None) -> str | None:
    """The first id of GET /v1/models, or None if the server does not list models."""
    try:
        r = await client.get(url + "/v1/models", headers=headers or {})
        if r.status_code == 200:
            data = r.json().get("data") or []
            return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return None
