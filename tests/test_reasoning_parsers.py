"""The reasoning parsers (server/reasoning/) on recorded outputs of each form: well-formed,
unterminated (cut by max_tokens), no tags (thinking off), and every text split in two
and in single characters at every boundary, which must give the same split as the whole
text, with no piece of a tag reaching either side."""

from __future__ import annotations

import pytest

from server.reasoning import REASONING_PARSERS, ReasoningParser

# (parser, model output, reasoning, answer)
RECORDED = [
    # Qwen3 with thinking on: both tags, a blank line before the answer
    ("qwen3", "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "\nThe user asks for 2+2. That is 4.\n", "The answer is 4."),
    # Qwen3 with enable_thinking false: the template closed the reasoning in the prompt
    ("qwen3", "The answer is 4.", "", "The answer is 4."),
    # Qwen3 cut by max_tokens inside the reasoning
    ("qwen3", "<think>\nFirst, 2+2 is", "\nFirst, 2+2 is", ""),
    # a text that starts like the tag but is not it
    ("qwen3", "<thing> is not a tag", "", "<thing> is not a tag"),
    ("qwen3", "<th", "", "<th"),
    # DeepSeek-R1: <think> is in the prompt, the output starts inside the reasoning
    ("deepseek_r1", "Okay, 2+2=4.\n</think>\n\n**4**", "Okay, 2+2=4.\n", "**4**"),
    # ... or writes the opening tag itself
    ("deepseek_r1", "<think>\nOkay.\n</think>\n\n4", "\nOkay.\n", "4"),
    # unterminated, or no tags at all: all reasoning (vLLM's reading)
    ("deepseek_r1", "Okay, so 2+2 is", "Okay, so 2+2 is", ""),
    ("deepseek_r1", "Hmm </thin", "Hmm </thin", ""),
    # a tool call after the reasoning stays in the answer, for the tool parser
    ("qwen3", '<think>call it</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n'
     "</tool_call>", "call it", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    # a closing tag inside the answer is answer
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
]


def _run(name: str, pieces: list[str]) -> tuple[str, str, ReasoningParser]:
    p = REASONING_PARSERS[name]()
    reasoning, content = "", ""
    for piece in [*pieces, None]:
        r, c = p.feed(piece) if piece is not None else p.finish()
        reasoning, content = reasoning + r, content + c
    assert (p.reasoning, p.content) == (reasoning, content)
    return reasoning, content, p


@pytest.mark.parametrize("name, text, reasoning, content", RECORDED)
def test_whole_text(name: str, text: str, reasoning: str, content: str) -> None:
    assert _run(name, [text])[:2] == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", RECORDED)
def test_split_at_every_boundary(name: str, text: str, reasoning: str, content: str
                                 ) -> None:
    for i in range(len(text) + 1):
        assert _run(name, [text[:i], text[i:]])[:2] == (reasoning, content), i
    for i in range(len(text)):
        for j in range(i, len(text) + 1):
            assert _run(name, [text[:i], text[i:j], text[j:]])[:2] == (reasoning, content)
    assert _run(name, list(text))[:2] == (reasoning, content)


def test_no_tag_piece_is_let_through() -> None:
    """Character by character, no delta holds part of a tag: held until it is whole."""
    p = REASONING_PARSERS["qwen3"]()
    out = [p.feed(ch) for ch in "<think>ab</think>cd"] + [p.finish()]
    assert all("<" not in r + c and ">" not in r + c for r, c in out)


def test_in_reasoning_tracks_the_tags() -> None:
    """What the token count of usage.completion_tokens_details.reasoning_tokens reads."""
    q = REASONING_PARSERS["qwen3"]()
    assert not q.in_reasoning
    q.feed("<think>")
    assert q.in_reasoning
    q.feed("x</think>")
    assert not q.in_reasoning
    d = REASONING_PARSERS["deepseek_r1"]()
    assert d.in_reasoning
    d.feed("x</think>y")
    assert not d.in_reasoning
    plain = REASONING_PARSERS["qwen3"]()
    plain.feed("answer")
    assert not plain.in_reasoning
