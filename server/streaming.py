"""Server-sent events exactly as OpenAI sends them.

`data: {json}\\n\\n` per chunk; `finish_reason` is null until each choice's last chunk;
with `stream_options.include_usage` every chunk carries `"usage": null` and one extra
chunk with `choices: []` and the usage precedes `data: [DONE]`. An error after the
headers went out is sent as a `data: {"error": ...}` event (what OpenAI does), which
the `openai` client raises as an APIError.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from scheduler.outputs import RequestOutput
from server.errors import error_body, map_exception
from server.generation import ChoiceState, Generation
from server.responses import (
    TokenText,
    chat_logprobs,
    choice_logprobs,
    completion_logprobs,
    end_offset,
)

DONE = "data: [DONE]\n\n"
logger = logging.getLogger("kvserve.server")


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Closes the event generator however the response ends, so the engine request is
    aborted at once when the client disconnects (Starlette only cancels the send)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class _Chunker:
    def __init__(self, gen: Generation, tt: TokenText) -> None:
        p = gen.plan
        self.gen, self.tt = gen, tt
        self.chat = p.kind == "chat"
        self.base = {"id": p.id, "object": "chat.completion.chunk" if self.chat
                     else "text_completion", "created": p.created, "model": p.model,
                     "system_fingerprint": None}
        self.include_usage = p.include_usage
        self.want_lp = p.num_logprobs is not None
        self.offsets: dict[int, int] = {}  # completions: text offset per choice
        # echo with logprobs: choices whose prompt is still to be echoed. It goes out with
        # the choice's first delta, which brings the prompt logprobs (vLLM does the same).
        self.echo_pending: set[int] = set()
        # chat with tools: each choice's text read for calls as it comes (server/tools.py)
        self.calls = {c.index: calls for c in p.choices
                      if p.tools is not None and (calls := p.tools.stream()) is not None}

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        body = {**self.base, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> list[str]:
        """Chat: the assistant role first; completions with echo: the prompt first."""
        out = []
        for c in self.gen.ordered():
            if self.chat:
                out.append(self.chunk([{"index": c.index, "delta": {"role": "assistant",
                                        "content": ""}, "logprobs": None,
                                        "finish_reason": None}]))
            elif self.gen.plan.echo and self.want_lp:
                self.echo_pending.add(c.index)
            elif c.text:
                out.append(self.chunk([{"index": c.index, "text": c.text, "logprobs": None,
                                        "finish_reason": None}]))
            self.offsets[c.index] = 0 if c.index in self.echo_pending else len(c.text)
        return out

    def delta(self, st: ChoiceState, text: str, lps: list | None) -> str | None:
        echo = st.index in self.echo_pending
        if not text and not (self.want_lp and lps) and not echo:
            return None
        lp = None
        if self.want_lp:
            if self.chat:
                lp = chat_logprobs(self.tt, lps or [])
            elif echo:  # the prompt and its logprobs, then this delta's tokens
                self.echo_pending.discard(st.index)
                lp = choice_logprobs(self.gen, st, self.tt, lps, True)
                text = st.text[: st.echo_len] + text
                self.offsets[st.index] = end_offset(lp)
                return self.chunk([{"index": st.index, "text": text, "logprobs": lp,
                                    "finish_reason": None}])
            else:
                lp = completion_logprobs(self.tt, lps or [], self.offsets[st.index])
        self.offsets[st.index] = self.offsets.get(st.index, 0) + len(text)
        if self.chat:
            return self.chunk([{"index": st.index, "delta": {"content": text},
                                "logprobs": lp, "finish_reason": None}])
        return self.chunk([{"index": st.index, "text": text, "logprobs": lp,
                            "finish_reason": None}])

    def events(self, st: ChoiceState, out: RequestOutput) -> list[str]:
        """One engine output's chunks: its text (read for tool calls where the choice
        has tools), then the choice's last chunk if it finished."""
        calls = self.calls.get(st.index)
        text, lps = out.new_text, out.logprobs
        events = []
        if st.reasoner is not None:  # the reasoning first; the answer is what is left
            reasoning, text = st.last_split
            if reasoning or (lps and self.want_lp and not text):
                events += self.tool_chunks(st, [{"reasoning_content": reasoning}]
                                           if reasoning else [], lps)
                lps = None
        if calls is None:
            event = self.delta(st, text, lps)
            events += [] if event is None else [event]
        else:
            events += self.tool_chunks(st, calls.feed(text), lps)
        if out.finished:
            reason = st.finish_reason
            if calls is not None:
                events += self.tool_chunks(st, calls.finish(), None)
                assert self.gen.plan.tools is not None
                reason = self.gen.plan.tools.finish_reason(bool(calls.calls), reason)
            events.append(self.finish(st, reason))
        return events

    def tool_chunks(self, st: ChoiceState, deltas: list[dict[str, Any]], lps: list | None
                    ) -> list[str]:
        """A reader's deltas (content, tool calls), the tokens' logprobs on the first;
        an empty delta carries them where the text is held back (a call's marker)."""
        lp = chat_logprobs(self.tt, lps) if self.want_lp and lps else None
        if not deltas and lp is not None:
            deltas = [{}]
        return [self.chunk([{"index": st.index, "delta": d, "logprobs": lp if i == 0 else None,
                             "finish_reason": None}]) for i, d in enumerate(deltas)]

    def finish(self, st: ChoiceState, reason: str | None) -> str:
        if self.chat:
            return self.chunk([{"index": st.index, "delta": {}, "logprobs": None,
                                "finish_reason": reason}])
        return self.chunk([{"index": st.index, "text": "", "logprobs": None,
                            "finish_reason": reason}])

    def usage(self) -> str:
        return sse({**self.base, "choices": [], "usage": self.gen.usage()})


async def stream_events(gen: Generation, tt: TokenText) -> AsyncIterator[str]:
    """The SSE body; its `finally` aborts unfinished choices and logs the request."""
    ch = _Chunker(gen, tt)
    status = None
    try:
        for event in ch.opening():
            yield event
        async for st, out in gen.deltas():
            for event in ch.events(st, out):
                yield event
        if ch.include_usage:
            yield ch.usage()
        yield DONE
    except (asyncio.CancelledError, GeneratorExit):  # the client went away
        status = "disconnected"
        raise
    except Exception as e:  # headers are out: report in-band, never a broken stream
        err = map_exception(e)
        status = "error"
        if err is None:
            logger.exception("stream failed")
            body = error_body("internal server error", "server_error")
        else:
            body = error_body(err.message, err.type, err.param, err.code)
        yield sse(body)
        yield DONE
    finally:
        gen.close(status)
