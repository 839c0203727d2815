"""Tool calling end to end: a real server on loopback, driven by the `openai` SDK
(server/tools.py, server/tool_parsers/). A random-weight model given tool_choice
"required" or a named function writes schema-valid arguments (constrained decoding), a
call's result goes back in the next turn through the model's own chat template,
streaming accumulated by the SDK's helper gives the non-streaming calls, "auto" reads
the model's own calls with the server's parser (on the demo model, whatever it writes),
and bad input is a 400 naming its field while the server keeps serving."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine.demo import DEMO_MODEL_DIR
from server.cli import main
from server.protocol import ChatCompletionRequest
from server.testing import ServerThread
from server.tools import plan_tools
from tests.live_server import tiny_server
from tests.tiny_models import make_tiny_model, make_tokenizer

pytest.importorskip("xgrammar")

# A chat template in Qwen2.5's (Hermes') form: the tools in the system turn, calls as
# <tool_call> JSON, results as <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n\nYou may call one or more functions."
    "\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each call "
    "return <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Zürich"]},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "required": ["tz"], "properties": {"tz": {"enum": ["UTC", "CET"]}}}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def make_tools_model(path: Path) -> str:
    """A tiny random qwen3 whose chat template renders tools (TOOLS_TEMPLATE), at `path`."""
    made = make_tiny_model("qwen3", path, max_position_embeddings=4096)  # tools: ~700 tokens
    tok = make_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(made)
    return str(made)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tools_model(tmp_path_factory.mktemp("tools") / "qwen3")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    """A parser named but "auto" off: vLLM's --tool-call-parser alone."""
    with tiny_server(model_dir, settings={"tool_call_parser": "hermes"}) as s:
        yield s


@pytest.fixture(scope="module")
def demo() -> Iterator[ServerThread]:
    """The demo model with "auto" on (vLLM's --enable-auto-tool-choice)."""
    with tiny_server(str(DEMO_MODEL_DIR), settings={
            "tool_call_parser": "hermes", "enable_auto_tool_choice": True}) as s:
        yield s


def _client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def _streamed(client: openai.OpenAI, **kw: Any) -> Any:
    """The choice the SDK's stream helper accumulates from the chunks (its snapshot:
    `get_final_completion` refuses answers cut by max_tokens)."""
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        return stream.current_completion_snapshot.choices[0]


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _valid(message: Any) -> list[tuple[str, dict]]:
    """The calls, each checked: an OpenAI id, arguments that parse and follow the schema."""
    out = []
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and len(c.id) == 29
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def test_round_trip_call_result_answer(server: ServerThread) -> None:
    """required -> a valid call; its result in the next turn -> an answer, with the
    call and the result rendered by the model's template (/tokenize counts the same)."""
    client = _client(server)
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=1,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(_valid(choice.message)) == 1
    call = choice.message.tool_calls[0]
    messages: list[Any] = [*ASK, choice.message, {
        "role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=12, seed=2)
    answer = final.choices[0]
    assert isinstance(answer.message.content, str) and answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")
    body = {"messages": [m if isinstance(m, dict) else m.to_dict() for m in messages]}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with_tools = c.post("/tokenize", json={**body, "tools": TOOLS}).json()["count"]
        without = c.post("/tokenize", json=body).json()["count"]
    assert final.usage.prompt_tokens == with_tools > without  # the tools are in the prompt
    grown = final.usage.prompt_tokens - r.usage.prompt_tokens
    assert grown > len(call.function.arguments) + len('{"temp_c": 21}')


def test_named_function_and_parallel_required(server: ServerThread) -> None:
    client = _client(server)
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed,
                                           tool_choice=named, max_tokens=60, temperature=1.0)
        # a named function's call ends with "stop", as in OpenAI's API and vLLM
        assert r.choices[0].finish_reason == "stop"
        assert [n for n, _ in _valid(r.choices[0].message)] == ["get_time"]
    finished = 0
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed,
                                           tool_choice="required", max_tokens=400)
        if r.choices[0].finish_reason == "tool_calls":
            finished += 1
            assert len(_valid(r.choices[0].message)) >= 1
    assert finished >= 2


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_streaming_gives_the_same_calls(server: ServerThread, tool_choice: Any) -> None:
    """The SDK's stream helper accumulates the deltas into the non-streaming calls; the
    raw chunks carry each call's index, id, type and name first, then its arguments."""
    client = _client(server)
    kw: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                              max_tokens=200, seed=5, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = _streamed(client, **kw)
    assert _calls(streamed.message) == _calls(whole.message) and _calls(whole.message)
    assert streamed.finish_reason == whole.finish_reason
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name
    assert deltas[0].type == "function"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 3  # the arguments in pieces
    pieces = "".join(d.function.arguments or "" for d in deltas)
    assert pieces == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_required_grammar_follows_vllm() -> None:
    """tool_choice required's schema: a list (of one without parallel calls) of
    {"name": one tool, "parameters": its schema}; tools' $defs lifted to the root."""
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
           "$defs": {"P": {"type": "integer"}}}
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "parallel_tool_calls": False, "tools": [
            {"type": "function", "function": {"name": "a", "parameters": ref}},
            {"type": "function", "function": {"name": "b"}}]})
    plan = plan_tools(req, None)
    assert plan is not None and plan.structured is not None
    schema = json.loads(plan.structured.spec)
    assert schema["maxItems"] == 1 and schema["$defs"] == {"P": {"type": "integer"}}
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert not plan.structured.any_whitespace and "$defs" in ref  # the request's untouched


def test_schema_check_without_jsonschema(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without jsonschema (not a runtime dependency) the common mistakes are still 400s."""
    from server.errors import APIError
    from server.tools import check_schema

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import -> ImportError
    check_schema(WEATHER, "p")
    for bad in ({"type": "nope"}, {"properties": []}, {"required": "city"},
                {"properties": {"a": {"type": ["string", "text"]}}}):
        with pytest.raises(APIError) as e:
            check_schema(bad, "tools.3.function.parameters")
        assert e.value.param == "tools.3.function.parameters" and e.value.status == 400


def _error(c: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": "city"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" without --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "none", "messages": [
        *ASK, {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]}, "messages.2.tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "content": "12:00"}]}, "messages.1.tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_time", "arguments": "{tz: UTC"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0.tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
]


def test_bad_input_is_a_400_naming_the_field(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for body, param in BAD:
            assert _error(c, body)["param"] == param, body
        assert "--enable-auto-tool-choice" in _error(c, {"tools": TOOLS})["message"]
        good = {"messages": ASK, "max_tokens": 4, "tools": TOOLS, "tool_choice": "none"}
        assert c.post("/v1/chat/completions", json=good).status_code == 200
    with pytest.raises(openai.BadRequestError) as e:  # what an SDK user sees
        _client(server).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                tool_choice="required", max_tokens=4,
                                                response_format={"type": "json_object"})
    assert e.value.param == "response_format"


def test_unknown_parser_is_refused_at_start(capsys: pytest.CaptureFixture) -> None:
    for argv, what in ((["--tool-call-parser", "qwen"], "'qwen' is not a tool-call parser"),
                       (["--enable-auto-tool-choice"], "needs --tool-call-parser")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", "/nonexistent/model", *argv])
        assert exc.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvserve: error: ") and what in lines[0]
        assert "hermes, llama3_json, mistral, pythonic" in lines[0]


def test_auto_on_the_demo_model(demo: ServerThread) -> None:
    """Whatever the demo model writes, the answer is well-formed, streamed or not; and a
    call in Hermes' form (forced by a regex here, as a tool-trained model writes it) is
    read into tool_calls, with the text before it as content."""
    client = _client(demo)
    for seed in range(3):
        kw: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=48,
                                  seed=seed)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason in ("stop", "length", "tool_calls")
        for c in whole.message.tool_calls or []:
            assert isinstance(json.loads(c.function.arguments), dict)
        streamed = _streamed(client, **kw)
        assert streamed.finish_reason == whole.finish_reason
        assert _calls(streamed.message) == _calls(whole.message)
        assert (streamed.message.content or "") == (whole.message.content or "")
    regex = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
             r'"(Paris|Oslo)", "unit": "celsius"\}\}\n</tool_call>')
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, seed=0,
              extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    assert [n for n, _ in _valid(whole.message)] == ["get_weather"]
    streamed = _streamed(client, **kw)
    assert _calls(streamed.message) == _calls(whole.message)
    assert streamed.message.content == "Checking." and streamed.finish_reason == "tool_calls"
