"""Reasoning end to end (server/reasoning/): the demo model served with
`--reasoning-parser`, its output forced by a regex into a `<think>…</think>answer` text
(as a reasoning model writes it), read by the real `openai` SDK. Non-streaming, the
message has `reasoning_content` and `content`; streaming, the deltas carry the
reasoning first and then the answer, whatever the token boundaries; tool calls are read
from the answer only; usage counts the reasoning tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine.demo import DEMO_MODEL_DIR
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from server.app import build_app
from server.cli import main
from server.settings import ServerSettings
from server.testing import ServerThread

pytest.importorskip("xgrammar")

THINK = r"<think>\nThe user wants (Paris|Oslo)\.\n</think>\n\nIt is sunny\."
ASK = [{"role": "user", "content": "Weather?"}]


def _serve(parser: str) -> Iterator[openai.OpenAI]:
    engine = AsyncEngine.from_config(EngineConfig(model=str(DEMO_MODEL_DIR), num_blocks=512))
    app = build_app(engine, ServerSettings(served_model_names=["tiny"],
                                           model_path=str(DEMO_MODEL_DIR),
                                           reasoning_parser=parser, tool_call_parser="hermes",
                                           enable_auto_tool_choice=True))
    with ServerThread(app) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen3() -> Iterator[openai.OpenAI]:
    yield from _serve("qwen3")


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], Any]:
    """The deltas as (field, text) in order, and the last chunk with usage."""
    deltas: list[tuple[str, str]] = []
    last = None
    for chunk in client.chat.completions.create(stream=True, stream_options={
            "include_usage": True}, **kw):
        last = chunk
        for c in chunk.choices:
            d = c.delta.model_dump()
            for key in ("reasoning_content", "content"):
                if d.get(key):
                    deltas.append((key, d[key]))
    return deltas, last


def test_reasoning_apart_from_the_answer(qwen3: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=ASK, max_tokens=80, seed=0,
                              extra_body={"guided_regex": THINK})
    whole = qwen3.chat.completions.create(**kw)
    msg = whole.choices[0].message
    reasoning = msg.model_dump()["reasoning_content"]
    assert reasoning in ("\nThe user wants Paris.\n", "\nThe user wants Oslo.\n")
    assert msg.content == "It is sunny." and whole.choices[0].finish_reason == "stop"
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.completion_tokens

    deltas, last = _stream(qwen3, **kw)
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning, then answer
    assert "".join(t for k, t in deltas if k == "reasoning_content") == reasoning
    assert "".join(t for k, t in deltas if k == "content") == "It is sunny."
    assert last.usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_tool_calls_come_from_the_answer(qwen3: openai.OpenAI) -> None:
    """A call written inside the reasoning is reasoning; the one after it is the call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    regex = r"<think>\nMaybe " + call + r"\n</think>\n\n" + call
    kw: dict[str, Any] = dict(model="tiny", messages=ASK, tools=tools, max_tokens=160,
                              seed=0, extra_body={"guided_regex": regex})
    choice = qwen3.chat.completions.create(**kw).choices[0]
    assert "<tool_call>" in choice.message.model_dump()["reasoning_content"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [c] = choice.message.tool_calls
    assert c.function.name == "get_weather"
    assert json.loads(c.function.arguments) == {"city": "Oslo"}
    deltas, _ = _stream(qwen3, **kw)
    assert all(k == "reasoning_content" for k, _ in deltas)  # the call came as tool_calls


def test_deepseek_r1_starts_inside_the_reasoning() -> None:
    for client in _serve("deepseek_r1"):
        kw: dict[str, Any] = dict(model="tiny", messages=ASK, max_tokens=60, seed=0,
                                  extra_body={"guided_regex": r"Hmm, sunny\.</think>Sunny\."})
        msg = client.chat.completions.create(**kw).choices[0].message
        assert (msg.model_dump()["reasoning_content"], msg.content) == ("Hmm, sunny.",
                                                                         "Sunny.")
        deltas, _ = _stream(client, **kw)
        assert "".join(t for k, t in deltas if k == "content") == "Sunny."


def test_unknown_parser_is_refused_at_start(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(DEMO_MODEL_DIR), "--reasoning-parser", "nope",
              "--port", "1"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "deepseek_r1, qwen3" in lines[0]


def test_json_by_grammar_is_all_answer() -> None:
    """A JSON response_format or a named tool constrains the whole output, which then
    holds no reasoning: deepseek_r1 (whose output starts inside the reasoning) reads it
    as the answer, and the call as a call."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}]
    for client in _serve("deepseek_r1"):
        msg = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=200, seed=0, tools=tools,
            tool_choice={"type": "function", "function": {"name": "f"}}).choices[0].message
        assert msg.model_dump().get("reasoning_content") is None
        assert [c.function.name for c in msg.tool_calls] == ["f"]


def test_responses_carry_the_reasoning(qwen3: openai.OpenAI) -> None:
    """/v1/responses: a reasoning item before the message, streamed as reasoning_text
    events, and the reasoning tokens in usage."""
    kw: dict[str, Any] = dict(model="tiny", input="Weather?", max_output_tokens=80,
                              extra_body={"guided_regex": THINK, "seed": 0})
    r = qwen3.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.startswith("\nThe user wants")
    assert r.output_text == "It is sunny." and r.usage.output_tokens_details.reasoning_tokens > 0
    with qwen3.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == final.output[0].content[0].text and final.output_text == "It is sunny."
