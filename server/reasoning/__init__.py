"""Reasoning parsers, as vLLM names them (`--reasoning-parser NAME`): each splits the
model's text, whole or in stream deltas, into the reasoning (`reasoning_content`) and
the answer (`content`). Pure Python, no torch: the CLI checks `--reasoning-parser`
against `REASONING_PARSERS` before the model loads."""

from __future__ import annotations

from server.reasoning.think import DeepSeekR1Parser, Qwen3Parser, ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}

__all__ = ["REASONING_PARSERS", "ReasoningParser"]
