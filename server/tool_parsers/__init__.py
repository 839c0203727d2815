"""Tool-call parsers, one module per model format, as vLLM names them
(`--tool-call-parser NAME`): each reads the model's text, whole or in stream deltas, into
content and calls. `calls.py` turns a parser's events into OpenAI's message and deltas.
Pure Python, no torch: the CLI checks `--tool-call-parser` against `PARSERS` before the
model loads."""

from __future__ import annotations

from server.tool_parsers.base import ToolParser
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.llama3_json import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}

__all__ = ["PARSERS", "ToolParser"]
