"""Pythonic tool calls (Llama 3.2 / Llama 4, and models told to answer so): the answer
is a Python list of calls with literal keyword arguments,
`[get_weather(city="Paris", unit="celsius"), get_time()]`, optionally inside Llama 4's
`<|python_start|>` ... `<|python_end|>`. An answer that does not start with `[` is
text. Each call goes out once its element closes (at the `,` or `]` after it): its
arguments are Python literals, turned into a JSON object only when whole."""

from __future__ import annotations

import ast
import json

from server.tool_parsers.base import Event, ToolParser

OPEN_TAG, CLOSE_TAG = "<|python_start|>", "<|python_end|>"


def parse_call(src: str) -> tuple[str, str] | None:
    """`name(k=literal, ...)` -> (name, arguments as JSON), None if it is not one."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if (not isinstance(node, ast.Call) or node.args
            or not isinstance(node.func, (ast.Name, ast.Attribute))):
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        if len(args) != len(node.keywords):  # **kwargs
            return None
        return ast.unparse(node.func), json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError):  # not literals, or not JSON's types
        return None


class PythonicParser(ToolParser):
    name = "pythonic"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start, list, after (past "]"), text
        self.raw = ""  # the list so far (content if its first element is no call)
        self.item = ""
        self.depth = 0
        self.quote = ""
        self.esc = False

    def _step(self) -> bool:
        if self.state == "text":
            self.content(self.buf)
            self.buf = ""
            return False
        if self.state in ("start", "after"):
            tag = OPEN_TAG if self.state == "start" else CLOSE_TAG
            head = self.buf.lstrip()
            if not head or (tag.startswith(head) and head != tag):
                return False
            if head.startswith(tag):
                self.buf = head[len(tag):]
                return True
            if self.state == "start" and head[0] == "[":
                self.buf, self.state, self.raw = head[1:], "list", "["
                return True
            self.state = "text"
            if self.calls:
                self.buf = head
            return True
        for i, ch in enumerate(self.buf):  # list: one character at a time
            self.raw += ch
            if self.quote:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth > 0:
                self.depth -= 1
            elif ch in ",]" and self.depth == 0:
                self.buf = self.buf[i + 1:]
                return self._element(closing=ch == "]")
            self.item += ch
        self.buf = ""
        return False

    def _element(self, closing: bool) -> bool:
        call = parse_call(self.item)
        if call is None and not (closing and not self.item.strip() and self.calls):
            self.events.append(Event("failed"))
            self.content((self.raw if not self.calls else self.item) + self.buf)
            self.buf, self.state = "", "text"
            return False
        if call is not None:
            self.call_events([Event("start", call[0]), Event("args", call[1]), Event("end")])
        self.item = ""
        if closing:
            self.state = "after"
        return True

    def finish(self) -> list[Event]:
        if self.state == "list":  # the list never closed
            self.events.append(Event("failed"))
            self.content(self.raw if not self.calls else self.item)
        elif self.state in ("text", "start"):
            self.content(self.buf)
        return self.take(end=True)
