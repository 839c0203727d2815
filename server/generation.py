"""One HTTP request's engine requests in flight: merge their deltas by choice index,
account usage, notice a client that went away, and log one line when it is over."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from scheduler.async_engine import AsyncEngine, RequestStream
from scheduler.outputs import KVUsage, RequestOutput, TokenLogprob
from server.preprocess import Plan
from server.reasoning import ReasoningParser

request_log = logging.getLogger("kvserve.request")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    prompt_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # prompt logprobs (echo with logprobs, or prompt_logprobs): one per prompt token,
    # None for the first; they come with the choice's first engine output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    echo_len: int = 0  # characters of echoed prompt text at the start of `text`
    finish_reason: str | None = None
    num_output_tokens: int = 0
    kv: KVUsage | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # chat with --reasoning-parser: the text split into reasoning and answer as it comes
    reasoner: ReasoningParser | None = None
    last_split: tuple[str, str] = ("", "")  # the latest output's (reasoning, answer) text
    reasoning_tokens: int = 0


class Generation:
    def __init__(self, plan: Plan, stream: RequestStream) -> None:
        self.plan = plan
        self.stream = stream
        self.choices = {c.request_id: ChoiceState(c.index, c.echo_text, c.prompt_index,
                                                  prompt_ids=c.prompt_ids,
                                                  echo_len=len(c.echo_text))
                        for c in plan.choices}
        if plan.reasoning is not None:
            for st in self.choices.values():
                st.reasoner = plan.reasoning()
        self.status = "running"
        self._logged = False

    @classmethod
    async def start(cls, engine: AsyncEngine, plan: Plan) -> Generation:
        """Submit every choice at once; engine exceptions propagate (-> 4xx/503)."""
        return cls(plan, await engine.submit(plan.engine_requests()))

    async def deltas(self) -> AsyncIterator[tuple[ChoiceState, RequestOutput]]:
        """Apply each engine output to its choice and hand both on."""
        async for out in self.stream:
            st = self.choices[out.request_id]
            st.text += out.new_text
            st.token_ids += out.new_token_ids
            if out.logprobs is not None:
                st.logprobs = (st.logprobs or []) + out.logprobs
            if out.prompt_logprobs is not None:
                st.prompt_logprobs = out.prompt_logprobs
            st.num_output_tokens = out.num_output_tokens
            st.first_scheduled_time = out.first_scheduled_time
            st.first_token_time = out.first_token_time
            if out.finished:
                st.finish_reason = out.finish_reason
                st.kv = out.kv
            if st.reasoner is not None:
                _split(st, out)
            yield st, out
        self.status = "ok"

    async def collect(self) -> list[ChoiceState]:
        async for _ in self.deltas():
            pass
        return self.ordered()

    async def collect_unless_disconnected(self, request: Request) -> list[ChoiceState]:
        """Run to completion, but abort the moment the client disconnects."""
        collect = asyncio.ensure_future(self.collect())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (collect, watch):
                t.cancel()
            await asyncio.gather(collect, watch, return_exceptions=True)
        if collect.done() and not collect.cancelled():
            return collect.result()  # re-raises the engine's exception, if any
        self.status = "disconnected"
        raise ClientDisconnected

    def ordered(self) -> list[ChoiceState]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def close(self, status: str | None = None) -> None:
        """Abort whatever is unfinished and log the request once."""
        self.stream.abort()
        if status is not None:
            self.status = status
        elif self.status == "running":
            self.status = "aborted"
        self.log()

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted like `prompt_tokens`: once
        per distinct prompt. Its n samples each report their own hits, and all but the
        first usually hit what the first computed, so a prompt counts the fewest hits
        among its samples: what was already cached when the request came in (OpenAI's
        meaning, the part of the prompt that was not computed for this request)."""
        fewest: dict[int, int] = {}
        for c in self.choices.values():
            hits = c.kv.prefix_hit_tokens if c.kv is not None else 0
            fewest[c.prompt_index] = min(hits, fewest.get(c.prompt_index, hits))
        return sum(fewest.values())

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_output_tokens for c in self.choices.values())
        kv = [c.kv for c in self.choices.values() if c.kv is not None]
        details = {}
        if self.plan.reasoning is not None:
            details["completion_tokens_details"] = {"reasoning_tokens": sum(
                c.reasoning_tokens for c in self.choices.values())}
        return {
            "prompt_tokens": self.plan.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.plan.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
            **details,
            "kv_cache": {
                "policy": self.plan.policy.name,
                "peak_live_tokens": sum(k.peak_live_tokens for k in kv),
                "peak_blocks": sum(k.peak_blocks for k in kv),
                "peak_bytes": sum(k.peak_bytes for k in kv),
                "evicted_tokens": sum(k.evicted_tokens for k in kv),
                "prefix_hit_tokens": sum(k.prefix_hit_tokens for k in kv),
                **_head_spread(kv),
            },
        }

    def log(self) -> None:
        if self._logged:
            return
        self._logged = True
        p = self.plan
        now = time.monotonic()
        firsts = [c.first_token_time for c in self.choices.values() if c.first_token_time]
        sched = [c.first_scheduled_time for c in self.choices.values()
                 if c.first_scheduled_time]
        fields = {
            "request_id": p.id, "endpoint": p.kind, "model": p.model, "status": self.status,
            "policy": p.policy.name, "n": len(p.choices), "priority": p.priority,
            "prompt_tokens": p.num_prompt_tokens,
            "completion_tokens": sum(c.num_output_tokens for c in self.choices.values()),
            "finish_reasons": [c.finish_reason for c in self.ordered()],
            "queue_s": round(min(sched) - p.arrival_time, 4) if sched else None,
            "ttft_s": round(min(firsts) - p.arrival_time, 4) if firsts else None,
            "e2e_s": round(now - p.arrival_time, 4), "stream": p.stream, "user": p.user,
            "tenant": p.tenant,
        }
        request_log.info("request %s", self.status, extra={"fields": fields})


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _split(st: ChoiceState, out: RequestOutput) -> None:
    """One output's text through the choice's reasoning parser. Its tokens count as
    reasoning when the text was or still is inside the reasoning before or after them
    (the tags' own tokens included); outputs come a token or a few at a time, so the
    count is the reasoning's tokens up to the one that closes it."""
    assert st.reasoner is not None
    was = st.reasoner.in_reasoning
    reasoning, content = st.reasoner.feed(out.new_text)
    if was or st.reasoner.in_reasoning:
        st.reasoning_tokens += len(out.new_token_ids)
    if out.finished:
        more = st.reasoner.finish()
        reasoning, content = reasoning + more[0], content + more[1]
    st.last_split = (reasoning, content)


def _head_spread(kv: list[KVUsage]) -> dict[str, int]:
    """`usage.kv_cache`'s per-head fields over a per-head pool (`--kv-layout head`): the
    live tokens of the (layer, kv head) that held the fewest and the most at the end,
    over the choices; nothing over a per-layer pool."""
    spread = [k for k in kv if k.head_live_max]
    if not spread:
        return {}
    return {"head_live_tokens_min": min(k.head_live_min for k in spread),
            "head_live_tokens_max": max(k.head_live_max for k in spread)}
