"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer is one or more
`{"name": ..., "parameters": {...}}` objects, separated by `;`, optionally after
`<|python_tag|>`. An answer that starts otherwise is text, as in vLLM's parser: calls
are looked for only at its start (and right after a call)."""

from __future__ import annotations

from server.tool_parsers.base import Event, ToolParser
from server.tool_parsers.json_call import JsonCall

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    keep_special_tokens = True  # <|python_tag|> is a special token

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start / between (before a call may begin), call, text
        self.call: JsonCall | None = None
        self.lead = ""

    def _step(self) -> bool:
        if self.state == "text":
            self.content(self.buf)
            self.buf = ""
            return False
        if self.state == "call":
            assert self.call is not None
            events, rest = self.call.feed(self.buf)
            self.buf = rest or ""
            self._call_events(events)
            if rest is not None and self.state == "call":
                self.state = "between"
            return rest is not None
        # start / between: skip whitespace (and `;` between calls) and the tag
        skip = " \t\r\n" + (";" if self.state == "between" else "")
        head = self.buf.lstrip(skip)
        if not head or (TAG.startswith(head) and head != TAG):
            return False  # wait: whitespace only, or the tag still arriving
        if head.startswith(TAG):
            self.buf = head[len(TAG):]
            return True
        if head[0] == "{":
            if not self.calls:  # the answer's own whitespace, should it be no call
                self.lead = self.buf[: len(self.buf) - len(head)]
            self.buf, self.state, self.call = head, "call", JsonCall()
            return True
        self.state = "text"  # the rest is an answer, not calls
        if self.calls:
            self.buf = head  # no separator debris after a call
        return True

    def _call_events(self, events: list[Event]) -> None:
        # a JSON object that is not a call: text
        if self.reader_events(events, lambda: "" if self.calls else self.lead):
            self.state = "text"

    def finish(self) -> list[Event]:
        if self.state == "call" and self.call is not None:
            self._call_events(self.call.finish())
        elif self.state == "text" or (self.state == "start" and self.buf):
            self.content(self.buf)
        return self.take(end=True)
