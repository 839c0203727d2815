"""Mistral: `[TOOL_CALLS]` then the calls, in either of Mistral's forms: a JSON list
`[{"name": ..., "arguments": {...}}, ...]` (tokenizer v3, Mistral 7B v0.3, Mixtral) or
`name[ARGS]{...}` per call (tokenizer v11+, Mistral Small 3.2, Magistral). Text before
the marker (and after the calls) is content. The JSON list reader also reads the
required choice's constrained output (`server/tool_parsers/forced.py`)."""

from __future__ import annotations

import re

from server.tool_parsers.base import Event, ToolParser, held_marker
from server.tool_parsers.json_call import ArgsReader, JsonCall

START, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[\w.\-]{1,128}")


class CallList:
    """A JSON list of call objects, as it arrives; `feed` returns events and, once the
    list is over (or broken), the text after it (else None)."""

    def __init__(self) -> None:
        self.state = "open"  # open: before "["; items: between items; item: in one
        self.call: JsonCall | None = None

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        events: list[Event] = []
        while text:
            if self.state == "item":
                assert self.call is not None
                got, rest = self.call.feed(text)
                events += got
                if rest is None:
                    return events, None
                if any(e.kind == "failed" for e in got):  # not a call: the list ends
                    return events, rest
                text, self.state = rest, "items"
                continue
            head = text.lstrip(" \t\r\n" + ("," if self.state == "items" else ""))
            if not head:
                return events, None
            if self.state == "open":
                if head[0] != "[":
                    return [*events, Event("failed")], head
                text, self.state = head[1:], "items"
            elif head[0] == "]":
                return events, head[1:]
            elif head[0] == "{":
                text, self.state, self.call = head, "item", JsonCall()
            else:
                return [*events, Event("failed")], head
        return events, None

    def finish(self) -> list[Event]:
        if self.state == "item" and self.call is not None:
            return self.call.finish()
        return [] if self.state == "items" else [Event("failed")]


class MistralParser(ToolParser):
    name = "mistral"
    keep_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens
    short_ids = True

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"  # text, calls (just past the marker), list, named, args
        self.list: CallList | None = None
        self.args: ArgsReader | None = None

    def _step(self) -> bool:
        if self.state == "text":
            if not self.text_until(START):
                return False
            self.state = "calls"
            return True
        if self.state == "calls":
            head = self.buf.lstrip()
            if not head:
                return False
            self.buf = head
            self.state, self.list = ("list", CallList()) if head[0] in "[{" else ("named", None)
            if head[0] == "{":  # one bare object: read it as a list of one
                self.buf = "[" + head
            return True
        if self.state == "list":
            assert self.list is not None
            events, rest = self.list.feed(self.buf)
            self._events(events)
            self.buf = rest or ""
            if rest is not None:
                self.state = "text"
            return rest is not None
        if self.state == "named":  # name[ARGS]
            i = self.buf.find(ARGS)
            cut = i if i >= 0 else len(self.buf) - held_marker(self.buf, ARGS)
            name = self.buf[:cut].strip()
            if not _NAME.fullmatch(name) and (name or i >= 0):  # no call: the marker is text
                self._events([Event("failed")])
                self.content(START)
                self.state = "text"
                return True
            if i < 0:
                return False
            self.call_events([Event("start", name)])
            self.buf, self.state, self.args = self.buf[i + len(ARGS):], "args", ArgsReader()
            return True
        assert self.args is not None  # args: the arguments' JSON
        events, end = self.args.feed(self.buf)
        self.call_events(events)
        if end is None:
            self.buf = ""
            return False
        self.call_events([Event("end", ok=self.args.ok())])
        self.buf, self.state = self.buf[end:], "text"
        return True

    def _events(self, events: list[Event]) -> None:
        if self.reader_events(events, lambda: ""):  # what was not a call, as text
            self.state = "text"

    def finish(self) -> list[Event]:
        if self.state == "list" and self.list is not None:
            self._events(self.list.finish())
        elif self.state == "args" and self.args is not None:
            self.call_events([Event("end", ok=self.args.ok())])
        elif self.state in ("text", "named"):
            self.content((START if self.state == "named" else "") + self.buf)
        return self.take(end=True)
