"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, any number of them, with text before, between and after."""

from __future__ import annotations

from server.tool_parsers.base import Event, ToolParser, held_marker
from server.tool_parsers.json_call import JsonCall

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    keep_special_tokens = True  # Hermes 2 Pro's <tool_call> is a special token

    def __init__(self) -> None:
        super().__init__()
        # text: outside calls; call: inside an object; after: past a call's object,
        # up to its END; bad: a <tool_call> that held no call, passed on as content
        self.state = "text"
        self.call: JsonCall | None = None

    def _step(self) -> bool:
        """One move through the buffer; False when it must wait for more text."""
        if self.state == "text":
            if not self.text_until(START):
                return False
            self.state, self.call = "call", JsonCall()
            return True
        if self.state == "call":
            assert self.call is not None
            events, rest = self.call.feed(self.buf)
            self.buf = rest or ""
            self._call_events(events)
            if rest is not None and self.state == "call":
                self.state = "after"
            return rest is not None
        # after / bad: up to and including END (a new START also ends a call's tail:
        # some models leave END out between calls)
        i = self.buf.find(END)
        j = self.buf.find(START) if self.state == "after" else -1
        if j >= 0 and (i < 0 or j < i):
            self.buf, self.state = self.buf[j:], "text"
            return True
        if i < 0:
            keep = max(held_marker(self.buf, END), held_marker(self.buf, START))
            self._tail(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._tail(self.buf[: i + len(END)])
        self.buf, self.state = self.buf[i + len(END):], "text"
        return True

    def _tail(self, text: str) -> None:
        if self.state == "bad":
            self.content(text)

    def _call_events(self, events: list[Event]) -> None:
        if self.reader_events(events, lambda: START):  # not a call: the text as written
            self.state = "bad"

    def finish(self) -> list[Event]:
        if self.state == "call" and self.call is not None:
            self._call_events(self.call.finish())
        elif self.state == "bad" or (self.state == "text" and self.buf):
            self.content(self.buf)
        return self.take(end=True)
