"""The readers of constrained output, for `tool_choice` "required" and a named function
(vLLM's way): the grammar built from the tools (`server/tools.py`) makes the model
write JSON that these read back directly, so no model format is involved.

- named: the whole output is the function's arguments object; the call's name is the
  request's and goes out before the first token.
- required: the output is a list of `{"name": ..., "parameters": {...}}` objects
  (vLLM's shape), read as Mistral's JSON call list is."""

from __future__ import annotations

from server.tool_parsers.base import Event, ToolParser
from server.tool_parsers.mistral import CallList


class NamedCallParser(ToolParser):
    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def feed(self, text: str) -> list[Event]:
        if not self.calls:
            self.call_events([Event("start", self.function)])
        if text:
            self.events.append(Event("args", text))
        return self.take()

    def finish(self) -> list[Event]:
        self.feed("")
        # as vLLM: the call stands even if the output was cut short (finish_reason says so)
        self.events.append(Event("end"))
        return self.take()


class RequiredCallsParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self.list: CallList | None = CallList()

    def feed(self, text: str) -> list[Event]:
        if self.list is None:
            return []
        events, rest = self.list.feed(text)
        self.call_events(events)
        if rest is not None:
            self.list = None  # the grammar ends the output at the list's "]"
        return self.take()

    def finish(self) -> list[Event]:
        if self.list is not None:
            self.call_events(self.list.finish())
        return self.take()
