"""The tool-call parsers (server/tool_parsers/) on outputs recorded in each model
format: well-formed, several calls, text around them, malformed; each fed whole and
split at every character boundary (two pieces), one character at a time, and in random
pieces, as a stream delivers it; plus the OpenAI delta shapes and the registry."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.tool_parsers import PARSERS
from server.tool_parsers.calls import CallStream
from server.tool_parsers.forced import NamedCallParser, RequiredCallsParser

# (parser, model output, content, [(name, arguments)]); calls None: malformed, so the
# whole answer is the text as written and there are no calls (vLLM's answer)
CASES: list[tuple[str, str, str | None, list[tuple[str, dict]] | None]] = [
    # Qwen2.5-7B-Instruct
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
     '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>', None,
     [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    # Hermes-3: text first, two calls, non-ASCII, braces and escapes inside strings
    ("hermes", 'Let me look both up.\n<tool_call>\n{"name": "weather", "arguments": {"city": '
     '"Zürich", "note": "a } and a \\" in {text}"}}\n</tool_call>\n<tool_call>\n{"name": '
     '"time", "arguments": {"tz": "東京"}}\n</tool_call>', "Let me look both up.",
     [("weather", {"city": "Zürich", "note": 'a } and a " in {text}'}), ("time", {"tz": "東京"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": 1}, "name": "late_name"}\n</tool_call>\n'
     "Done, see above.", "Done, see above.", [("late_name", {"q": 1})]),
    ("hermes", '<tool_call>{"name": "no_args"}</tool_call>', None, [("no_args", {})]),
    ("hermes", '<tool_call>{"name": "quoted", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
     None, [("quoted", {"a": [1, 2]})]),
    ("hermes", "The answer is 4. Nothing to call here, not even <tool_ or <tool_call", "The "
     "answer is 4. Nothing to call here, not even <tool_ or <tool_call", []),
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call>", None, None),
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"city": "Par', None, None),
    # Llama-3.1-8B-Instruct (JSON calls)
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": [1, {"y": null}]}}; '
     '{"name": "b", "parameters": {}}', None, [("a", {"x": [1, {"y": None}]}), ("b", {})]),
    ("llama3_json", "Paris is in France; its weather is {mild}.",
     "Paris is in France; its weather is {mild}.", []),
    ("llama3_json", '  {"answer": 42, "source": "guess"}', None, None),
    ("llama3_json", '{"name": "f", "parameters": {"x": ', None, None),
    # the arguments whole, only the wrapper's "}" missing: still a call
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}', None, [("f", {"x": 1})]),
    # Mistral-7B-Instruct-v0.3 (a JSON list) and Mistral-Small-3.2 (name[ARGS]{...})
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time'
     '[ARGS]{"tz": "CET"}', "Sure.", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    ("mistral", "No tools needed: [1, 2] [TOOL] [ARGS]", "No tools needed: [1, 2] [TOOL] [ARGS]", []),
    ("mistral", "[TOOL_CALLS]not a name at all[ARGS]{}", None, None),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": ', None, None),
    # Llama-3.2-3B-Instruct and Llama 4 (pythonic)
    ("pythonic", '[get_weather(city="San Francisco, CA", unit=\'celsius\'), get_time()]', None,
     [("get_weather", {"city": "San Francisco, CA", "unit": "celsius"}), ("get_time", {})]),
    ("pythonic", '<|python_start|>[search(query="a [b] (c)", limit=3, exact=True, '
     'tags=["x", None])]<|python_end|>', None,
     [("search", {"query": "a [b] (c)", "limit": 3, "exact": True, "tags": ["x", None]})]),
    ("pythonic", "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    ("pythonic", "[1] is the first reference.", None, None),
    ("pythonic", "[get_weather(city=Paris)]", None, None),
    ("pythonic", '[get_weather(city="Paris"), get_ti', None, None),
]


def run(parser: Any, pieces: list[str], parallel: bool = True
        ) -> tuple[str, list[tuple[str, str]], list[dict], CallStream]:
    """Feed `pieces`; the deltas accumulated as a client does (content; calls by index:
    id and name from the first delta, arguments appended)."""
    stream = CallStream(parser(), parallel)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            name = tc["function"].get("name")
            calls.setdefault(tc["index"], [name, ""])[1] += tc["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas, stream


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_outputs(name: str, text: str, content: str | None,
                          calls: list[tuple[str, dict]] | None) -> None:
    parser = PARSERS[name]
    whole_content, whole_calls, _, stream = run(parser, [text])
    got_content, got_calls = stream.message(text)
    if calls is None:  # malformed: the answer as written
        assert (got_content, got_calls) == (text, [])
    else:
        assert got_content == (content if calls else text)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got_calls] == calls
        # what a stream accumulates is the whole response's answer
        assert whole_content == (got_content or "")
        assert whole_calls == [(c["function"]["name"], c["function"]["arguments"])
                               for c in got_calls]
    # any split gives what one piece gives: two pieces at every boundary, one character
    # at a time, random pieces
    rng = random.Random(len(text))
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [list(text)] + [_pieces(text, rng) for _ in range(20)]
    for pieces in splits:
        assert run(parser, pieces)[:2] == (whole_content, whole_calls), pieces


def test_split_utf8_bytes_as_the_detokenizer_hands_them_on() -> None:
    """A byte-level model emits a character's bytes in separate tokens; the detokenizer
    passes text on once a character is whole, so every byte split is a character split."""
    import codecs

    text = CASES[1][1].encode()
    want = run(PARSERS["hermes"], [CASES[1][1]])[:2]
    for i in range(len(text) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        pieces = [dec.decode(text[:i]), dec.decode(text[i:], final=True)]
        assert run(PARSERS["hermes"], pieces)[:2] == want, i


def test_deltas_are_openai_shaped() -> None:
    """Per call: index, id, type and name first (arguments ""), then only arguments."""
    text = CASES[1][1]
    _, calls, deltas, _ = run(PARSERS["hermes"], list(text))
    tool = [tc for d in deltas for tc in d.get("tool_calls", [])]
    firsts = [tc for tc in tool if "id" in tc]
    assert [tc["index"] for tc in firsts] == [0, 1]
    for tc in firsts:
        assert tc["type"] == "function" and tc["function"]["arguments"] == ""
        assert tc["id"].startswith("call_") and len(tc["id"]) == 29
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
               for tc in tool if "id" not in tc)
    assert sum(len(tc["function"]["arguments"]) > 0 for tc in tool) > 10  # in pieces
    assert all("content" not in d or d["content"] for d in deltas)
    assert [n for n, _ in calls] == ["weather", "time"]
    mistral = run(PARSERS["mistral"], [CASES[14][1]])[2]
    ids = [tc["id"] for d in mistral for tc in d.get("tool_calls", []) if "id" in tc]
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)  # Mistral's


def test_parallel_false_keeps_the_first_call() -> None:
    _, calls, _, stream = run(PARSERS["hermes"], [CASES[1][1]], parallel=False)
    assert [n for n, _ in calls] == ["weather"]
    assert [c["function"]["name"] for c in stream.message(CASES[1][1])[1]] == ["weather"]


def test_constrained_readers() -> None:
    """required: vLLM's list of {"name", "parameters"}; named: the arguments alone."""
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    want = ("", [("f", '{"x": 1}'), ("g", "{}")])
    for i in range(len(text) + 1):
        assert run(RequiredCallsParser, [text[:i], text[i:]])[:2] == want
    named = run(lambda: NamedCallParser("f"), list('{"x": 1}'))
    assert named[:2] == ("", [("f", '{"x": 1}')])
    assert named[2][0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}


def test_the_parsers_vllm_names() -> None:
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]


def test_any_text_reads_the_same_however_it_is_split() -> None:
    """Random texts of markers, JSON pieces and prose, for every parser: each two-piece
    split and one character at a time read as the whole text does (never an error)."""
    atoms = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
             "<|python_start|>", "<|python_end|>", '{"name": "f", "arguments": ',
             '{"name": "g", "parameters": ', '{"a": 1}', "{", "}", "[", "]", '"', "\\", ",",
             ";", " ", "\n", "x", "f(a=1)", "(", ")", "'", "get_time", '"s}"', ":", "é",
             '{"name": "h"}']
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 14)))
        for parser in [*PARSERS.values(), RequiredCallsParser]:
            whole = run(parser, [text])
            whole[3].message(text)
            for pieces in [*([text[:i], text[i:]] for i in range(len(text) + 1)), list(text)]:
                assert run(parser, pieces)[:2] == whole[:2], (parser, pieces)
