"""A real agent framework over kvserve: the OpenAI Agents SDK (`openai-agents`, in the
dev extra) runs an agent with two function tools against a server on loopback, through
`/v1/responses` (the SDK's default model) and `/v1/chat/completions`. The model is a
random-weight one, so its turn is forced by a regex into Hermes-form calls of both tools
(as a tool-trained model writes them); the server's `auto` parser reads them, the SDK
runs both tools and builds the final output from their results. Tracing is off: nothing
may leave the machine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

agents = pytest.importorskip("agents")
pytest.importorskip("xgrammar")

from agents import (  # noqa: E402
    Agent,
    FunctionToolResult,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI  # noqa: E402

from server.testing import ServerThread  # noqa: E402
from tests.live_server import tiny_server  # noqa: E402
from tests.test_tools_api import make_tools_model  # noqa: E402

CALLS = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}'
         r'\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}'
         r"\n</tool_call>")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    set_tracing_disabled(True)
    path = make_tools_model(tmp_path_factory.mktemp("agents") / "qwen3")
    with tiny_server(path, settings={"tool_call_parser": "hermes",
                                     "enable_auto_tool_choice": True}) as s:
        yield s


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_two_tool_task(server: ServerThread, api: str) -> None:
    called: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(("get_weather", city))
        return f"sunny in {city}"

    @function_tool
    def get_time(tz: str) -> str:
        """The time in a time zone."""
        called.append(("get_time", tz))
        return f"12:00 {tz}"

    def both_results(_: RunContextWrapper[Any], results: list[FunctionToolResult]
                     ) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(True, "; ".join(str(r.output) for r in results))

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = (OpenAIResponsesModel("tiny", client) if api == "responses"
             else OpenAIChatCompletionsModel("tiny", client))
    agent = Agent(name="weather", instructions="Answer with the weather and the time.",
                  tools=[get_weather, get_time], model=model, tool_use_behavior=both_results,
                  model_settings=ModelSettings(max_tokens=400, extra_body={
                      "guided_regex": CALLS, "seed": 0}))
    result = Runner.run_sync(agent, "Weather in Paris, and the time?")
    assert [name for name, _ in called] == ["get_weather", "get_time"]
    city = called[0][1]
    assert city in ("Paris", "Oslo") and called[1][1] == "UTC"
    assert result.final_output == f"sunny in {city}; 12:00 UTC"
