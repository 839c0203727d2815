"""What every tool-call parser shares: the events a parser emits and the base class
that holds back whitespace around calls (the JSON readers: `json_call.py`).

A parser is fed the model's text in deltas (any split, down to one character) and emits
events: content (text outside the calls), a call's start (its name), pieces of its
arguments, and its end. The whole-text parse is the same parser fed the whole text at
once (`server/tool_parsers/calls.py`), so streaming and non-streaming agree by
construction wherever the text is well-formed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

WS = " \t\r\n"


@dataclass
class Event:
    """`content` (text), `start` (text: the name), `args` (text: a piece of the
    arguments), `end` (ok: the arguments are a JSON object), `failed` (text that looked
    like a call and was not one; the parser emits it as content too)."""

    kind: Literal["content", "start", "args", "end", "failed"]
    text: str = ""
    ok: bool = True


def held_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (held back until
    the next delta says whether they do)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ToolParser:
    """A format's parser: `feed` text deltas, `finish` at the end; both return events.
    Content is passed on except whitespace next to calls: the trailing whitespace of
    the content so far is held until more content follows (then it goes out) or a
    call starts or the text ends after calls (then it is dropped), so a call's
    surrounding newlines never arrive as content, whatever the split."""

    name: ClassVar[str] = ""
    # The format's markers are special tokens (vLLM's parsers turn skip_special_tokens off)
    keep_special_tokens: ClassVar[bool] = False
    # Mistral's chat templates take only 9-character alphanumeric call ids
    short_ids: ClassVar[bool] = False

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._ws = ""
        self._said = False  # content went out
        self.calls = 0
        self.buf = ""  # text fed and not yet read

    def feed(self, text: str) -> list[Event]:
        """Take a delta and read the buffer while it can move."""
        self.buf += text
        while self.buf and self._step():
            pass
        return self.take()

    def _step(self) -> bool:
        """One move through the buffer; False when it must wait for more text."""
        raise NotImplementedError

    def text_until(self, marker: str) -> bool:
        """Outside calls: pass on the content before `marker` and consume the marker
        (True), or pass on what cannot begin it and wait for more (False)."""
        i = self.buf.find(marker)
        if i < 0:
            keep = held_marker(self.buf, marker)
            self.content(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self.content(self.buf[:i])
        self.buf = self.buf[i + len(marker):]
        return True

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip(WS)
        trailing = text[len(body):]
        if body:
            lead = self._ws
            if self.calls and not self._said:  # nor is whitespace between a call and
                lead, body = "", body.lstrip(WS)  # the first content
            self.events.append(Event("content", lead + body))
            self._ws, self._said = "", True
        self._ws += trailing

    def call_events(self, events: list[Event]) -> None:
        """A call reader's events: a start drops the held whitespace."""
        for e in events:
            if e.kind == "start":
                self._ws = ""
                self.calls += 1
            self.events.append(e)

    def reader_events(self, events: list[Event], prefix: Callable[[], str]) -> bool:
        """A call reader's events, where a `failed` one (the text was no call after all)
        goes out as content after `prefix()`, what the format consumed before it; True
        if one did (the parser then reads on as text)."""
        failed = False
        for e in events:
            if e.kind == "failed":
                self.events.append(e)
                self.content(prefix() + e.text)
                failed = True
            else:
                self.call_events([e])
        return failed

    def take(self, end: bool = False) -> list[Event]:
        if end and self._ws and not self.calls:
            self.events.append(Event("content", self._ws))
        out, self.events = self.events, []
        return out
