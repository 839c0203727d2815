"""A chat generation told as a Responses API answer: output items (reasoning, message,
function_call), the response object, and the stream's events in OpenAI's documented
order (`response.created`, `response.output_item.added`, `….output_text.delta`, …,
`response.completed`), each with its `sequence_number`."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.errors import map_exception
from server.generation import ChoiceState, Generation
from server.preprocess import Plan
from server.responses import chat_message
from server.responses_api.store import ResponseStore, Stored

logger = logging.getLogger("kvserve.server")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@dataclass
class Turn:
    """One /v1/responses request, planned as a chat request (request.py)."""

    plan: Plan
    fields: Any  # ResponsesFields
    conversation: list[dict[str, Any]]  # chat messages without the instructions
    store: ResponseStore
    tenant: str | None
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, gen: Generation | None, output: list[dict[str, Any]],
                 status: str = "completed", reason: str | None = None) -> dict[str, Any]:
        f = self.fields
        incomplete = status != "completed" and reason == "length"
        if incomplete:
            status = "incomplete"
        return {
            "id": self.plan.id, "object": "response", "created_at": self.created,
            "status": status, "error": None, "model": self.plan.model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": f.instructions, "max_output_tokens": f.max_output_tokens,
            "metadata": f.metadata or {}, "parallel_tool_calls": f.parallel_tool_calls,
            "previous_response_id": f.previous_response_id, "store": f.store,
            "temperature": gen.plan.choices[0].params.temperature if gen else None,
            "top_p": gen.plan.choices[0].params.top_p if gen else None,
            "tool_choice": f.tool_choice if f.tool_choice is not None else "auto",
            "tools": f.tools or [], "text": f.text or {"format": {"type": "text"}},
            "truncation": "disabled", "usage": _usage(gen) if gen else None}

    def finished(self, gen: Generation, c: ChoiceState, output: list[dict[str, Any]]
                 ) -> dict[str, Any]:
        """The final response object; stored for previous_response_id unless store:
        false (the conversation gets the answer as chat's assistant message)."""
        done = c.finish_reason != "length"
        body = self.response(gen, output, "completed" if done else "incomplete",
                             c.finish_reason)
        if self.fields.store:
            answer: dict[str, Any] = {"role": "assistant", "content": "".join(
                p["text"] for i in output if i["type"] == "message" for p in i["content"]
            ) or None}
            calls = [{"id": i["call_id"], "type": "function", "function": {
                "name": i["name"], "arguments": i["arguments"]}}
                for i in output if i["type"] == "function_call"]
            if calls:
                answer["tool_calls"] = calls
            self.store.put(self.plan.id, Stored([*self.conversation, answer], body,
                                                self.tenant))
        return body

    def body(self, gen: Generation, choices: list[ChoiceState]) -> dict[str, Any]:
        c = choices[0]
        message, _ = chat_message(gen, c)
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            output.append(message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            output.append(call_item(call["id"], call["function"]["name"],
                                    call["function"]["arguments"]))
        return self.finished(gen, c, output)

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The SSE body; its `finally` aborts the generation and logs it."""
        ev = _Events(self)
        status = None
        try:
            yield ev.send("response.created", response=self.response(None, [], "in_progress"))
            yield ev.send("response.in_progress",
                          response=self.response(None, [], "in_progress"))
            calls = self.plan.tools.stream() if self.plan.tools is not None else None
            async for st, out in gen.deltas():
                reasoning, text = st.last_split if st.reasoner else ("", out.new_text)
                pieces: list[dict[str, Any]] = []
                if reasoning:
                    pieces.append({"reasoning_content": reasoning})
                pieces += calls.feed(text) if calls else [{"content": text}] if text else []
                if out.finished and calls is not None:
                    pieces += calls.finish()
                for p in pieces:
                    for event in ev.piece(p):
                        yield event
                if out.finished:
                    for event in ev.close():
                        yield event
                    body = self.finished(gen, st, ev.output)
                    kind = ("response.completed" if body["status"] == "completed"
                            else "response.incomplete")
                    yield ev.send(kind, response=body)
        except (asyncio.CancelledError, GeneratorExit):
            status = "disconnected"
            raise
        except Exception as e:  # headers are out: an error event, as OpenAI sends it
            status = "error"
            err = map_exception(e)
            if err is None:
                logger.exception("stream failed")
            msg = err.message if err else "internal server error"
            error = {"message": msg, "type": err.type if err else "server_error",
                     "param": err.param if err else None, "code": err.code if err else None}
            yield ev.send("error", message=msg, code=error["code"], param=error["param"],
                          error=error)
        finally:
            gen.close(status)


class _Events:
    """The open output item and the events that build it up piece by piece."""

    def __init__(self, turn: Turn) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None
        self.text = ""

    def send(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.item, self.text = item, ""
        self.output.append(item)
        out.append(self.send("response.output_item.added", output_index=len(self.output) - 1,
                             item=item))
        if item["type"] == "message":
            out.append(self.send("response.content_part.added", **self._where(),
                                 content_index=0, part={"type": "output_text", "text": "",
                                                        "annotations": []}))
        return out

    def piece(self, p: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if "reasoning_content" in p:
            if self.item is None or self.item["type"] != "reasoning":
                out += self._open(reasoning_item(""))
            self.text += p["reasoning_content"]
            out.append(self.send("response.reasoning_text.delta", **self._where(),
                                 content_index=0, delta=p["reasoning_content"]))
        if p.get("content"):
            if self.item is None or self.item["type"] != "message":
                out += self._open(message_item("", "in_progress") | {"content": []})
            self.text += p["content"]
            out.append(self.send("response.output_text.delta", **self._where(),
                                 content_index=0, delta=p["content"], logprobs=[]))
        for tc in p.get("tool_calls") or []:
            fn = tc.get("function", {})
            if "id" in tc:
                out += self._open(call_item(tc["id"], fn["name"], "", "in_progress"))
            if fn.get("arguments") and self.item is not None:
                self.text += fn["arguments"]
                out.append(self.send("response.function_call_arguments.delta",
                                     **self._where(), delta=fn["arguments"]))
        return out

    def close(self) -> list[str]:
        """The open item's closing events; it is then complete in `output`."""
        item, text = self.item, self.text
        if item is None:
            return []
        out = []
        where = self._where()
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.send("response.reasoning_text.done", **where, content_index=0,
                                 text=text))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self.send("response.output_text.done", **where, content_index=0,
                                 text=text, logprobs=[]))
            out.append(self.send("response.content_part.done", **where, content_index=0,
                                 part=part))
        else:
            item["arguments"] = text
            out.append(self.send("response.function_call_arguments.done", **where,
                                 name=item["name"], arguments=text))
        item["status"] = "completed"
        out.append(self.send("response.output_item.done", output_index=where["output_index"],
                             item=item))
        self.item = None
        return out


def _usage(gen: Generation) -> dict[str, Any]:
    """Chat's usage under the Responses API's names, with kvserve's kv_cache."""
    u = gen.usage()
    reasoning = u.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": u["total_tokens"], "kv_cache": u["kv_cache"]}
