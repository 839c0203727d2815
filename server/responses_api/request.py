"""A Responses API request -> the chat request it stands for, planned by the chat path.

The sampling fields (`temperature`, `top_p`, `seed`, `kv_policy`, `cache_salt`,
`priority`, vLLM's extras) pass through unchanged; the Responses-only ones are turned
into their chat forms here, and a 400 from the chat path names the field the client
sent (`tools.0.parameters`, not `tools.0.function.parameters`)."""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from server.errors import APIError, bad_request, map_exception
from server.preprocess import Preprocessor
from server.protocol import INT64_MAX, ChatCompletionRequest
from server.responses_api.output import Turn
from server.responses_api.store import ResponseStore
from server.tenants import Tenant

# Responses fields that are not chat fields: everything else goes to the chat request
_OWN = {"input", "instructions", "previous_response_id", "store", "tools", "tool_choice",
        "text", "max_output_tokens", "metadata", "reasoning", "truncation", "include",
        "background", "stream", "parallel_tool_calls", "service_tier", "top_logprobs",
        "stream_options", "prompt_cache_key", "safety_identifier"}
# chat-path params -> the Responses field they came from
_RENAMES = [(re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."),
            (re.compile(r"^messages(\..*)?$"), "input"),
            (re.compile(r"^(response_format|structured_outputs).*$"), "text.format"),
            (re.compile(r"^max_tokens$"), "max_output_tokens")]


class ResponsesFields(BaseModel):
    """The Responses-only fields, checked as strictly as the chat ones."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | Annotated[list[Any], Field(min_length=1, max_length=4096)]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    stream: StrictBool = False
    tools: Annotated[list[Any], Field(max_length=1024)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    text: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None


async def plan_turn(pre: Preprocessor, store: ResponseStore, body: dict[str, Any],
                    fields: ResponsesFields, tenant: Tenant | None) -> Turn:
    if body.get("n", 1) != 1:  # one output per response
        raise bad_request("n is not a Responses API field; one output per response", "n")
    history: list[dict[str, Any]] = []
    tenant_name = tenant.name if tenant else None
    if fields.previous_response_id is not None:
        prev = store.get(fields.previous_response_id, tenant_name)
        if prev is None:  # OpenAI's answer for an unknown (or expired) id
            raise bad_request(f"Previous response with id '{fields.previous_response_id}' "
                              "not found.", "previous_response_id",
                              "previous_response_not_found")
        history = list(prev.messages)
    conversation = history + input_messages(fields.input, _called(history))
    system = ([{"role": "system", "content": fields.instructions}]
              if fields.instructions is not None else [])
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _OWN}
    chat.update(messages=system + conversation, parallel_tool_calls=fields.parallel_tool_calls)
    if fields.max_output_tokens is not None:
        chat["max_tokens"] = fields.max_output_tokens
    if fields.tools is not None:
        chat["tools"] = chat_tools(fields.tools)
    if fields.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(fields.tool_choice)
    if (fmt := text_format(fields.text)) is not None:
        chat["response_format"] = fmt
    try:
        req = ChatCompletionRequest.model_validate(chat)
        plan = await pre.chat(req, tenant)
    except APIError as e:
        e.param = renamed(e.param)
        raise
    except Exception as e:
        raise renamed_error(e) from None
    plan.id, plan.kind, plan.stream = f"resp_{uuid.uuid4().hex}", "responses", fields.stream
    plan.max_tokens_param = "max_output_tokens"
    return Turn(plan, fields, conversation, store, tenant_name)


def renamed_error(e: Exception) -> Exception:
    """An exception as the HTTP error it means, its param the Responses field's name
    (unmapped exceptions, bugs, are returned as they are)."""
    if (err := map_exception(e)) is None:
        return e
    err.param = renamed(err.param)
    return err


def renamed(param: str | None) -> str | None:
    for pattern, to in _RENAMES:
        if param is not None and pattern.match(param):
            return pattern.sub(to, param)
    return param


def _called(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text",
                                                                  "text")
                and isinstance(part.get("text"), str)):
            raise bad_request("only text parts (input_text, output_text) are supported",
                              f"{where}.{j}")
        out.append(part["text"])
    return "".join(out)


def input_messages(items: str | list[Any], called: set[str]) -> list[dict[str, Any]]:
    """`input` as chat messages: messages, a model's function calls (on one assistant
    message, as chat has them) and their outputs (tool messages); reasoning items are
    dropped (the chat template rebuilds the prompt from the answers)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request("an input item is an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request("role must be user, system, developer or assistant",
                                  f"{where}.role")
            msgs.append({"role": role, "content": _text(item.get("content"),
                                                        f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise bad_request(f"a function_call needs {key} (a string)",
                                      f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            called.add(item["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in called:  # OpenAI's words
                raise bad_request(f"No tool call found for function call output with "
                                  f"call_id {call_id}.", f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": call_id,
                         "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise bad_request(f"input items of type {kind!r} are not supported (message, "
                              "function_call, function_call_output, reasoning)",
                              f"{where}.type")
    return msgs


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools in chat's nested shape."""
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"only function tools are supported, not {kind!r}",
                              f"tools.{i}.type")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return fmt
