"""Tool calling on /v1/chat/completions, the request side, as vLLM does it: `tools` and
`tool_choice` checked (400s name the field), the history's tool calls and tool results
checked and handed to the chat template as templates read them, and a `ToolPlan` that
says how each choice's text is read back.

- "none": the tools are rendered, the text is the answer.
- "auto" (the default when tools are given): the model writes calls in its own format,
  read by the server's `--tool-call-parser` (needs `--enable-auto-tool-choice`).
- "required" / a named function: decoding is constrained by a JSON schema built from
  the tools (the structured-output machinery, engine/structured.py), so the arguments
  always parse and follow the schema; the calls are read from that JSON.

The scheduler and the engine never learn about tools: they see a prompt and, at most, a
structured-output spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.sampling import StructuredOutput
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, ChatMessage, ToolDef
from server.tool_parsers import PARSERS, ToolParser
from server.tool_parsers.calls import CallStream
from server.tool_parsers.forced import NamedCallParser, RequiredCallsParser

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")  # vLLM's words
_NO_ARGS = {"type": "object", "properties": {}}
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


@dataclass
class ToolPlan:
    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as the chat template takes them
    parser: type[ToolParser] | None = None  # auto: the server's --tool-call-parser
    function: str | None = None  # named: the function's name
    parallel: bool = True
    structured: StructuredOutput | None = None  # required / named: the calls' grammar

    def stream(self) -> CallStream | None:
        """A fresh reader for one choice's text (None: the text is the answer)."""
        if self.choice == "none":
            return None
        if self.choice == "named":
            assert self.function is not None
            return CallStream(NamedCallParser(self.function))
        if self.choice == "required":
            return CallStream(RequiredCallsParser(), self.parallel)
        assert self.parser is not None
        return CallStream(self.parser(), self.parallel)

    def sampling(self, structured: StructuredOutput | None, skip_special_tokens: bool
                 ) -> tuple[StructuredOutput | None, bool]:
        """The request's structured output and skip_special_tokens, with the tools':
        the calls' grammar (with another grammar asked for too, a 400), and special
        tokens kept where the parser's markers are special tokens (as vLLM does)."""
        if self.structured is None:
            keep = self.parser is not None and self.parser.keep_special_tokens
            return structured, skip_special_tokens and not keep
        if structured is not None:
            raise bad_request(f"{structured.param} cannot be combined with tool_choice "
                              f"{self.choice!r} (the tools' schema constrains the output)",
                              structured.param)
        return self.structured, skip_special_tokens

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """vLLM's and OpenAI's: "tool_calls" after calls under auto, or required's
        complete list; a named function's call ends with "stop"."""
        if called and (self.choice == "auto" or (self.choice == "required"
                                                 and reason == "stop")):
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish_reason."""
        msg: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        stream = self.stream()
        if stream is None:
            return msg, reason
        stream.feed(text)
        stream.finish()
        msg["content"], calls = stream.message(text)
        if calls:
            msg["tool_calls"] = calls
        return msg, self.finish_reason(bool(calls), reason)


def plan_tools(req: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan | None:
    """The request's tools and tool_choice checked; None without tools. `auto_parser`:
    the server's --tool-call-parser when --enable-auto-tool-choice is on."""
    choice: Any = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given",
                              "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    for i, t in enumerate(req.tools):
        if names.index(t.function.name) != i:
            raise bad_request(f"two tools are named {t.function.name!r}",
                              f"tools.{i}.function.name")
        if t.function.parameters is not None:
            check_schema(t.function.parameters, f"tools.{i}.function.parameters")
    plan = ToolPlan("auto", [t.model_dump(exclude_none=True) for t in req.tools],
                    parallel=req.parallel_tool_calls)
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        plan.parser = PARSERS[auto_parser]
    elif choice in ("none", "required"):
        plan.choice = choice
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('a named tool_choice is {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools "
                              f"({', '.join(names)})", "tool_choice.function.name")
        plan.choice, plan.function = "named", name
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if plan.choice in ("required", "named"):
        plan.structured = _calls_grammar(req.tools, plan.function, plan.parallel)
    return plan


def _calls_grammar(tools: list[ToolDef], named: str | None, parallel: bool
                   ) -> StructuredOutput:
    """The JSON the model must write: the named function's arguments, or (required) a
    list of `{"name": one of the tools, "parameters": its arguments}` (vLLM's shape; one
    item without parallel calls). No free whitespace: a weak model cannot spend its
    tokens on it, and a call's JSON reads as models write it (", " and ": ")."""
    if named is not None:
        i = next(i for i, t in enumerate(tools) if t.function.name == named)
        schema = tools[i].function.parameters or _NO_ARGS
        return StructuredOutput("json", json.dumps(schema), f"tools.{i}.function.parameters",
                                any_whitespace=False)
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(tools):
        params = dict(t.function.parameters or _NO_ARGS)
        # "#/$defs/..." references resolve against the root: lift each tool's defs there
        for key, value in params.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise bad_request(f"two tools define $defs.{key} differently, which "
                                  "tool_choice required cannot combine",
                                  f"tools.{i}.function.parameters")
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutput("json", json.dumps(schema), "tools", any_whitespace=False)


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` unless `schema` is a JSON Schema: checked against its
    metaschema with `jsonschema` where it is installed (kvserve[structured] has it),
    else the common mistakes (a `type` JSON does not have, `properties` or `required`
    of the wrong shape), recursively."""
    try:
        from jsonschema import SchemaError, validators
    except ImportError:
        if why := _schema_mistake(schema):
            raise bad_request(f"{param} is not a valid JSON Schema: {why}", param) from None
        return
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator
                                 ).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise bad_request(f"{param} is not a valid JSON Schema: {e.message}"
                          + (f" (at {where})" if where else ""), param) from None


def _schema_mistake(schema: Any) -> str | None:
    if isinstance(schema, bool):  # true / false: any value / none
        return None
    if not isinstance(schema, dict):
        return "a schema is an object"
    kinds = schema.get("type", "object")
    if not all(k in _JSON_TYPES for k in (kinds if isinstance(kinds, list) else [kinds])):
        return f"type {kinds!r} is not a JSON type"
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return "properties must be an object"
    required = schema.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return "required must be a list of strings"
    return next(filter(None, map(_schema_mistake, props.values())), None)


def check_history(messages: list[ChatMessage]) -> None:
    """Tool calls only on assistant messages, their arguments JSON, and every tool
    result answering a call made earlier in the conversation (its tool_call_id)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls",
                              f"messages.{i}.tool_calls")
        for j, call in enumerate(m.tool_calls or []):
            if isinstance(call.function.arguments, str) and call.function.arguments.strip():
                try:
                    json.loads(call.function.arguments)
                except ValueError:
                    raise bad_request("arguments must be a JSON string", f"messages.{i}."
                                      f"tool_calls.{j}.function.arguments") from None
            called.add(call.id)
        if m.role == "tool" and m.tool_call_id not in called:
            why = ("a tool message needs the tool_call_id of the call it answers"
                   if m.tool_call_id is None else f"no earlier assistant message has a "
                   f"tool call with id {m.tool_call_id!r}")
            raise bad_request(why, f"messages.{i}.tool_call_id")


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: content as text, a call's arguments as an
    object (what transformers' tool-use templates expect, and vLLM hands them)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _as_object(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _as_object(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    return json.loads(arguments) if arguments.strip() else {}
