"""A parser's events in OpenAI's shapes: the deltas of a chat stream (a call's index,
id, type and name first, then its arguments in pieces; content apart) and, once the
text is over, the message's content and `tool_calls`."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

from server.tool_parsers.base import Event, ToolParser

_ALNUM = string.ascii_letters + string.digits


def new_call_id(short: bool = False) -> str:
    """`call_` + 24 hex digits (OpenAI's form); 9 letters and digits where the model's
    template takes nothing else (Mistral's, as vLLM makes them)."""
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class CallStream:
    """One choice's text through `parser`, delta by delta. With `parallel` false only
    the first call is kept (what vLLM does with `parallel_tool_calls: false`)."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.content: list[str] = []  # the content sent
        self.failed = False  # a call did not parse: the whole text is the answer
        self.open = False  # a call started and has not ended
        self._dropped = False  # the call in progress is past the first, not parallel

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            last = out[-1] if out else {}
            if e.kind == "content":
                self.content.append(e.text)
                if "content" in last:
                    last["content"] += e.text
                else:
                    out.append({"content": e.text})
            elif e.kind == "start":
                self.open = True
                self._dropped = bool(self.calls) and not self.parallel
                if not self._dropped:
                    call = ToolCall(new_call_id(self.parser.short_ids), e.text)
                    self.calls.append(call)
                    out.append({"tool_calls": [{
                        "index": len(self.calls) - 1, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}]})
            elif e.kind == "args":
                if self._dropped or not self.calls:
                    continue
                index = len(self.calls) - 1
                self.calls[index].arguments += e.text
                tc = last.get("tool_calls", [{}])[0]
                if tc.get("index") == index and "id" not in tc:  # the first stays as OpenAI's
                    tc["function"]["arguments"] += e.text
                else:
                    out.append({"tool_calls": [{"index": index,
                                                "function": {"arguments": e.text}}]})
            elif e.kind == "end":
                self.open = False
                self.failed |= not e.ok and not self._dropped
            else:  # failed: text that looked like a call (the parser passed it on)
                self.failed = True
        return out

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole response's content and tool calls, once `finish` ran: the text as
        the model wrote it and no calls when a call did not parse (vLLM's answer), and
        content None beside calls when there is none (OpenAI's)."""
        if self.failed or self.open or not self.calls:
            return text, []
        return "".join(self.content) or None, [c.as_dict() for c in self.calls]
