"""JSON in pieces, for the parsers: where a value ends (without parsing it), a call's
arguments passed on as they arrive, and one `{"name": ..., "arguments": ...}` call
object read as its text comes."""

from __future__ import annotations

import json
import re

from server.tool_parsers.base import WS, Event, is_object

# Characters JSON may hold outside strings; anything else breaks the value there.
_OUTSIDE = set(WS + "{}[],:-+.0123456789eEtrufalsn")
_HEAD_LIMIT = 4096  # a call whose name is not read by then waits for its whole object


class JsonScan:
    """Where one JSON value ends, read piece by piece without parsing it: nesting depth
    outside strings, escapes inside them. `feed` returns the index in the piece just
    past the value (a scalar ends before the delimiter that follows it), or None while
    it goes on. A character JSON cannot hold there ends it too, with `broken` set.
    `opener`: the first character the value must start with ("{" for a call object)."""

    def __init__(self, opener: str | None = None) -> None:
        self.opener = opener
        self.kind: str | None = None  # "container", "string" or "scalar"
        self.depth = 0
        self.in_str = self.esc = False
        self.done = self.broken = False

    def _end(self, i: int, broken: bool = False) -> int:
        self.done, self.broken = True, broken
        return i

    def feed(self, text: str) -> int | None:
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return self._end(i + 1)
                continue
            if self.kind is None:
                if ch in WS:
                    continue
                if self.opener is not None and ch != self.opener:
                    return self._end(i, broken=True)
                self.kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # a scalar closed by its container
                    return self._end(i)
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
            elif self.depth == 0 and (ch in WS or ch == ","):
                return self._end(i)
            elif ch not in _OUTSIDE:
                return self._end(i, broken=True)
        return None


class ArgsReader:
    """A call's arguments value as it arrives: an object's text is passed on in pieces
    as the model writes it; a JSON string (some models quote the object) is held and
    passed on decoded once whole."""

    def __init__(self) -> None:
        self.scan = JsonScan()
        self.text = ""

    @property
    def done(self) -> bool:
        return self.scan.done and not self.scan.broken

    def feed(self, text: str) -> tuple[list[Event], int | None]:
        end = self.scan.feed(text)
        piece = text if end is None else text[:end]
        self.text += piece
        if self.scan.kind != "string":
            return ([Event("args", piece)] if piece else []), end
        if end is None:
            return [], None
        try:
            decoded = json.loads(self.text)
        except ValueError:
            decoded = self.text
        self.text = decoded
        return [Event("args", decoded)], end

    def ok(self) -> bool:
        return self.done and is_object(self.text)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                   r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


class JsonCall:
    """One call object, `{"name": N, "arguments": A}` (or `"parameters"`, Llama's and
    vLLM's required-choice key). N is announced once read, A passed on as it comes;
    an object in another order or without arguments is read once whole. `feed` returns
    the events and, once the object is over, the text after it (else None)."""

    def __init__(self) -> None:
        self.obj = JsonScan("{")
        self.raw = ""
        self.name: str | None = None
        self.args: ArgsReader | None = None

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        end = self.obj.feed(text)
        events = self._advance(text if end is None else text[:end])
        if end is None:
            return events, None
        return events + self._close(), text[end:]

    def finish(self) -> list[Event]:
        """The text ended inside the object."""
        return self._close() if self.name is not None else [Event("failed", self.raw)]

    def _advance(self, piece: str) -> list[Event]:
        self.raw += piece
        if self.args is not None:
            return self.args.feed(piece)[0] if not self.args.scan.done else []
        if len(self.raw) > _HEAD_LIMIT or not (m := _HEAD.match(self.raw)):
            return []
        try:
            self.name = json.loads(m.group(1))
        except ValueError:
            return []
        self.args = ArgsReader()
        return [Event("start", self.name), *self.args.feed(self.raw[m.end():])[0]]

    def _close(self) -> list[Event]:
        if self.args is not None:
            return [Event("end", ok=self.args.ok())]
        try:  # never announced: the whole object, in any key order
            obj = json.loads(self.raw)
        except ValueError:
            return [Event("failed", self.raw)]
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return [Event("failed", self.raw)]
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return [Event("start", obj["name"]), Event("args", text),
                Event("end", ok=is_object(text))]
