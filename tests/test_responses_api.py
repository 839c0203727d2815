"""`/v1/responses` end to end (server/responses_api/): a real server on loopback driven by
the `openai` SDK's `client.responses`: text and message-list input with instructions,
streaming events in OpenAI's order accumulated by the SDK's helper, a function-tool
round trip through previous_response_id (a random-weight model made to call by a named
tool_choice, so its arguments follow the schema), the store's bound and `store: false`,
and bad input as 400s naming the field while the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server.responses_api.store import ResponseStore, Stored
from server.testing import ServerThread
from tests.live_server import tiny_server
from tests.test_tools_api import TIME, WEATHER, make_tools_model

pytest.importorskip("xgrammar")

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The weather.",
     "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME}]
POLICY = {"name": "streaming", "sink": 4, "window": 64}
WIDE = {"name": "streaming", "sink": 4, "window": 1024}  # evicts nothing of a short chat


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = make_tools_model(tmp_path_factory.mktemp("responses") / "qwen3")
    with tiny_server(path, settings={"responses_store_size": 8}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_and_messages(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hello", instructions="Be brief.",
                                max_output_tokens=6, extra_body={"kv_policy": POLICY})
    assert r.object == "response" and r.id.startswith("resp_") and r.instructions
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert isinstance(r.output_text, str) and r.usage.input_tokens > 0
    assert 0 < r.usage.output_tokens <= 6
    assert r.usage.model_dump()["kv_cache"]["policy"] == "streaming"
    forced = client.responses.create(
        model="tiny", max_output_tokens=20, extra_body={"guided_regex": "Hi there\\."},
        input=[{"role": "system", "content": "Greet."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Hello"}]}])
    assert forced.status == "completed" and forced.output_text == "Hi there."
    assert client.responses.retrieve(forced.id).output_text == "Hi there."


def test_streaming_events(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="Hello", max_output_tokens=20,
                                 extra_body={"guided_regex": "Hi there, friend\\."}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == "Hi there, friend."
    assert final.usage is not None and final.usage.output_tokens >= len(deltas)  # + EOS


def _call(output: list[Any]) -> Any:
    [call] = [o for o in output if o.type == "function_call"]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    return call


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    """A named call, its output in the next turn through previous_response_id, an answer;
    streamed, the call's arguments come as deltas and match the final response's."""
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=60, extra_body={"seed": 1})
    call = _call(first.output)
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=TOOLS, tool_choice="none",
        max_output_tokens=20, extra_body={"guided_regex": "It is sunny\\."},
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"sky": "sunny"})}])
    assert second.previous_response_id == first.id and second.output_text == "It is sunny."
    # the second prompt holds the first turn, its call and the call's result
    assert second.usage.input_tokens > first.usage.input_tokens + 10

    with client.responses.stream(model="tiny", input="Weather?", tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=400, extra_body={"seed": 2}) as s:
        events = list(s)
        final = s.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert streamed and all(o.name in ("get_weather", "get_time") for o in streamed)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [o.arguments for o in streamed]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(o.arguments for o in streamed)


def test_store_false_and_unknown_ids(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    for rid in (r.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="Hi", previous_response_id=rid,
                                    max_output_tokens=2)
        assert e.value.param == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)


def test_the_store_is_bounded() -> None:
    store = ResponseStore(2)
    for rid in "abc":
        store.put(rid, Stored([], {"id": rid}, None))
        if rid == "b":
            assert store.get("a", None) is not None  # used: "b" is now the oldest
    assert len(store) == 2 and store.get("b", None) is None
    assert store.get("a", "other-tenant") is None and store.get("c", None) is not None
    empty = ResponseStore(0)
    empty.put("a", Stored([], {}, None))
    assert len(empty) == 0


BAD: list[tuple[dict[str, Any], str]] = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input.0.call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f",
                                "parameters": {"type": "nope"}}]}, "tools.0.parameters"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 9}, "temperature"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "kv_policy": "nope"}, "kv_policy"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nope"}}}}, "text.format"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_input_is_a_400_naming_the_field(server: ServerThread, body: dict[str, Any],
                                             param: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/responses", json={"model": "tiny", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        ok = c.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                           "max_output_tokens": 1})
        assert ok.status_code == 200


def test_a_follow_up_turn_reuses_the_cached_prefix(client: openai.OpenAI) -> None:
    """Turn 2's prompt starts with turn 1's: its blocks come from the prefix cache, in
    chat (the history re-sent) and in responses (previous_response_id)."""
    system = {"role": "system", "content": "You are a terse assistant for a weather desk."}
    turn1 = [system, {"role": "user", "content": "Weather in Oslo today?"}]
    first = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=4,
                                           extra_body={"kv_policy": WIDE})
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And tomorrow?"}]
    second = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4,
                                            extra_body={"kv_policy": WIDE})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= first.usage.prompt_tokens

    r1 = client.responses.create(model="tiny", instructions=system["content"],
                                 input="Weather in Bergen today?", max_output_tokens=4)
    r2 = client.responses.create(model="tiny", instructions=system["content"],
                                 previous_response_id=r1.id, input="And tomorrow?",
                                 max_output_tokens=4)
    assert 0 < r2.usage.input_tokens_details.cached_tokens <= r1.usage.input_tokens
