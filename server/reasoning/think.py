"""The `<think>…</think>` reasoning forms, read incrementally: the same code reads a
whole text and a stream split at any character, so both modes give the same split.

- deepseek_r1: DeepSeek-R1's chat template opens `<think>` in the prompt, so the output
  usually starts inside the reasoning with no opening tag (an opening tag, if written,
  is dropped); without `</think>` the whole text is reasoning (vLLM's reading).
- qwen3: Qwen3 writes both tags; a text that does not open with `<think>` (thinking off:
  `enable_thinking: false`) is all answer.

A tag split across deltas is held back until it is complete or cannot be one, so no
piece of a tag ever reaches the client.
"""

from __future__ import annotations

from typing import ClassVar

OPEN, CLOSE = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's text, delta by delta: `feed` and `finish` return the (reasoning,
    answer) text they let through; `reasoning` and `content` hold the totals."""

    name: ClassVar[str]
    starts_inside: ClassVar[bool]  # no opening tag: the text begins as reasoning

    def __init__(self) -> None:
        self.state = "start"  # then "reasoning" or "content"
        self._buf = ""
        self._strip = False  # the answer's leading blank lines after </think> are dropped
        self.reasoning = ""
        self.content = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning (or may still open it)."""
        return self.state == "reasoning" or (self.state == "start" and
                                            (self.starts_inside or bool(self._buf)))

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        while self._buf:
            if self.state == "start":
                if self._buf.startswith(OPEN):
                    self._buf, self.state = self._buf[len(OPEN):], "reasoning"
                elif OPEN.startswith(self._buf):
                    break  # may still become the opening tag
                else:
                    self.state = "reasoning" if self.starts_inside else "content"
            elif self.state == "reasoning":
                i = self._buf.find(CLOSE)
                if i >= 0:
                    reasoning += self._buf[:i]
                    self._buf = self._buf[i + len(CLOSE):]
                    self.state, self._strip = "content", True
                    continue
                keep = _partial_suffix(self._buf, CLOSE)
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            else:
                piece, self._buf = self._buf, ""
                if self._strip:
                    piece = piece.lstrip()
                    self._strip = not piece
                content += piece
        return self._add(reasoning, content)

    def finish(self) -> tuple[str, str]:
        """The text is over: a held-back piece that never became a tag is text."""
        piece, self._buf = self._buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.starts_inside):
            return self._add(piece, "")
        return self._add("", piece)

    def _add(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    starts_inside = False
